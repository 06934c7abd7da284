"""Builds this rank's model part under torchrun and reports what it allocated (rank 0 -> JSON).

    python -m torch.distributed.run --nproc-per-node 2 tests/build_worker.py OUT.json key=value ...
    python -m torch.distributed.run --nproc-per-node 2 tests/build_worker.py OUT.json --cases CASES.json key=value ...

``--cases`` builds several layouts in ONE world (each launch costs every rank its torch/DeepSpeed/
megatron imports): CASES.json is ``{case: [key=value, ...]}``, megatron's parallel_state is reset
between cases, and OUT.json holds ``{case: what a single-case run saves}``.

Records, while ``build_model`` runs: every ``GPT`` constructed and whether its parameters were on
the meta device, and the largest tensor any op produced on a real device. Afterwards: this rank's
parameter count and its parameters by plain-GPT name (to compare with the single-process model).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class LargestAllocation(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.largest = max(self.largest, t.numel())
        return out


def build_case(overrides: list[str]) -> list:
    from megafixed.config import load_config
    from megafixed.engine.deepspeed.model import build_model
    from megafixed.engine.deepspeed.ops import prepare_ops
    from megafixed.engine.deepspeed.pipeline import build_pipeline  # the engine's stages under PP
    from megafixed.model import gpt
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan

    cfg = load_config(None, overrides)
    topo = setup_distributed(RunPlan.for_launch(cfg))
    built = []
    original_init = gpt.GPT.__init__

    def recording_init(self, *a, **k):
        original_init(self, *a, **k)
        built.append(all(p.is_meta for p in self.parameters()))

    # As the engine's build does before DeepSpeed's comm starts (build_pipeline): no JIT build of the shm
    # comm op, which a fresh machine would otherwise compile here (~2 min) for an op training never calls.
    gpt.GPT.__init__ = recording_init
    with prepare_ops(accelerator_is_cpu=topo.device.type == "cpu"), LargestAllocation() as mode:
        module = build_model(cfg.model, topo, seed=cfg.train.seed, build_stages=build_pipeline)
    gpt.GPT.__init__ = original_init
    local = {n: p.detach().clone() for n, p in module.named_parameters()}
    result = {"rank": topo.rank, "tp_rank": topo.tp_rank, "pp_rank": topo.pp_rank, "tp": topo.tp, "pp": topo.pp,
              "gpts_built_on_meta": built, "largest_allocation": mode.largest,
              "local_params": sum(p.numel() for p in local.values())}
    gathered = [None] * topo.world_size
    torch.distributed.all_gather_object(gathered, {"result": result, "params": local})
    return gathered


def main(argv) -> int:
    out, rest = argv[0], argv[1:]
    if rest[:1] == ["--cases"]:
        import json

        from megafixed.engine.deepspeed.megatron_tp import load

        ps = load().parallel_state  # the engine's own way in: not megatron.core's __init__ (seconds per rank)

        with open(rest[1]) as fh:
            cases = json.load(fh)
        saved = {}
        for case, overrides in cases.items():
            if ps.model_parallel_is_initialized():  # the previous case's groups: let setup_distributed make new ones
                ps.destroy_model_parallel()
            saved[case] = build_case([*rest[2:], *overrides])
    else:
        saved = build_case(rest)
    if torch.distributed.get_rank() == 0:
        torch.save(saved, out)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Leave without DeepSpeed's atexit teardown, which has been seen to SIGABRT ("terminate called
    # without an active exception") after a finished run; the results are already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
