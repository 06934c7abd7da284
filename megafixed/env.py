"""The one module that reads ``MEGAFIXED_*`` environment variables.

What changes a run belongs in the config (and so in the run's ``config.yaml``); the variables left
are about this machine, the launcher, how errors show, or a pause for a test. Each has one reader
below, and :data:`VARIABLES` says what it does; ``tests/test_env_vars.py`` fails if another module
reads a ``MEGAFIXED_*`` variable, or if a variable read here is missing from the table.

Every reader takes ``environ`` (default: this process's environment), so a test can pass a dict.
Parsing that needs a module's own error (a bad rendezvous timeout is a ``LaunchError``) stays in
that module: these return the raw value.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

# name -> what it does (the reader below, and the module that acts on it)
VARIABLES = {
    "MEGAFIXED_CACHE_DIR": "the user cache (prepared data, JIT-built DeepSpeed ops); default "
                           "$XDG_CACHE_HOME/megafixed, else ~/.cache/megafixed (paths.cache_dir)",
    "MEGAFIXED_TRACEBACK": "=1: an error re-raises with its traceback instead of one 'error:' line (errors.report)",
    "MEGAFIXED_ALLOW_UNTESTED": "=1: an engine library outside the tested versions warns instead of refusing "
                                "(versions.check_engines)",
    "MEGAFIXED_PEAK_TFLOPS": "dense bf16 TFLOP/s of one GPU, for MFU, where parallel/device_specs.py does not know "
                             "the device (parallel.device_specs, train.metrics)",
    "MEGAFIXED_EXPECTED_WORLD": "the world size the job asked for, set by the job script; a rank that sees another "
                                "refuses to start (launch.world.check_world)",
    "MEGAFIXED_RDZV_TIMEOUT": "seconds the rendezvous waits for every rank, 1..86400, default 120 "
                              "(launch.rendezvous); the job script passes it on",
    "MEGAFIXED_REFUSAL_GRACE_S": "seconds a refusing rank waits for the launcher to end its job before it leaves "
                                 "itself, default 10 (launch.refusal)",
    "MEGAFIXED_FORCE_TRITON": "=1: token codes through the Triton kernel on CPU tensors too, for tests of the "
                              "kernel under Triton's interpreter (kernels.token_codes)",
    "MEGAFIXED_PAUSE": "a pause point for a test or a rehearsal: POINT@N[:KEY=VALUE...][:file=PATH] "
                       "(megafixed.pause, which documents the points)",
}

# Read by the Slurm job script (launch/templates/job.sbatch), not by Python: what requeues a job.
JOB_SCRIPT_VARIABLES = {
    "MEGAFIXED_REQUEUE": "1/0: requeue the job after a preemption or a failed node (default: submit's --requeue)",
    "MEGAFIXED_MAX_REQUEUES": "how often one job is requeued before it stops, default 3",
}


def _get(name: str, environ: Optional[Mapping[str, str]]) -> str:
    assert name in VARIABLES, f"{name} is not in megafixed.env.VARIABLES"  # a reader added without its row
    return (os.environ if environ is None else environ).get(name) or ""


def _yes(value: str) -> bool:
    return value.lower() not in ("", "0", "false", "no")


def cache_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """``MEGAFIXED_CACHE_DIR`` ('' when unset)."""
    return _get("MEGAFIXED_CACHE_DIR", environ)


def traceback_wanted(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``MEGAFIXED_TRACEBACK`` is set to something other than 0/false/no."""
    return _yes(_get("MEGAFIXED_TRACEBACK", environ).strip())


def allow_untested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``MEGAFIXED_ALLOW_UNTESTED`` is set to something other than 0."""
    return _get("MEGAFIXED_ALLOW_UNTESTED", environ) not in ("", "0")


def peak_tflops(environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """``MEGAFIXED_PEAK_TFLOPS`` as a number (None when unset; a ValueError when it is not one)."""
    raw = _get("MEGAFIXED_PEAK_TFLOPS", environ)
    return float(raw) if raw else None


def expected_world(environ: Optional[Mapping[str, str]] = None) -> str:
    """``MEGAFIXED_EXPECTED_WORLD`` ('' when unset; ``launch.world`` parses it)."""
    return _get("MEGAFIXED_EXPECTED_WORLD", environ)


def rdzv_timeout(environ: Optional[Mapping[str, str]] = None) -> str:
    """``MEGAFIXED_RDZV_TIMEOUT`` ('' when unset; ``launch.rendezvous`` parses it)."""
    return _get("MEGAFIXED_RDZV_TIMEOUT", environ)


def refusal_grace(environ: Optional[Mapping[str, str]] = None) -> str:
    """``MEGAFIXED_REFUSAL_GRACE_S`` ('' when unset; ``launch.refusal`` parses it)."""
    return _get("MEGAFIXED_REFUSAL_GRACE_S", environ)


def force_triton(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``MEGAFIXED_FORCE_TRITON=1``."""
    return _get("MEGAFIXED_FORCE_TRITON", environ) == "1"


def pause(environ: Optional[Mapping[str, str]] = None) -> str:
    """``MEGAFIXED_PAUSE`` ('' when unset; ``megafixed.pause`` parses it)."""
    return _get("MEGAFIXED_PAUSE", environ).strip()
