"""Input modules: a learned embedding table, or a fixed parameter-free token code.

Which interface builds which module (and everything else it implies) is in ``interfaces.py``.

The fixed interface holds A and b as *buffers*, so they travel in every state dict and a
checkpoint is refused if its code differs from the one the config builds (a silent code change
would scramble every token the model ever learned).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..codes import FixedCode


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
        self.register_buffer("code_rows", torch.empty(len(code.rows), dtype=torch.int64))
        self.register_buffer("code_shift", torch.empty((), dtype=torch.int64))
        self.register_buffer("code_scale", torch.empty((), dtype=torch.float64))
        self.reset_buffers()
        self.out_dtype = torch.float32

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)write A, b and the scale from ``self.code``: after meta-device construction and
        ``to_empty`` the buffers hold garbage, and after a bf16 cast the scale must be exact again."""
        if self.code_rows.is_meta:
            return
        dev = self.code_rows.device
        self.code_rows = torch.tensor(self.code.rows, dtype=torch.int64, device=dev)
        self.code_shift = torch.tensor(self.code.shift, dtype=torch.int64, device=dev)
        self.code_scale = torch.tensor(self.code.scale, dtype=torch.float64, device=dev)

    def forward(self, ids: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The codes of ``ids``; with ``residual``, ``residual + codes`` without writing the codes (the
        fused first layer's residual add, ``megafixed.model.fused``). Both go through this forward so
        that a hook on the module (sequence parallelism's position split) serves both."""
        # No range check here: it would cost a device-to-host sync on every micro batch. Ids are
        # checked where data enters (shards at preparation, every batch on the host before the
        # copy to the device: ``megafixed.engine.batches.check_token_ids``).
        # Imported lazily: the dispatch pulls in Triton only when a CUDA tensor needs it.
        if residual is not None:
            from ..kernels.fused_first_layer import add_code

            return add_code(residual, ids, self.code, code_dtype=self.out_dtype)
        from ..kernels import token_codes
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
                    f"model.code_rows/model.code_shift/model.code_bits/model.code_scale to the values "
                    f"the run used (its config.yaml records code_rows and code_shift)")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

