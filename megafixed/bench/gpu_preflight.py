"""``python -m megafixed.bench.gpu_check preflight OUT.json``: what ``tools/gpu_check.sh`` checks before any stage.

In seconds, without touching the network: every engine the stages use imports, versions are printed
(and DeepSpeed's and megatron-core's checked against the tested range), DeepSpeed's accelerator is
``cuda``, and no DeepSpeed op has been JIT-built (``TORCH_EXTENSIONS_DIR`` stays empty). Exit 0: ready;
2: something is missing (each problem named on one line); 3: everything importable, but no CUDA device
(how the CPU test runs it).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

# module -> distribution whose version is printed. triton is needed only where there is a GPU.
# DeepSpeed is imported through the engine package (the only one that imports it): its module that
# imports DeepSpeed at import time stands for it, and DeepSpeed's version is printed.
MODULES = {"torch": "torch", "numpy": "numpy", "yaml": "pyyaml", "megafixed.engine.deepspeed.async_save": "deepspeed",
           "megatron.core": "megatron-core", "sentencepiece": "sentencepiece", "tokenizers": "tokenizers",
           "zstandard": "zstandard", "pydantic": "pydantic", "hjson": "hjson", "megafixed": None,
           "megafixed.kernels.fused_first_layer": None, "megafixed.engine.deepspeed.step": None}
SAID_AS = {"megafixed.engine.deepspeed.async_save": "deepspeed"}  # a failed import names the library


def _version(dist):
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def preflight() -> tuple[dict, list[str]]:
    t0 = time.perf_counter()
    problems, versions = [], {}
    for mod, dist in MODULES.items():
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001 - any import failure is what we report
            problems.append(f"cannot import {SAID_AS.get(mod, mod)}: {type(exc).__name__}: {exc}"[:300])
            continue
        if dist:
            versions[dist] = _version(dist)
    import torch

    cuda = torch.cuda.is_available()
    info = {"python": sys.version.split()[0], "executable": sys.executable, "versions": versions, "cuda": cuda,
            "torch_cuda": torch.version.cuda}
    if cuda:
        try:
            import triton

            versions["triton"] = triton.__version__
        except Exception as exc:  # noqa: BLE001
            problems.append(f"cannot import triton (the kernels need it on a GPU): {exc}"[:300])
        info["device_name"] = torch.cuda.get_device_name()
    from ..versions import engine_problems

    problems += engine_problems()
    try:
        from ..engine import accelerator_name

        info["deepspeed_accelerator"] = accelerator_name()
        if cuda and info["deepspeed_accelerator"] != "cuda":
            problems.append(f"DeepSpeed picked the {info['deepspeed_accelerator']!r} accelerator, not cuda: "
                            f"unset DS_ACCELERATOR")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"DeepSpeed's accelerator: {type(exc).__name__}: {exc}"[:300])
    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    built = [str(p) for p in Path(ext).rglob("*") if p.is_file()] if ext and Path(ext).is_dir() else []
    if built:
        problems.append(f"a DeepSpeed/torch op was JIT-built into {ext}: {built[:3]}")
    info["seconds"] = time.perf_counter() - t0
    return info, problems


def main(out: str) -> int:
    info, problems = preflight()
    for dist, v in sorted(info["versions"].items()):
        print(f"  {dist:16s} {v}")
    print(f"  python {info['python']} ({info['executable']}), torch CUDA {info['torch_cuda']}, "
          f"DeepSpeed accelerator {info.get('deepspeed_accelerator')}, device {info.get('device_name', 'none')}")
    for p in problems:
        print(f"error: {p}")
    code = 2 if problems else (0 if info["cuda"] else 3)
    Path(out).write_text(json.dumps({"bench": "preflight", **info, "problems": problems, "exit": code}, indent=2)
                         + "\n")
    print(f"preflight {'ok' if code != 2 else 'FAILED'} in {info['seconds']:.1f} s")
    return code
