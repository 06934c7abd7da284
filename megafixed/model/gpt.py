"""A decoder-only GPT, readable in one sitting (nanoGPT's shape, Megatron/NeoX's init).

Pre-norm blocks, RoPE, causal attention through ``scaled_dot_product_attention``, optional
grouped-query heads, GELU or SwiGLU MLP, RMSNorm or LayerNorm, an untied output head.

Nothing here knows about parallelism. Tensor parallelism swaps the ``nn.Linear`` modules named
in ``TP_PLAN`` for megatron-core layers from outside (``megafixed.parallel.tensor``); that works
because every view below infers the local head count from the tensor (``view(B, T, -1, hd)``).
Pipeline parallelism cuts ``GPT.stages()`` into DeepSpeed ``LayerSpec`` s.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .inputs import FixedCodeInput, LearnedInput, build_input

# Which Linear is split how under tensor parallelism (Megatron's scheme):
# column-parallel layers shard their output features, row-parallel ones their input features.
TP_PLAN = {"attn.wq": "column", "attn.wk": "column", "attn.wv": "column", "attn.wo": "row",
           "mlp.w_in": "column", "mlp.w_gate": "column", "mlp.w_out": "row"}


def build_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_cache(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) -- the GPT-NeoX/Llama "interleaved-free" half split."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.group = cfg.n_heads // cfg.kv_heads  # query heads per key/value head (GQA)
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.wq(x).view(B, T, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.group > 1:
            k = k.repeat_interleave(self.group, dim=2)
            v = v.repeat_interleave(self.group, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.w_in = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        if self.swiglu:
            self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.w_out = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.w_gate(x)) * self.w_in(x) if self.swiglu else F.gelu(self.w_in(x))
        return self.w_out(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = build_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = build_norm(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), cos, sin))
        return x + self.drop(self.mlp(self.norm2(x)))


class Head(nn.Module):
    """Final norm and the (untied by default) output projection to the vocabulary."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = build_norm(cfg)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """Megatron/GPT-NeoX init: N(0, 0.02) everywhere, residual output projections scaled by
    1/sqrt(2*layers) so the residual stream's variance does not grow with depth.

    Fixed codes: nothing to initialize at the input (no parameters). The codes enter at +-1 per
    element (RMS 1) rather than a learned table's ~0.02; we keep the backbone init unchanged so the
    three interfaces differ *only* in the input, as the paper requires. The first pre-norm sees a
    unit-RMS stream either way, and the residual branches start small relative to it.
    """
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    for name, p in module.named_parameters():
        if p.dim() < 2:
            if name.endswith("bias"):
                nn.init.zeros_(p)
            continue  # norm weights keep their ones
        is_residual_out = name.endswith("attn.wo.weight") or name.endswith("mlp.w_out.weight")
        nn.init.normal_(p, mean=0.0, std=out_std if is_residual_out else std)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.input = build_input(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.proj.weight = self.input.embedding.weight
        cos, sin = rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = False
        init_weights(self, cfg)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits ``[B, T, V]``, or the mean next-token loss when ``targets`` is given."""
        T = ids.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.input(ids)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        logits = self.head(x)
        if targets is None:
            return logits
        return self.loss(logits, targets)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())

    @property
    def has_fixed_input(self) -> bool:
        return isinstance(self.input, FixedCodeInput)

    @property
    def has_learned_input(self) -> bool:
        return isinstance(self.input, LearnedInput)
