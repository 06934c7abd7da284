"""The model's config section (``model:`` in a run config; torchtitan's ``ModelArgs``): the GPT's shape and
its input interface, checked on its own. ``megafixed.config.Config.model`` holds one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..config_checks import require_at_least
from ..errors import ConfigError


@dataclass
class ModelConfig:
    vocab_size: int = 49152
    d_model: int = 2048
    n_layers: int = 32
    n_heads: int = 16
    n_kv_heads: Optional[int] = None  # None -> multi-head attention (= n_heads); fewer -> GQA
    ffn_hidden: Optional[int] = None  # None -> 4*d for gelu, ~8/3*d rounded for swiglu
    mlp: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    bias: bool = False
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    init_std: float = 0.02
    dropout: float = 0.0
    input: str = "canonical"  # an interface of megafixed.model.interfaces (learned, canonical, gf2, ...)
    code_bits: int = 16
    code_seed: int = 0
    code_affine: bool = True
    code_scale: float = 1.0
    # An explicit gf2 recoding: A's rows packed LSB-first (bit j of row i is A[i][j]) and b. When
    # given, code_seed is not used; save_config fills both in so a run's config.yaml pins its code.
    code_rows: Optional[list] = None
    code_shift: Optional[int] = None
    tie_embeddings: bool = False
    # Compute the first block's normed QKV projection and residual add from the token ids through
    # folded weights (megafixed.model.fused); same parameters, so checkpoints are interchangeable.
    fused_first_layer: bool = False

    def fixed_code(self):
        """The ``megafixed.codes.FixedCode`` that ``input`` names, built by its interface from the seven
        code fields (explicit rows/shift, as a saved config.yaml has them, win over the seed); None for
        an interface without a code. Raises ``CodeError`` for impossible fields (``validate`` turns it
        into a ConfigError)."""
        from .interfaces import interface_of

        return interface_of(self, error=ConfigError).code(self)

    def validate(self) -> None:
        require_at_least("model", self, 1, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                             "max_seq_len"))
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ConfigError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={kv}")
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError("model head dim (d_model / n_heads) must be even for RoPE")
        from .interfaces import interface_of, names
        iface = interface_of(self, error=ConfigError)
        if self.tie_embeddings and not iface.has_table:
            raise ConfigError(f"model.tie_embeddings=true needs model.input={'/'.join(names(lambda i: i.has_table))}; "
                              f"fixed codes ({self.input}) have no table to tie to the output head")
        if self.fused_first_layer and (not iface.has_code or self.norm != "rmsnorm"):
            raise ConfigError(f"model.fused_first_layer=true needs a fixed code (model.input "
                              f"{' or '.join(names(lambda i: i.has_code))}) "
                              f"and model.norm=rmsnorm (a +-s code's RMSNorm is a gamma-scaling; LayerNorm's mean "
                              f"is not), got input={self.input}, norm={self.norm}; set model.fused_first_layer=false")
        self._validate_code_rows(iface)
        from ..codes import CodeError
        try:
            iface.check(self)  # its code fits the vocabulary and the width
        except CodeError as exc:
            raise ConfigError(f"model: {exc}") from exc

    def _validate_code_rows(self, iface) -> None:
        """Check an explicit recoding here, so each mistake is named by its config key."""
        if self.code_rows is None and self.code_shift is None:
            return
        if not iface.affine_recoding:
            from .interfaces import names
            recoded = "/".join(names(lambda i: i.affine_recoding))
            raise ConfigError(f"model.code_rows/model.code_shift set an explicit gf2 recoding but model.input="
                              f"{self.input}; drop them or set model.input={recoded}")
        from ..codes import MAX_BITS, gf2_rank
        bits = self.code_bits
        if not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
            return  # make_code names a bad model.code_bits
        if self.code_rows is None:
            raise ConfigError("model.code_shift is set without model.code_rows; give A's rows too, or drop "
                              "code_shift to draw A and b from model.code_seed")
        rows = self.code_rows
        if not isinstance(rows, list) or any(isinstance(r, bool) or not isinstance(r, int) for r in rows):
            raise ConfigError(f"model.code_rows={rows!r} must be a list of integers (row i packs A[i][j] at bit j)")
        if len(rows) != bits:
            raise ConfigError(f"model.code_rows has {len(rows)} rows but model.code_bits={bits}; give exactly "
                              f"{bits} rows")
        bad = [r for r in rows if not 0 <= r < (1 << bits)]
        if bad:
            raise ConfigError(f"model.code_rows entries must be in [0, 2**{bits}) for model.code_bits={bits}, "
                              f"got {bad[:3]}")
        rank = gf2_rank(rows, bits)
        if rank < bits:
            raise ConfigError(f"model.code_rows is not invertible over GF(2) (rank {rank} < {bits}): two token "
                              f"ids would share a code; give an invertible matrix or drop code_rows to draw "
                              f"one from model.code_seed")
        shift = self.code_shift
        if shift is not None:
            if isinstance(shift, bool) or not isinstance(shift, int) or not 0 <= shift < (1 << bits):
                raise ConfigError(f"model.code_shift={shift!r} must be an integer in [0, 2**{bits})")
            if shift and not self.code_affine:
                raise ConfigError(f"model.code_shift={shift} with model.code_affine=false; set code_shift=0 "
                                  f"or code_affine=true")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.mlp == "gelu":
            return 4 * self.d_model
        return 256 * ((int(8 * self.d_model / 3) + 255) // 256)
