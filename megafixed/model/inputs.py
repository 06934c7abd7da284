"""Input interfaces: a learned embedding table, or a fixed parameter-free token code.

The fixed interface holds A and b as *buffers*, so they travel in every state dict and a
checkpoint is refused if its code differs from the one the config builds (a silent code change
would scramble every token the model ever learned).
"""
from __future__ import annotations

import torch
from torch import nn

from ..codes import CodeError, FixedCode, make_code


class LearnedInput(nn.Module):
    """The control: one trainable vector per vocabulary item."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


class FixedCodeInput(nn.Module):
    """Token ids -> tiled +-scale codes at model width; no parameters, no table in memory."""

    def __init__(self, code: FixedCode, d_model: int, vocab_size: int | None = None):
        super().__init__()
        code.check_width(d_model)
        if vocab_size is not None:
            code.check_vocab(vocab_size)
        self.code = code
        self.d_model = d_model
        # Ids are checked against the model's vocabulary, not only the code's 2^bits: an id the
        # code can represent but the head cannot predict means the data and config disagree.
        self.id_limit = int(vocab_size) if vocab_size is not None else 1 << code.bits
        self.register_buffer("code_rows", torch.tensor(code.rows, dtype=torch.int64))
        self.register_buffer("code_shift", torch.tensor(code.shift, dtype=torch.int64))
        self.register_buffer("code_scale", torch.tensor(code.scale, dtype=torch.float64))
        self.out_dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Imported lazily: the dispatch pulls in Triton only when a CUDA tensor needs it.
        from ..kernels import token_codes
        if ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(ids))  # one host sync, as the dispatch's own check
            if lo < 0 or hi >= self.id_limit:
                raise CodeError(f"token id {lo if lo < 0 else hi} is outside [0, {self.id_limit - 1}] "
                                f"(model.vocab_size={self.id_limit}); the data was tokenized with a "
                                f"different vocabulary than this config: check data.tokenizer and model.vocab_size")
        return token_codes(ids, self.code, self.d_model, dtype=self.out_dtype, validate=False)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        for name, mine in (("code_rows", self.code_rows), ("code_shift", self.code_shift),
                           ("code_scale", self.code_scale)):
            key = prefix + name
            if key in state_dict and not torch.equal(state_dict[key].to(mine.dtype).cpu(), mine.cpu()):
                error_msgs.append(
                    f"fixed code mismatch at {key}: the checkpoint was trained with a different code "
                    f"(A/b/scale) than this config builds; set model.input/model.code_seed/"
                    f"model.code_bits/model.code_scale to the values the run used")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


def build_input(cfg) -> nn.Module:
    """The input module a ``ModelConfig`` names."""
    if cfg.input == "learned":
        return LearnedInput(cfg.vocab_size, cfg.d_model)
    code = make_code(cfg.input, cfg.code_bits, cfg.code_seed, cfg.code_affine, cfg.code_scale)
    return FixedCodeInput(code, cfg.d_model, cfg.vocab_size)
