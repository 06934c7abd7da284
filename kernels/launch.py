"""What a launcher passes to a Triton kernel, as a value: built once, then launched or compiled.

Each launcher (``token_codes_kernel``, ``code_qkv_kernel``, ``add_code_kernel``) builds its
:class:`KernelLaunch` with a ``*_launch`` function that only allocates and computes arguments
(no device checks, no launch), so the same function fed meta tensors tells
:mod:`megafixed.kernels.compile_only` exactly which signature, constexprs and specialisation the
JIT would see at a given shape: the compile-only check cannot drift from the launch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelLaunch:
    kernel: Any  # the @triton.jit function
    grid: tuple
    args: tuple  # positional runtime arguments, in the kernel's order
    meta: dict = field(default_factory=dict)  # constexprs and launch options (num_warps), by keyword

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.meta)
