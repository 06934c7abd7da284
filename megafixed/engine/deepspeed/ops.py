"""DeepSpeed's JIT-compiled CPU ops: where they are cached, and not building the one we never use.

On a CPU accelerator DeepSpeed compiles its shared-memory comm op (``deepspeed_shm_comm``, ~2 min
and ~180 CPU-seconds on 2 cores) the first time ``deepspeed.comm`` starts, in every process. That op
serves only ``inference_all_reduce`` (DeepSpeed's inference tensor parallelism, ``module_inject``);
training collectives go through ``torch.distributed`` whether it is built or not, and
``inference_all_reduce`` itself falls back to ``torch.distributed.all_reduce`` without it. So
``skip_unneeded_ops`` turns the build off for every world size: a new user's first multi-rank run (and
every CI run) no longer waits two minutes for an op it never calls.

Any other op DeepSpeed might JIT-build still gets a cache of its own: torch's ``cpp_extension`` keys a
build by its sources and flags only, inside ``TORCH_EXTENSIONS_DIR``; two environments (another venv's
torch, another DeepSpeed, another CPU on an NFS home) sharing that folder rebuild in turn, each
invalidating the other. So the folder is keyed by everything that changes the build: python, torch
and DeepSpeed (version and install path), the compiler and its flags from the environment, and the
CPU (DeepSpeed compiles with ``-march=native``).
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

from ...paths import cache_dir

SHM_OP = "deepspeed_shm_comm"
NOT_IMPLEMENTED = "deepspeed_not_implemented"  # a builder DeepSpeed's table always lists as False
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


class _ProbedOnRead(dict):
    """DeepSpeed's ``__compatible_ops__`` table, probing an op only when someone reads its entry.

    DeepSpeed 0.19 fills the table on first access by probing every op it knows (``is_compatible``:
    compiler subprocesses, ``distutils``), about 0.6 s per process, although the one reader in a
    training run (``deepspeed.comm.torch.build_shm_op``) asks for one key, the shm op we switch off
    anyway. This table gives any other key exactly the answer DeepSpeed's own probe would.
    """

    def __missing__(self, name):
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible

        self[name] = probe_is_compatible(ALL_OPS[name]) if name in ALL_OPS and name != NOT_IMPLEMENTED else False
        return self[name]

    def get(self, name, default=None):
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        return self[name] if name in self or name in ALL_OPS else default


def skip_unneeded_ops() -> None:
    """Before DeepSpeed's comm backend starts: do not compile the shm comm op (see the module
    docstring). ``deepspeed.ops.__compatible_ops__`` is DeepSpeed's own per-launch switch table (it
    is computed once and edits to it persist, by design); ``build_shm_op`` reads it and returns None.
    If nothing has read the table yet, it becomes a ``_ProbedOnRead`` (no probe of ops nobody asks for)."""
    import deepspeed.ops

    if "__compatible_ops__" not in vars(deepspeed.ops):
        deepspeed.ops.__compatible_ops__ = _ProbedOnRead()
    deepspeed.ops.__compatible_ops__[SHM_OP] = False


def prepare_ops(*, accelerator_is_cpu: bool) -> None:
    """Called right before the first ``deepspeed.initialize``/``init_distributed`` of a process."""
    if not accelerator_is_cpu:
        return  # on GPUs DeepSpeed JIT-builds nothing in this path
    skip_unneeded_ops()
