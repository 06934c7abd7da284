"""Pipeline (and FSDP2 gradient-accumulation) layouts of the torch engine against one process.

Launched by torchrun (tests/test_native_pipeline.py) once per world size; in that one gloo world it
builds, one after another, the engine of every case named on the command line (``build_engine`` on
``setup_distributed(RunPlan.build(cfg, world))``: the engine a ``megafixed train`` of that config
builds) and trains it 4 AdamW steps on fixed batches, with a small ``optimizer.grad_clip`` so every
step is clipped and the gradient norm must be right on every rank. Rank 0 trains the independent
reference in-process: the plain single-process ``GPT`` from the same seed, stepped by the
engine's one-process ``train_step`` over all 8 sequences of each step. It writes, per case, both
losses and gradient norms for each step, the worst relative gradient difference after step 1
(every rank's gradients gathered: DTensors by ``full_tensor``, pipeline stages by gathering the
stages' dicts) and the validation losses (of the step's micro-batch count, and of another, beside the
reference's over the same rows), as JSON: the test asserts on it.

A fused case (``model.fused_first_layer=true``) is trained twice in the world, fused and unfused at
the same layout, with the fused first block's calls counted on every rank; the reference is then the
unfused single-process GPT of the same code. ``train.compile`` cases compile through Dynamo's eager
backend (``compile_through_dynamo_eager``).

    torchrun --nproc-per-node N tests/native_pipeline_worker.py OUT.json CASE [CASE ...]
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS, GLOBAL, SEQ, LR = 4, 8, 32, 3e-3
TINY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.code_bits=8",
        "model.max_seq_len=32", f"data.seq_len={SEQ}", f"train.global_batch={GLOBAL}", "train.engine=torch",
        "model.input=learned", "optimizer.grad_clip=0.05", "train.seed=5"]
FUSED = ["model.input=gf2", "model.fused_first_layer=true"]
CASES = {  # name -> overrides (world size: the launch's)
    "pp2_1f1b": ["parallel.pp=2", "train.micro_batch=2"],
    "pp2_interleaved": ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B", "parallel.vpp=2",
                        "train.micro_batch=2"],
    "pp2_zbv": ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "parallel.vpp=2", "train.micro_batch=4"],
    "dp2_accum4": ["train.micro_batch=1"],  # FSDP2 over 2 ranks, 4 micro batches per rank
    "pp2_dp2": ["parallel.pp=2", "train.micro_batch=2", "train.activation_checkpointing=true"],
    "pp2_tp2_sp": ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch=2",
                   "parallel.pp_schedule=GPipe"],
    "hsdp2x2_accum2": ["torch_engine.dp_replicate=2", "train.micro_batch=1"],
    # The fused first layer (a GF(2) code) at each layout, beside the same layout unfused (its twin)
    "dp2_fused": [*FUSED, "train.micro_batch=2"],
    "pp2_fused": [*FUSED, "parallel.pp=2", "train.micro_batch=2"],
    "hsdp2x2_fused": [*FUSED, "torch_engine.dp_replicate=2", "train.micro_batch=1"],
    "tp2_dp2_sp_fused": [*FUSED, "parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch=2"],
    "pp2_tp2_fused": [*FUSED, "parallel.pp=2", "parallel.tp=2", "train.micro_batch=2"],
    "pp2_dp2_fused": [*FUSED, "parallel.pp=2", "train.micro_batch=2", "train.activation_checkpointing=true"],
    "dp2_fused_compiled": [*FUSED, "train.micro_batch=2", "train.compile=true"],
}


def data() -> torch.Tensor:
    return torch.randint(0, 256, (STEPS * GLOBAL + 8, SEQ + 1), generator=torch.Generator().manual_seed(0))


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def capture_first_grads(optimizer, names: dict, out: dict) -> None:
    """Record every gradient (full) when ``optimizer.step`` is first called: the clipped step-1 gradient."""
    real = optimizer.step

    def step(*args, **kwargs):
        if not out:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        out[names[id(p)]] = _full(p.grad)
        return real(*args, **kwargs)

    optimizer.step = step


def reference(cfg, tokens) -> dict:
    """The single-process run: plain GPT, all 8 sequences of a step in micro batches of 1."""
    from megafixed.engine.native.step import eval_loss, train_step
    from megafixed.model.gpt import GPT
    from megafixed.run.optim import build_optimizer

    model = GPT(cfg.model, seed=cfg.train.seed)
    optimizer = build_optimizer(model, cfg.optimizer)
    grads: dict = {}
    capture_first_grads(optimizer, {id(p): n for n, p in model.named_parameters()}, grads)
    losses, norms = [], []
    for s in range(STEPS):
        rows = iter(tokens[s * GLOBAL:(s + 1) * GLOBAL].split(1))
        r = train_step(model, optimizer, rows, GLOBAL, lr=LR, dp=1, dp_group=None, grad_clip=cfg.optimizer.grad_clip)
        losses.append(r.loss)
        norms.append(r.grad_norm)
    val = eval_loss(model, iter(tokens[STEPS * GLOBAL:].split(1)), 8, dp=1, dp_group=None)
    rows = [eval_loss(model, iter([row]), 1, dp=1, dp_group=None) for row in tokens[STEPS * GLOBAL:].split(1)]
    return {"loss": losses, "grad_norm": norms, "grads": grads, "val": val, "val_rows": rows}


def run_case(overrides: list, world: int, tokens) -> dict:
    from megafixed.config import load_config
    from megafixed.engine import build_engine
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan

    cfg = load_config(None, [*TINY, *overrides])
    topo = setup_distributed(RunPlan.build(cfg, world, gpu=False))
    engine = build_engine(cfg, topo)
    grads: dict = {}
    capture_first_grads(engine.optimizer, {id(p): n for n, p in engine.module.named_parameters()}, grads)
    per, micro = GLOBAL // topo.dp, cfg.train.micro_batch
    losses, norms = [], []
    with counting_fused_blocks() as calls:
        for s in range(STEPS):
            mine = tokens[s * GLOBAL + topo.dp_rank * per: s * GLOBAL + (topo.dp_rank + 1) * per]
            r = engine.train_step(iter(mine.split(micro)), LR, s)
            losses.append(r.loss)
            norms.append(r.grad_norm)
        held = tokens[STEPS * GLOBAL:][topo.dp_rank * per:(topo.dp_rank + 1) * per]
        val = engine.eval_loss(iter(held.split(micro)), per // micro)
        # a validation pass of another micro-batch count than the schedule's (accum)
        odd = odd_count(per // micro)
        val_odd = engine.eval_loss(iter(held.split(micro)), odd)
    gathered = [None] * world
    dist.all_gather_object(gathered, (grads, calls[0]))
    full = {k: v for d, _ in gathered for k, v in d.items()}  # TP/DP peers hold equal copies
    # the meshes the parameters really live on (HSDP: a (dp_replicate, dp_shard) mesh), not the plan's words
    meshes = sorted({json.dumps([list(p.device_mesh.mesh_dim_names), list(p.device_mesh.shape)])
                     for p in engine.module.parameters() if hasattr(p, "device_mesh")})
    return {"loss": losses, "grad_norm": norms, "grads": full, "val": val, "describe": topo.plan.describe(),
            "meshes": meshes, "fused_path_taken": sum(n for _, n in gathered), "val_odd": val_odd,
            "odd_rows": [r * per + i for r in range(topo.dp) for i in range(odd * micro)]}


def odd_count(accum: int) -> int:
    """A micro-batch count other than ``accum``: 3 of 4 (fewer than 1F1B's stages need, not a multiple of
    the interleaved rounds), else 1."""
    return accum - 1 if accum > 2 else 1


@contextlib.contextmanager
def counting_fused_blocks():
    """Count the calls of the fused first block (every rank's own), so a fallback to the unfused path shows."""
    import megafixed.model.fused as fused

    calls, real = [0], fused.fused_first_block

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    fused.fused_first_block = counted
    try:
        yield calls
    finally:
        fused.fused_first_block = real


def worst(got: dict, want: dict) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:6]
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want)


def compile_through_dynamo_eager() -> None:
    """``train.compile=true`` cases: the graphs Dynamo captures (FSDP2's hooks around them, the fused
    first layer inside) run as captured, seconds instead of a minute of Inductor code generation per
    rank (tests/test_native_engine.py compiles with Inductor under FSDP2)."""
    real = torch.nn.Module.compile

    def compile(self, *args, **kwargs):
        kwargs.setdefault("backend", "eager")
        return real(self, *args, **kwargs)

    torch.nn.Module.compile = compile


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2:]
    compile_through_dynamo_eager()
    from megafixed.config import load_config

    tokens = data()
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    ref = None
    refs: dict = {}  # the model's overrides (the fused switch aside) -> its single-process run
    for name in names:
        got = run_case(CASES[name], world, tokens)
        fused = "model.fused_first_layer=true" in CASES[name]
        # a fused case's twin: the same layout, unfused
        twin = run_case([o.replace("=true", "=false") if "fused" in o else o for o in CASES[name]], world,
                        tokens) if fused else None
        if int(os.environ["RANK"]) == 0:
            model = tuple(o for o in CASES[name] if o.startswith("model.") and "fused" not in o)
            if model not in refs:
                refs[model] = reference(load_config(None, [*TINY, *model, "train.micro_batch=1"]), tokens)
            ref = refs[model]
            results[name] = {"loss": got["loss"], "ref_loss": ref["loss"], "grad_norm": got["grad_norm"],
                             "ref_grad_norm": ref["grad_norm"], "grad_rel_diff": worst(got["grads"], ref["grads"]),
                             "val": got["val"], "ref_val": ref["val"], "describe": got["describe"],
                             "meshes": got["meshes"],
                             # each DP rank's first micro batches, equal in tokens: the mean of their rows
                             "val_odd": got["val_odd"],
                             "ref_val_odd": sum(ref["val_rows"][i] for i in got["odd_rows"]) / len(got["odd_rows"])}
            if twin is not None:
                results[name]["unfused"] = {"loss": twin["loss"], "grad_norm": twin["grad_norm"], "val": twin["val"],
                                            "grad_rel_diff": worst(got["grads"], twin["grads"]),
                                            "fused_path_taken": got["fused_path_taken"],
                                            "unfused_took_it": twin["fused_path_taken"]}
        dist.barrier()
    if int(os.environ["RANK"]) == 0:
        with open(out_path, "w") as fh:
            json.dump(results, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
