"""A minimal DeepSpeed driver for parallel-layout tests (launched by torchrun, or run alone).

It uses the same seam as the trainer (``setup_distributed``, ``megafixed.engine.build_engine`` and
``Engine.train_step``: pipeline or plain dispatch, the once-per-step SP gradient sum), on
synthetic token batches that depend only on (seed, step), so every layout sees the same global
batch. Rank 0 writes ``{"loss": [...], "grad_norm": [...]}`` as JSON.

    python tests/parallel_worker.py OUT.json [--save DIR] [--load DIR] [--steps N] key=value ...
    python tests/parallel_worker.py OUT.json --cases CASES.json key=value ...

``--cases`` runs several layouts in ONE world (one launch instead of one per layout: each launch
costs every rank its torch/DeepSpeed/megatron imports, most of a tiny test's time). CASES.json is
``{case: {"overrides": [...], "zero": "1,2", "save": DIR, "load": DIR, "guard": true}}`` (``guard``: the
trainer's bad-step guard attached, every rank's copy of its inputs recorded, and a validation pass
after the steps); between cases megatron's
parallel_state is reset, so ``setup_distributed`` builds the case's own TP/PP/DP groups, exactly as
in a fresh launch (DeepSpeed's engine takes its mpu anew per engine). OUT.json maps each case to
what a single-case run writes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402


def global_batch(seed: int, step: int, n: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class CountingSync:
    """Counts the TP all-reduces of the sequence-parallel gradient sum (one per step expected)."""

    def __init__(self, sync):
        self.sync, self.all_reduces = sync, 0

    def finish(self):
        self.sync.finish()
        self.all_reduces += 1


class RecordingGuard:
    """The trainer's bad-step guard (never full: it judges nothing bad in a few steps), recording the
    bits of every value it is asked to judge -- the reduced loss and the global norm, as the engine's
    step hands them over -- so the ranks' copies can be compared."""

    def __init__(self):
        from megafixed.config import GuardConfig
        from megafixed.train.callbacks.guard.verdict import BadStepGuard

        self.guard, self.judged = BadStepGuard.from_config(GuardConfig()), []

    def judge(self, step, what, value):
        import struct

        self.judged.append([step, what, "none" if value is None else struct.pack("<d", float(value)).hex()])
        return self.guard.judge(step, what, value)

    def loss(self, loss, step):  # the step hook's other half: each micro batch's loss, as it is
        return loss


def validation_loss(engine, cfg, topo) -> float:
    """The engine's validation pass over one held-out global batch (its DP share), as the trainer runs it."""
    x, y = global_batch(cfg.train.seed + 99, 0, cfg.train.global_batch, cfg.data.seq_len, cfg.model.vocab_size)
    per_rank, micro = cfg.train.global_batch // topo.dp, cfg.train.micro_batch
    tokens = torch.cat([x, y[:, -1:]], dim=1)[topo.dp_rank * per_rank:(topo.dp_rank + 1) * per_rank]
    return engine.eval_loss(iter([tokens[i:i + micro] for i in range(0, per_rank, micro)]), per_rank // micro)


def run_one(cfg, topo, steps: int, save: str | None, load: str | None, start: int, guard: bool = False) -> dict:
    from megafixed.engine import build_engine

    # topo.plan is the first case's plan: batch and precision are the same for every input and ZeRO
    # stage of a case; the engine takes the stage from cfg.
    recorder = RecordingGuard() if guard else None
    engine = build_engine(cfg, topo, recorder)
    sync = engine.grad_sync = CountingSync(engine.grad_sync) if engine.grad_sync is not None else None
    agreements = []
    if guard:
        from megafixed.engine.deepspeed import step as ds_step

        real_agree = ds_step.rank0s_values

        def counted(values, device):  # the one tiny all-reduce a guarded step adds
            agreements.append(len(values))
            return real_agree(values, device)

        ds_step.rank0s_values = counted
    if load:  # weights only: how a checkpoint converted to another layout is loaded
        engine.ds.load_checkpoint(load, load_module_only=True, load_optimizer_states=False,
                                  load_lr_scheduler_states=False)
    per_rank = cfg.train.global_batch // topo.dp
    micro = cfg.train.micro_batch
    losses, norms = [], []
    for step in range(start, start + steps):
        x, y = global_batch(cfg.train.seed, step, cfg.train.global_batch, cfg.data.seq_len, cfg.model.vocab_size)
        tokens = torch.cat([x, y[:, -1:]], dim=1)[topo.dp_rank * per_rank:(topo.dp_rank + 1) * per_rank]
        batches = iter([tokens[i:i + micro] for i in range(0, per_rank, micro)])
        # the trainer's own step: pipeline or plain dispatch, the SP gradient sync, the DP-mean loss
        result = engine.train_step(batches, cfg.optimizer.lr, step + 1)  # numbered as in the logs
        losses.append(result.loss)
        norms.append(float("nan") if result.grad_norm is None else result.grad_norm)
    if save:
        engine.ds.save_checkpoint(save, tag="ckpt")
    out = {"loss": losses, "grad_norm": norms, "dp": topo.dp, "tp": topo.tp, "pp": topo.pp,
           "grad_syncs": sync.all_reduces if sync else None, **measured_state(engine.ds)}
    if guard:  # every rank's copy of the guard's inputs, and the validation loss
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, recorder.judged)
        out.update(val=validation_loss(engine, cfg, topo), judged=every[0], ranks=len(every),
                   same_bits_on_every_rank=all(j == every[0] for j in every), agreements=agreements)
        ds_step.rank0s_values = real_agree
    return out


def measured_state(engine) -> dict:
    """What this rank really holds after the steps, for the memory planner's check: its
    parameter count and the bytes of the optimizer's tensors: Adam's state and the fp32 master
    partitions ZeRO steps it on (the keys of the inner optimizer's state: ZeRO-3 empties its
    ``param_groups`` between steps)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    opt_bytes = sum(t.numel() * t.element_size() for st in inner.state.values() for k, t in st.items()
                    if torch.is_tensor(t) and k != "step")
    opt_bytes += sum(p.numel() * p.element_size() for p in inner.state)
    params = sum(p.numel() for p in engine.module.parameters())
    return {"local_params": params, "optimizer_bytes": opt_bytes}


def run_case(args_overrides: list[str], inputs: str, steps: int, zero: str | None, save: str | None,
             load: str | None, load_step: int, guard: bool = False) -> dict:
    """One layout: every input kind (and ZeRO stage), then the optional converted-checkpoint load."""
    from megafixed.config import load_config
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan

    results = {}
    topo = None
    stages = zero.split(",") if zero else [None]
    for name in inputs.split(","):
        for stage in stages:
            extra = [f"model.input={name}"] + ([f"zero.stage={stage}"] if stage else [])
            cfg = load_config(None, [*args_overrides, *extra])
            topo = topo or setup_distributed(RunPlan.for_launch(cfg))
            key = name if stage is None else f"{name}/zero{stage}"
            results[key] = run_one(cfg, topo, steps, save and os.path.join(save, name), None, 0,
                                   guard) if steps else {}
        if load:
            loaded = run_one(cfg, topo, 1, None, os.path.join(load, name), load_step)
            results[key]["loaded_loss"] = loaded["loss"][0]
    return results


def reset_model_parallel() -> None:
    """Forget the previous case's megatron-core groups, so the next setup_distributed makes its own."""
    from megafixed.engine.deepspeed.megatron_tp import load

    ps = load().parallel_state  # the engine's own way in: not megatron.core's __init__ (seconds per rank)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--inputs", default="canonical,learned", help="model.input values, one run each")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--save", default=None, help="save a checkpoint to SAVE/<input>")
    ap.add_argument("--zero", default=None, help="comma list of zero.stage values, one run each")
    ap.add_argument("--load", default=None,
                    help="after the runs, load module weights from LOAD/<input> into a fresh engine and "
                         "record its loss on batch --load-step as 'loaded_loss'")
    ap.add_argument("--load-step", type=int, default=3)
    ap.add_argument("--cases", default=None, help="JSON file of cases, each one layout, all in this world")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)

    if args.cases:
        with open(args.cases) as fh:
            cases = json.load(fh)
        results = {}
        for case, spec in cases.items():
            reset_model_parallel()
            results[case] = run_case([*args.overrides, *spec.get("overrides", [])], spec.get("inputs", args.inputs),
                                     args.steps, spec.get("zero"), spec.get("save"), spec.get("load"),
                                     args.load_step, spec.get("guard", False))
            torch.distributed.barrier()  # every rank done with this layout before the next one's groups
    else:
        results = run_case(args.overrides, args.inputs, args.steps, args.zero, args.save, args.load, args.load_step)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(results, fh)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without DeepSpeed's atexit teardown, which has been seen to SIGABRT ("terminate called
    # without an active exception") after a finished run; the results are already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
