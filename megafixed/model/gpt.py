"""A decoder-only GPT, readable in one sitting (nanoGPT's shape, Megatron/NeoX's init).

Pre-norm blocks, RoPE, causal attention through ``scaled_dot_product_attention``, optional
grouped-query heads, GELU or SwiGLU MLP, RMSNorm or LayerNorm, an untied output head.

Nothing here knows about parallelism. It offers three seams that the parallel layer uses from
outside (``megafixed.parallel``), instead of patching methods onto the model:

* every view infers the local head count and the sequence length from the projections
  (``view(B, T, -1, hd)`` with ``T`` taken from ``q``), so swapping ``nn.Linear`` for tensor- or
  sequence-parallel layers is all TP needs;
* ``GPT.loss_fn`` is the loss on ``(logits, targets)``; TP sets a vocabulary-parallel one;
* ``init_parameters`` draws every parameter from a generator seeded by ``(seed, name)``, so a
  shard or a pipeline stage built on the meta device gets exactly the values the single-process
  model has, without anyone holding the full model.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .interfaces import InputInterface, interface_of


def build_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_cache(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device="cpu"), inv_freq)
    return angles.cos().float(), angles.sin().float()


class Rotary(nn.Module):
    """RoPE cos/sin tables, always fp32, made on first use on each device; one per model, shared by
    every layer (and by the blocks of every pipeline stage).

    Plain attributes rather than buffers (torchtitan's ``freqs_cis`` is a non-persistent buffer, but
    complex): a module-wide cast (``.bfloat16()``, which DeepSpeed's engine applies to every module of
    every pipeline stage) would cast a real buffer, and meta-device construction would leave it
    empty; neither touches these, and no state dict or checkpoint carries them. bf16 tables carry
    ~0.4% angle error, which grows into position confusion at long contexts; Megatron keeps them fp32
    for the same reason.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.key = (head_dim, max_seq_len, float(theta))
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # str(device) -> (cos, sin)
        # The global position of this rank's first token: 0, except under context parallelism, where each
        # rank holds one contiguous slice of every sequence (``megafixed.parallel.context.shard_model``).
        self.offset = 0

    def table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``[max_seq_len, hd/2]`` tables on ``device`` (positions given per token index them)."""
        key = str(device)
        if key not in self.tables:
            # Normal tensors even when the first caller is an inference-mode eval: an inference tensor
            # kept here could not be saved for backward by a later training step of the same model.
            with torch.inference_mode(False):
                cos, sin = rope_cache(*self.key)
                self.tables[key] = (cos.to(device), sin.to(device))
        return self.tables[key]

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``seq_len`` positions from this rank's first one (fewer where the table ends)."""
        cos, sin = self.table(device)
        return cos[self.offset:self.offset + seq_len], sin[self.offset:self.offset + seq_len]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + hd/2]) -- the GPT-NeoX/Llama half split -- in fp32.

    ``cos``/``sin``: ``[T, hd/2]`` (positions 0..T-1 of every row) or ``[B, T, hd/2]`` (a position
    per token); either broadcasts over the heads of ``x`` (``[B, T, heads, hd]``)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        # What attends, from rotated heads to heads: context parallelism wraps it (Ulysses' all-to-all,
        # ``megafixed.parallel.context``; DeepSpeed's ``DistributedAttention``) and nothing else changes.
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None, *,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``cache`` (generation only): this layer's key/value cache (``megafixed.model.generate``);
        ``cos``/``sin`` then start at the cache's position. ``attn_mask``: see ``GPT.forward``."""
        return self.attend(self.wq(x), self.wk(x), self.wv(x), cos, sin, cache, attn_mask=attn_mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache=None, *, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention from the projections on: RoPE, SDPA, the output projection. Its own method so that
        the fused first layer (``megafixed.model.fused``), which makes q/k/v from token ids, runs the rest.

        ``attn_mask`` (boolean, True = may attend, broadcastable to ``[B, heads, T, T]``) replaces the
        causal mask; without it SDPA runs with ``is_causal``, its fastest kernels."""
        # B and T from q, not from the block's input: under sequence parallelism that holds T/tp
        # positions and the projections return all T. The tables' position axis is the second-last
        # one, whether shared ([S, hd/2]) or per token ([B, T, hd/2]).
        B, T = q.shape[:2]
        cos, sin = cos[..., :T, :], sin[..., :T, :]
        q = apply_rope(q.view(B, T, -1, self.head_dim), cos, sin)
        k = apply_rope(k.view(B, T, -1, self.head_dim), cos, sin)
        v = v.view(B, T, -1, self.head_dim)
        mask, causal = None, True
        if attn_mask is not None:
            if cache is not None:
                raise ValueError("attn_mask with a key/value cache is not supported")
            mask, causal = attn_mask, False
        if cache is not None:
            k, v = cache.append(k, v)  # all positions so far; queries are the last T of them
            S = k.shape[1]
            causal = S == T  # an empty cache: plain causal attention (SDPA's mask is top-left aligned)
            if not causal and T > 1:
                mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        y = self.core(q, k, v, mask=mask, causal=causal, dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.reshape(B, T, -1))


class AttentionCore(nn.Module):
    """Scaled dot-product attention on ``[B, T, heads, hd]`` queries and ``[B, S, kv_heads, hd]`` keys and
    values (GQA: each key/value head serves ``heads / kv_heads`` query heads), returning ``[B, T, heads, hd]``.

    A module of its own, without parameters, so that a context-parallel wrapper can stand in its place
    (``Attention.core``): Ulysses hands it whole sequences for a slice of the heads."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Optional[torch.Tensor] = None,
                causal: bool = True, dropout_p: float = 0.0) -> torch.Tensor:
        group = q.shape[2] // k.shape[2]
        if group > 1:
            k = k.repeat_interleave(group, dim=2)
            v = v.repeat_interleave(group, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=causal, dropout_p=dropout_p)
        return y.transpose(1, 2)


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

    def forward(self, x: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, cache=None, *,
                ids: Optional[torch.Tensor] = None, code_input: Optional[nn.Module] = None,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``ids`` with ``code_input`` (the model's fixed-code input module) in place of ``x = code_input(ids)``:
        the fused first layer (``megafixed.model.fused``). It runs here, in the block's own forward, so
        that whatever wraps a block wraps it too: FSDP2's all-gather of the block's parameters before
        its forward, activation checkpointing, ``torch.compile``. ``attn_mask``: see ``GPT.forward``."""
        if ids is not None:
            from .fused import fused_first_block

            return fused_first_block(self, code_input, ids, cos, sin, attn_mask)
        x = x + self.drop(self.attn(self.norm1(x), cos, sin, cache, attn_mask=attn_mask))
        return x + self.drop(self.mlp(self.norm2(x)))


class Head(nn.Module):
    """Final norm and the (untied by default) output projection to the vocabulary."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = build_norm(cfg)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


# ----------------------------------------------------------------------------------- init
def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` (its plain-GPT state-dict key).

    One stream per parameter, keyed by name rather than by creation order, so that (a) the
    backbone of the learned, canonical and gf2 models is identical at the same seed -- the
    learned table's draw does not shift anyone else's -- and (b) a rank can initialise its shard
    or stage alone and still match the single-process model.
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(cfg: ModelConfig, name: str, shape: torch.Size, seed: int,
               device: Optional[torch.device] = None) -> torch.Tensor:
    """The single-process initial value of parameter ``name`` (full shape, fp32, CPU).

    Megatron/GPT-NeoX init: N(0, init_std) for matrices, residual output projections scaled by
    1/sqrt(2*layers) so the residual stream's variance does not grow with depth; norm weights 1,
    biases 0. Fixed codes have nothing to initialise: the backbone init stays the same for all
    three interfaces, so the input is the only difference (the paper's design).
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if len(shape) < 2:
        return torch.ones(shape)  # norm weights
    std = cfg.init_std
    if name.endswith(("attn.wo.weight", "mlp.w_out.weight")):
        std = std / math.sqrt(2 * cfg.n_layers)
    dev = torch.device("cpu") if device is None else torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(param_seed(seed, name))
    return torch.empty(shape, device=dev).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(module: nn.Module, cfg: ModelConfig, seed: int,
                    local_slice: Optional[Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                    name_of: Callable[[str], str] = lambda n: n,
                    full_shape: Optional[Callable[[str, torch.Tensor], torch.Size]] = None,
                    device: Optional[torch.device] = None) -> None:
    """Fill every parameter of ``module`` with its single-process initial value.

    ``name_of`` maps a local parameter name to its plain-GPT key (pipeline stages rename layers);
    ``full_shape`` gives the unsharded shape and ``local_slice(name, full, param)`` this rank's
    part of it (tensor parallelism). Only one full parameter exists at a time, as in Megatron's
    CPU initialisation. ``device``: where the values are drawn (None: the CPU, which gives identical
    weights on any layout; ``Topology.init_device`` says where a run draws them).
    """
    seen: set[int] = set()
    for local_name, p in module.named_parameters():
        if id(p) in seen:  # tied weights: initialised once, through their first name
            continue
        seen.add(id(p))
        name = name_of(local_name)
        shape = full_shape(name, p) if full_shape else p.shape
        full = init_value(cfg, name, shape, seed, device)
        value = local_slice(name, full, p) if local_slice else full
        p.copy_(value.to(p.dtype))


# ----------------------------------------------------------------------------------- model
class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.input = self.interface.module(cfg)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.proj.weight = self.input.get_parameter(self.interface.table)
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
        self.activation_checkpointing = False
        # The first block straight from token ids (megafixed.model.fused); same parameters and names.
        self.fused_first_layer = bool(getattr(cfg, "fused_first_layer", False)) and self.has_fixed_input
        if not any(p.is_meta for p in self.parameters()):
            init_parameters(self, cfg, seed)  # on the meta device the parallel layer does it per shard

    def forward(self, ids: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None, cache=None, *,
                hidden: Optional[torch.Tensor] = None, layers: Optional[range] = None, head: bool = True,
                positions: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None):
        """Logits ``[B, T, V]``, or the mean next-token loss when ``targets`` is given.

        ``cache``: a ``megafixed.model.generate.KVCache`` for incremental decoding; ``ids`` are then
        the positions after the ones it holds.

        Several sequences in one row, as the packed zero-shot scorer runs them
        (``megafixed.eval.packed``): ``positions`` (``[B, T]``) is each token's RoPE position in place
        of 0..T-1, and ``attn_mask`` (boolean ``[B, 1, T, T]``, True = may attend) replaces the causal
        mask. Without them (training, generation) attention is SDPA's plain causal kernel.

        A part of the model, as a pipeline stage runs it (``megafixed.engine.native.pipeline``):
        ``hidden`` starts from these hidden states instead of from ``ids`` (a stage after the
        first), ``layers`` runs only the blocks with these indices (default all), and ``head=False``
        stops after them, returning the hidden states."""
        layers = range(len(self.blocks)) if layers is None else layers
        if positions is not None:
            if cache is not None:
                raise ValueError("positions with a key/value cache are not supported")
            cos, sin = self.rotary.table(positions.device)
            cos, sin = cos[positions], sin[positions]
        elif hidden is None:
            start = cache.length if cache is not None else 0
            cos, sin = self.rotary(start + ids.shape[1], ids.device)
            cos, sin = cos[start:], sin[start:]
        else:
            # Under sequence parallelism hidden states hold T/tp positions; every attention cuts the
            # tables to its own query length (all T), so it is handed the whole table.
            cos, sin = self.rotary(self.cfg.max_seq_len, hidden.device)
        # The fused first layer makes block 0's input from the ids inside that block (Block.forward).
        fused = hidden is None and cache is None and self.fused_first_layer and 0 in layers
        if hidden is not None:
            x = hidden
        else:
            x = None if fused else self.input(ids)
        for i in layers:
            block = self.blocks[i]
            kwargs = dict(ids=ids, code_input=self.input) if fused and i == 0 else {}
            if attn_mask is not None:
                kwargs["attn_mask"] = attn_mask
            if self.activation_checkpointing and block.training:
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False, **kwargs)
            else:
                x = block(x, cos, sin, cache.layers[i] if cache is not None else None, **kwargs)
        if not head:
            return x
        logits = self.head(x)
        if targets is None:
            return logits
        return self.loss_fn(logits, targets)

    @property
    def interface(self) -> InputInterface:
        """What the input is (``megafixed.model.interfaces``): looked up, so the model holds no copy."""
        return interface_of(self.cfg)

    @property
    def has_fixed_input(self) -> bool:
        """A fixed code (``self.input.code``), which the fused first layer folds in."""
        return self.interface.has_code

    @property
    def has_learned_input(self) -> bool:
        """A trainable table (``self.interface.table``)."""
        return self.interface.has_table


def meta_gpt(cfg: ModelConfig) -> GPT:
    """A ``GPT(cfg)`` on the meta device: its names, shapes and structure, no memory, no init draws.

    What the parameter counts, the planner, the TP/PP builder and the checkpoint converters ask of
    a model they must not allocate."""
    with torch.device("meta"):
        return GPT(cfg)
