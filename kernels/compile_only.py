"""Compile every Triton kernel for NVIDIA targets on a machine with no GPU and no driver.

Each case builds its launch with the launcher's own ``*_launch`` function on meta tensors, lets
Triton's JIT binder specialise the arguments exactly as a launch would (``tt.divisibility=16`` on
16-byte-aligned pointers and on integers divisible by 16; a fresh allocation is aligned, as a meta
tensor's null pointer is), and hands the result to ``triton.compile(ASTSource(...), target=
GPUTarget("cuda", arch, 32))``, never through the JIT launcher (which asks the driver).

From the PTX: the global store instructions (``st.global.v4.b32`` is a 128-bit vector; a width not
divisible by 16 gets no specialisation, so its stores are scalar). From the bundled ``ptxas -v``:
registers per thread and spill bytes (Triton reads ``n_regs``/``n_spills`` only when a binary is
loaded on a GPU).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from megafixed.codes import make_code

ARCHS = (80, 90, 100)
PAPER_WIDTH = 2048
PAPER_BITS = 16
# A width the JIT does not specialise (2,056 % 16 = 8): 8 bf16 would fill 128 bits, yet it stores scalars.
ODD_WIDTH = 2056
# Tokens per launch at which the cases are compiled: only the grid depends on it, not the code.
CASE_TOKENS = 4096
_STORE = re.compile(r"\bst\.global(?:\.[a-z0-9]+)*")
_BITS_OF = {"b8": 8, "b16": 16, "b32": 32, "b64": 64, "u16": 16, "u32": 32, "f32": 32, "f16": 16}


@dataclass(frozen=True)
class Case:
    kernel: str  # the @triton.jit function's name
    variant: str  # e.g. "bf16 ids=int64 gf2 d=2048"
    build: Callable  # () -> KernelLaunch, built on meta tensors by the launcher's *_launch function
    bytes_per_token: int  # HBM traffic per token: ids read + activations read and written
    paper_shape: bool  # a launched paper shape: its store stream must be 128-bit vectors


@dataclass(frozen=True)
class CompileReport:
    kernel: str
    variant: str
    arch: int
    registers: int
    spill_bytes: int  # ptxas's spill stores + spill loads
    stores: dict  # store instruction -> count in the PTX
    store_bits: int  # the narrowest global store's width in bits
    bytes_per_token: int
    paper_shape: bool

    @property
    def vectorised(self) -> bool:
        return bool(self.stores) and self.store_bits == 128


def _store_bits(op: str) -> int:
    parts = op.split(".")
    lanes = next((int(p[1:]) for p in parts if re.fullmatch(r"v[248]", p)), 1)
    return lanes * _BITS_OF.get(parts[-1], 0)


def store_stream(ptx: str) -> Counter:
    """Global store instructions of a PTX listing, by opcode (``st.global.v4.b32``: 4 x 32 bits)."""
    return Counter(_STORE.findall(ptx))


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, spill bytes) from the bundled ``ptxas -v`` for ``sm_<arch>``."""
    from triton.backends.nvidia.compiler import get_ptxas

    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", str(src), "-o",
                              str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed for sm_{arch}: {res.stderr.strip()[-500:]}")
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None or not spills:
        raise RuntimeError(f"ptxas -v printed no register/spill line for sm_{arch}: {text[-500:]}")
    return int(regs.group(1)), sum(int(a) + int(b) for a, b in spills)


def compile_launch(launch, arch: int):
    """The compiled kernel (``.asm["ptx"]``) the JIT would build for ``launch`` on ``sm_<arch>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(f"{getattr(kernel, '__name__', kernel)} is not a JIT function (TRITON_INTERPRET=1 "
                           f"is set?): compile-only checks need the compiler; unset TRITON_INTERPRET")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    # Triton's own binder: the signature, constexprs and divisibility attrs a launch would get.
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.meta, bound, specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def check(case: Case, arch: int) -> CompileReport:
    compiled = compile_launch(case.build(), arch)
    ptx = compiled.asm["ptx"]
    regs, spills = ptxas_usage(ptx, arch)
    stores = store_stream(ptx)
    return CompileReport(case.kernel, case.variant, arch, regs, spills, dict(stores),
                         min((_store_bits(op) for op in stores), default=0), case.bytes_per_token, case.paper_shape)


# ----------------------------------------------------------------------------------- the cases
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _ids(id_dtype) -> torch.Tensor:
    return _meta((CASE_TOKENS,), id_dtype)


def token_codes_case(dtype, id_dtype, code_kind: str, width: int = PAPER_WIDTH) -> Case:
    from .token_codes import token_codes_launch

    code = make_code(code_kind, PAPER_BITS, seed=0)
    elem, id_bytes = torch.empty((), dtype=dtype).element_size(), torch.empty((), dtype=id_dtype).element_size()
    return Case("_token_codes_kernel", f"{_DTYPE_NAMES[dtype]} ids={str(id_dtype)[6:]} {code_kind} d={width}",
                lambda: token_codes_launch(_ids(id_dtype), code, width, dtype)[1],
                id_bytes + width * elem, width % 16 == 0)


def code_qkv_case(dtype, id_dtype, code_kind: str, width: int = PAPER_WIDTH) -> Case:
    from .fused_first_layer import code_qkv_launch

    code = make_code(code_kind, PAPER_BITS, seed=0)
    n_out = 3 * width  # q, k and v of full multi-head attention, concatenated
    elem, id_bytes = torch.empty((), dtype=dtype).element_size(), torch.empty((), dtype=id_dtype).element_size()
    return Case("_code_qkv_kernel", f"{_DTYPE_NAMES[dtype]} ids={str(id_dtype)[6:]} {code_kind} d={width}",
                lambda: code_qkv_launch(_ids(id_dtype), code, _meta((n_out, PAPER_BITS), dtype), 0.99)[1],
                id_bytes + n_out * elem, width % 16 == 0)


def add_code_case(y_dtype, id_dtype, code_kind: str, width: int = PAPER_WIDTH,
                  code_dtype=torch.float32) -> Case:
    from .fused_first_layer import add_code_launch

    code = make_code(code_kind, PAPER_BITS, seed=0)
    out_dtype = torch.promote_types(code_dtype, y_dtype)
    size = {d: torch.empty((), dtype=d).element_size() for d in (y_dtype, out_dtype, id_dtype)}
    return Case("_add_code_kernel", f"y={_DTYPE_NAMES[y_dtype]} out={_DTYPE_NAMES[out_dtype]} "
                                    f"ids={str(id_dtype)[6:]} {code_kind} d={width}",
                lambda: add_code_launch(_meta((CASE_TOKENS, width), y_dtype), _ids(id_dtype), code, code_dtype)[1],
                size[id_dtype] + width * (size[y_dtype] + size[out_dtype]), width % 16 == 0)


def paper_cases(full: bool = True) -> list[Case]:
    """The paper's shapes (width 2,048, 16-bit codes): every kernel in fp32/bf16, int32/int64 ids,
    canonical and GF(2) codes; ``full=False`` keeps one case per kernel (bf16, int64 ids, GF(2)).

    The add kernel's code is fp32 (the unfused input writes fp32 codes under autocast, see
    ``add_code``), so a bf16 ``y`` gives an fp32 residual stream."""
    dtypes = (torch.float32, torch.bfloat16) if full else (torch.bfloat16,)
    id_dtypes = (torch.int32, torch.int64) if full else (torch.int64,)
    kinds = ("canonical", "gf2") if full else ("gf2",)
    return [make(d, i, k) for make in (token_codes_case, code_qkv_case, add_code_case)
            for d in dtypes for i in id_dtypes for k in kinds]


def odd_width_case() -> Case:
    """The example that must NOT vectorise: bf16 codes at width 2,056 (not divisible by 16)."""
    return token_codes_case(torch.bfloat16, torch.int64, "gf2", width=ODD_WIDTH)


__all__ = ["ARCHS", "Case", "CompileReport", "check", "compile_launch", "odd_width_case", "paper_cases",
           "ptxas_usage", "store_stream"]
