"""Token-code dispatch. PLACEHOLDER: the Triton kernel lands with the [codes] kernel work."""
from __future__ import annotations

import torch


def token_codes_reference(ids, code, width, dtype=torch.float32):
    return code.encode(ids, width, dtype=dtype)


def token_codes(ids, code, width, dtype=torch.float32, force_kernel=False):
    return token_codes_reference(ids, code, width, dtype=dtype)
