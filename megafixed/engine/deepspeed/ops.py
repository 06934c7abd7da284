"""DeepSpeed's JIT-compiled CPU ops: where they are cached, and not building the one we never use.

On a CPU accelerator DeepSpeed compiles its shared-memory comm op (``deepspeed_shm_comm``, ~2 min
and ~180 CPU-seconds on 2 cores) the first time ``deepspeed.comm`` starts, in every process. That op
serves only ``inference_all_reduce`` (DeepSpeed's inference tensor parallelism, ``module_inject``);
training collectives go through ``torch.distributed`` whether it is built or not, and
``inference_all_reduce`` itself falls back to ``torch.distributed.all_reduce`` without it. So
``skip_unneeded_ops`` turns the build off for every world size while the engine is built (the comm backend
starts inside that build, and its one read of the switch is then done): no run waits two minutes for an op
it never calls. The entry is put back as it was afterwards, so nothing else in the process sees our switch.

Any other op DeepSpeed might JIT-build still gets a cache of its own: torch's ``cpp_extension`` keys a
build by its sources and flags only, inside ``TORCH_EXTENSIONS_DIR``; two environments (another venv's
torch, another DeepSpeed, another CPU on an NFS home) sharing that folder rebuild in turn, each
invalidating the other. So the folder is keyed by everything that changes the build: python, torch
and DeepSpeed (version and install path), the compiler and its flags from the environment, and the
CPU (DeepSpeed compiles with ``-march=native``).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
from pathlib import Path

from ...paths import cache_dir

SHM_OP = "deepspeed_shm_comm"
# DeepSpeed's switch table that skip_unneeded_ops edits, as this version has it (tests/test_startup_imports.py
# fails on another minor version, tests/test_runtime_env.py if the op gets built anyway)
WRITTEN_AGAINST = ("deepspeed", "0.19.8")
_BUILD_ENV = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS", "CPATH", "TORCH_CUDA_ARCH_LIST")


def _cpu_signature() -> str:
    """The CPU's model name and ISA flags: a ``-march=native`` build is valid only on the same kind."""
    try:
        with open("/proc/cpuinfo") as fh:
            wanted = [line for line in fh if line.startswith(("model name", "flags"))][:2]
        return "".join(wanted)
    except OSError:
        return platform.processor()


def _version_and_path(module_name: str) -> tuple[str, str]:
    """Version and install folder of an importable distribution, found without importing it (DeepSpeed's
    import must wait until DS_ACCELERATOR is set)."""
    import importlib.metadata
    import importlib.util

    try:
        version = importlib.metadata.version(module_name)
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    spec = importlib.util.find_spec(module_name)
    return version, str(Path(spec.origin).parent) if spec and spec.origin else ""


def build_key() -> str:
    """A folder name that changes whenever a JIT build of DeepSpeed's ops would differ."""
    torch_v, torch_path = _version_and_path("torch")
    ds_v, ds_path = _version_and_path("deepspeed")
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    salt = "\n".join([sys.version, sys.executable, torch_path, ds_path, platform.machine(), _cpu_signature(),
                      *(f"{k}={os.environ.get(k, '')}" for k in _BUILD_ENV)])
    digest = hashlib.sha256(salt.encode()).hexdigest()[:10]
    return f"{py}-torch{torch_v.split('+')[0]}-deepspeed{ds_v}-{digest}"


def extensions_dir() -> Path:
    """``TORCH_EXTENSIONS_DIR`` for this environment (under the user cache)."""
    return cache_dir("torch_extensions", build_key())


@contextlib.contextmanager
def skip_unneeded_ops():
    """While DeepSpeed's comm backend starts: do not compile the shm comm op (see the module docstring).

    DeepSpeed 0.19.8 has no setting for this: ``deepspeed.comm.torch.build_shm_op`` builds the op whenever
    ``deepspeed.ops.__compatible_ops__`` says it can. That table is DeepSpeed's per-launch switch table
    (computed once on first read; its own comment: "edits to it persist"), so one entry of it is False
    inside this block and back to what it was after. ``tests/test_runtime_env.py`` fails if a DeepSpeed
    upgrade builds the op anyway."""
    import deepspeed.ops

    table = deepspeed.ops.__compatible_ops__
    missing = object()
    before = table.get(SHM_OP, missing)
    table[SHM_OP] = False
    try:
        yield
    finally:
        if before is missing:
            table.pop(SHM_OP, None)
        else:
            table[SHM_OP] = before


def prepare_ops(*, accelerator_is_cpu: bool):
    """Around the first ``deepspeed.initialize``/``init_distributed`` of a process (a context manager)."""
    if not accelerator_is_cpu:
        return contextlib.nullcontext()  # on GPUs DeepSpeed JIT-builds nothing in this path
    return skip_unneeded_ops()
