"""Triton kernels, installed as ``megafixed.kernels``.

``token_codes`` is the one entry point the model calls: the Triton kernel for CUDA tensors (or
when forced under ``TRITON_INTERPRET=1``), the plain-torch reference everywhere else.
"""
from .token_codes import token_codes, token_codes_reference  # noqa: F401
