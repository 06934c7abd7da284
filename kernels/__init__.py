"""Triton kernels, installed as ``megafixed.kernels``.

``token_codes`` is the one entry point the model calls: the Triton kernel for CUDA tensors (or
when forced under ``TRITON_INTERPRET=1``), the plain-torch reference everywhere else. Triton is
optional: without it every call takes the torch path.
"""
from .token_codes import (  # noqa: F401
                          HAVE_TRITON,
                          KERNEL_DTYPES,
                          kernel_is_interpreted,
                          token_codes,
                          token_codes_kernel,
                          token_codes_reference,
)
