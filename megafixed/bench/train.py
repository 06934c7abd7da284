"""``megafixed bench train CONFIG [overrides]``: step time, tokens/s, MFU and peak memory of a real config,
for each training engine, and each engine's overhead against a bare torch loop of the same model, batch and
optimizer -- all measured in one run.

Loops over the same batches (``data.mock=true`` gives synthetic ones without a corpus):

* **one per engine** (``--engines deepspeed,torch``, default both): exactly what ``megafixed train``
  runs per step with ``train.engine=<that engine>``: ``build_engine`` (DeepSpeed with ZeRO as
  configured; or the torch-native engine, FSDP2/DTensor as ``torch_engine.*`` say) and its
  ``train_step`` (host id check, forward/backward per micro batch, the boundary's clip + AdamW step,
  the loss all-reduce), minus logging, validation and checkpoints;
* **bare**: the numerics in plain torch (``bare_loop.py``): the same model build, activation
  checkpointing and ``train.compile`` setting, the same AdamW parameter groups, gradient
  accumulation, ``clip_grad_norm_`` and ``step``; under bf16/fp16 16-bit weights with fp32 masters
  and fp32 gradient accumulation, and fp16 with dynamic loss scaling; no engine.

``overhead = engine step time / bare step time - 1`` (medians after warm-up steps), per engine; on
CPU also ``overhead_cpu_time``, the same ratio of the process's own CPU seconds per step, which
other jobs on a shared machine disturb far less than the wall time. On a
busy CPU the loops alternate in rounds (``--rounds``, default 4 on CPU) so that every loop sees the
same load; on a GPU they run one after the other (default 1 round) and each model is freed before the
next is built, so that a 1.7B model never has to fit twice.

The JSON has one row per loop under its name (``bare``, ``deepspeed``, ``torch``), each engine's row
with its ``overhead``; ``framework`` / ``overhead`` at the top level repeat the first engine's, as
the one-engine JSON had them (``tools/gpu_check.sh``'s report reads them).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from .. import exit_codes

HELP = ("training throughput of a config per engine (deepspeed, torch): step time, tokens/s, MFU, memory, "
        "overhead vs a bare torch loop")

def _engines() -> tuple:
    """The registered engines (megafixed.engines), in the order they are measured (the default first)."""
    from ..engines import names

    return tuple(names())


def add_arguments(p):
    p.add_argument("config", help="YAML run config (examples/configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. data.mock=true")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per loop (default 10)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (allocator, autotune, compile)")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternate the two loops in this many rounds (default 4 on CPU, 1 on GPU: sequential)")
    p.add_argument("--engines", default=None, metavar="LIST",
                   help="comma-separated training engines to measure, each as train.engine=<name> would run it "
                        "(default: deepspeed,torch; an engine that refuses the config is then skipped with a note)")
    p.add_argument("--no-bare", action="store_true", help="skip the bare torch loop (no overhead figure)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: megafixed's CPU thread policy, megafixed/threads.py)")
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")


# ----------------------------------------------------------------------------------- measurement
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class _Loop:
    """One training loop: ``step()`` runs one optimizer step; times and memory are collected."""

    name = ""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list = []
        self.cpu_times: list = []  # this process's CPU seconds per step (all its threads)
        self.peak_mem: Optional[int] = None

    def timed(self, n: int, record: bool = True) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(n):
            _sync(self.device)
            t0, c0 = time.perf_counter(), time.process_time()
            self.step()
            _sync(self.device)
            if record:
                self.times.append(time.perf_counter() - t0)
                self.cpu_times.append(time.process_time() - c0)
        if self.device.type == "cuda":
            self.peak_mem = max(self.peak_mem or 0, torch.cuda.max_memory_allocated(self.device))

    def close(self) -> None:
        pass


class EngineLoop(_Loop):
    """``train_step`` of the engine ``topo.plan.engine`` names (the row is named after it)."""

    def __init__(self, cfg, topo, datasets):
        import copy

        from ..data.gpt_dataset import micro_batches
        from ..engine import build_engine

        cfg = copy.deepcopy(cfg)
        cfg.guard.on_nonfinite = "skip"  # a benchmark measures time; a non-finite loss must not stop it
        self.engine = build_engine(cfg, topo)
        self.name = topo.plan.engine
        layout = topo.plan.batch
        super().__init__(self.engine.device)
        self.cfg, self.topo, self.layout = cfg, topo, layout
        self.batches = micro_batches(datasets["train"], start_sample=0, micro_batch=layout.micro_batch,
                                     dp_rank=topo.dp_rank, dp_size=topo.dp, num_workers=cfg.data.num_workers)
        self.n = 0

    def step(self) -> None:
        self.n += 1  # steps numbered as in the logs (the first is 1)
        self.engine.train_step(self.batches, self.cfg.optimizer.lr, self.n)

    def close(self) -> None:
        self.engine = self.batches = None


class BareLoop(_Loop):
    name = "bare"

    def __init__(self, cfg, topo, datasets):
        from ..data.gpt_dataset import micro_batches
        from .bare_loop import BareLoopState

        layout = topo.plan.batch

        super().__init__(topo.device)
        self.state = BareLoopState(cfg, topo, topo.plan.precision)  # the engine's numerics in plain torch
        self.cfg, self.accum = cfg, layout.accum
        self.batches = micro_batches(datasets["train"], start_sample=0, micro_batch=layout.micro_batch, dp_rank=0,
                                     dp_size=1, num_workers=cfg.data.num_workers)

    def step(self) -> None:
        from ..engine import split_tokens

        self.state.step([split_tokens(next(self.batches), self.device, self.cfg.model.vocab_size)
                         for _ in range(self.accum)])

    def close(self) -> None:
        self.state.close()
        self.state = self.batches = None


def _stats(loop: _Loop, tokens_per_step: int, flops_tok: Optional[float], peak: Optional[float], world: int) -> dict:
    med = statistics.median(loop.times)
    tps = tokens_per_step / med
    out = {"step_s_median": med, "step_s_mean": statistics.fmean(loop.times), "step_s_min": min(loop.times),
           "steps_timed": len(loop.times), "tokens_per_s": tps,
           "mfu": None if not (flops_tok and peak) else tps * flops_tok / (peak * world),
           "peak_memory_bytes": loop.peak_mem, "step_times_s": loop.times}
    if loop.device.type == "cpu" and loop.cpu_times:
        # On a shared CPU the wall time is mostly other jobs' (a step takes 0.9 s quiet, 10 s at load
        # 10 on 2 cores); the CPU time the process itself spent is what the loops cost, so it is kept
        # beside it (on a GPU the host's CPU time says nothing: kernels run asynchronously).
        out["cpu_s_median"] = statistics.median(loop.cpu_times)
        out["cpu_times_s"] = loop.cpu_times
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(cfg, topo, *, steps: int, warmup: int, rounds: int, bare: bool, datasets=None, log=print,
            on_partial=None, topos: Optional[dict] = None) -> dict:
    """Run the loops on this rank and return the result dict (what ``--json`` writes).

    ``topos``: engine name -> this process's Topology for that engine's run plan (``train.engine``
    set to it), in the order to measure; default: ``topo``'s own engine only. ``on_partial(result)``
    gets the result so far (``"complete": false``) after each loop's timed steps, so a run stopped at
    a time limit (the 1.7B engine build) still reports the loops measured before."""
    from ..train.metrics import flops_per_token, matmul_param_count, peak_flops_per_gpu

    topos = topos or {topo.plan.engine: topo}
    layout = topo.plan.batch  # the command's run plan (megafixed.run_plan), validated when it was built
    datasets = _datasets(cfg) if datasets is None else datasets
    device = topo.device
    bare = bare and topo.world_size == 1  # a bare loop of a multi-rank layout would be a second framework
    tokens_per_step = layout.tokens_per_step
    on_cuda = device.type == "cuda"
    peak = peak_flops_per_gpu() if on_cuda else None
    flops_tok = flops_per_token(cfg.model, matmul_param_count(cfg.model), cfg.data.seq_len)
    per_round = max(1, steps // rounds)
    sequential = rounds == 1  # measure each loop to the end and free it before the next is built

    def stats(loop) -> dict:
        return _stats(loop, tokens_per_step, flops_tok, peak, topo.world_size)

    def partial() -> dict:
        out = dict(header, complete=False)
        out.update(done)
        for loop in loops:
            if loop.times:
                out[loop.name] = stats(loop)
        return out

    header = _header(cfg, topo, list(topos), warmup=warmup, rounds=rounds, flops_tok=flops_tok, peak=peak)
    # On a GPU every model is drawn there (Topology.init_device): a serial CPU draw of a 1.7B
    # model costs about a minute per build, and the step times do not depend on the values.
    def draws_here(t):
        return dataclasses.replace(t, init_device=device) if on_cuda else t

    loops: list = []  # the loops alive (alternating); a sequential run keeps only the one being measured
    done: dict = {}  # name -> stats of the loops a sequential run measured and freed

    def start(make):
        loop = make()
        loop.timed(warmup, record=False)
        loops.append(loop)
        if sequential:
            loop.timed(steps)
            done[loop.name] = stats(loop)
            loop.close()
            loops.remove(loop)
            _free(device)
            if on_partial is not None:
                on_partial(partial())  # the figures so far survive a stop in the next build

    if bare:
        start(lambda: BareLoop(cfg, draws_here(topo), datasets))
    rss_bare = _peak_rss_bytes()
    for name, t in topos.items():
        start(lambda t=t, name=name: EngineLoop(_engine_cfg(cfg, name), draws_here(t), datasets))
    for _ in range(0 if sequential else rounds):
        for loop in loops:
            loop.timed(per_round)
            if on_partial is not None:
                on_partial(partial())
    result = dict(header, complete=True)
    result.update(done)
    for loop in loops:
        result[loop.name] = stats(loop)
    if not on_cuda:
        result["peak_rss_bytes"] = {"after_bare": rss_bare if bare else None, "end": _peak_rss_bytes()}
    _add_overheads(result, topos)
    for loop in loops:
        loop.close()
    _free(device)
    return result


def _datasets(cfg):
    if cfg.data.mock:
        from ..data.mock import build_mock_datasets
        return build_mock_datasets(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
    from ..data.gpt_dataset import build_datasets
    return build_datasets(cfg.data, seed=cfg.train.seed)


def _header(cfg, topo, engines: list, *, warmup: int, rounds: int, flops_tok, peak) -> dict:
    """What the result says of the run before any figure (the layout, the numerics, the machine)."""
    from ..run.run_record import engine_layout

    plan, layout, device = topo.plan, topo.plan.batch, topo.device
    on_cuda = device.type == "cuda"
    # the plan's engine's own layout keys (DeepSpeed's zero_stage), as its run record has them
    own = engine_layout(plan)
    return {"bench": "train", "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if on_cuda else "cpu",
            "precision": plan.precision, "world_size": topo.world_size, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp,
            "engines": engines, **own, "input": cfg.model.input,
            "fused_first_layer": cfg.model.fused_first_layer,
            "activation_checkpointing": cfg.train.activation_checkpointing, "compile": cfg.train.compile,
            "global_batch": layout.global_batch, "micro_batch": layout.micro_batch, "accum": layout.accum,
            "seq_len": cfg.data.seq_len, "tokens_per_step": layout.tokens_per_step, "mock_data": cfg.data.mock,
            "warmup_steps": warmup, "rounds": rounds, "flops_per_token": flops_tok,
            "peak_flops_per_gpu": peak, "cpu_threads": None if on_cuda else torch.get_num_threads(),
            "torch": torch.__version__}


def _add_overheads(result: dict, topos: dict) -> None:
    """Each engine's step time against the bare loop's, measured in the same run."""
    for name in topos:
        row = result[name]
        row["overhead"] = (row["step_s_median"] / result["bare"]["step_s_median"] - 1.0
                           if "bare" in result else None)
        if "bare" in result and "cpu_s_median" in row:
            row["overhead_cpu_time"] = row["cpu_s_median"] / result["bare"]["cpu_s_median"] - 1.0
    first = next(iter(topos))  # the one-engine JSON's keys, for its readers (tools/gpu_check.sh's report)
    result["framework"], result["overhead"] = result[first], result[first]["overhead"]


def _engine_cfg(cfg, engine: str):
    """``cfg`` with ``train.engine=engine`` (what a run plan for that engine was built from)."""
    import copy

    c = copy.deepcopy(cfg)
    c.train.engine = engine
    return c


def report_lines(r: dict) -> list[str]:
    def one(name):
        s = r[name]
        mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else (
            "unknown (no data-sheet peak for this device; MEGAFIXED_PEAK_TFLOPS sets one)"
            if r["device"].startswith("cuda") else "n/a")
        mem = "n/a" if s["peak_memory_bytes"] is None else f"{s['peak_memory_bytes'] / 2**30:.1f} GiB"
        return (f"{name:9s} step {s['step_s_median'] * 1e3:9.1f} ms (median of {s['steps_timed']})  "
                f"{s['tokens_per_s']:12,.0f} tokens/s  MFU {mfu}  peak memory {mem}")

    engines = r.get("engines", [])
    lines = [f"{r['input']} input, {r['precision']} on {r['device_name']}, {r['tokens_per_step']:,} tokens/step "
             f"(global batch {r['global_batch']} = micro {r['micro_batch']} x accum {r['accum']} x dp {r['dp']})"]
    lines += [one(n) for n in ("bare", *engines) if n in r]
    overheads = [f"{n} {100 * r[n]['overhead']:+.1f}%" for n in engines if r[n].get("overhead") is not None]
    if overheads:
        cpu = [f"{n} {100 * r[n]['overhead_cpu_time']:+.1f}%" for n in engines if "overhead_cpu_time" in r[n]]
        lines.append(f"framework overhead vs the bare loop: {', '.join(overheads)}"
                     + (f" (in process CPU time: {', '.join(cpu)})" if cpu else ""))
    for name, why in r.get("skipped", {}).items():
        lines.append(f"{name:9s} not measured: {why}")
    return lines


def _plans(cfg, engines: Optional[str]) -> tuple[dict, dict]:
    """(engine -> RunPlan for this launch, engine -> why it was skipped). An engine named in
    ``--engines`` that refuses the config fails the command by name; one only there by default is
    skipped with its reason (a pp=2 config is still benchmarked on DeepSpeed)."""
    from ..config import ConfigError
    from ..run_plan import RunPlan

    explicit = engines is not None
    known = _engines()
    names = [n.strip() for n in (engines or ",".join(known)).split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names or len(set(names)) != len(names):
        raise ConfigError(f"--engines {engines!r}: name each of {', '.join(known)} at most once, comma-separated "
                          f"(e.g. --engines deepspeed,torch)")
    plans, skipped = {}, {}
    for name in names:
        try:
            plans[name] = RunPlan.for_launch(_engine_cfg(cfg, name))
        except ConfigError as exc:  # LayoutError is one: the engine's refusal, by name
            if explicit:
                raise
            skipped[name] = str(exc)
    if not plans:
        raise ConfigError("no engine can run this config: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    return plans, skipped


def run(args) -> int:
    from ..config import ConfigError, load_config
    from ..data.prepare import prepare_data
    from ..engine import prepare_runtime_env
    from ..outputs import claim_output
    from ..parallel import setup_distributed

    if args.steps < 1 or args.warmup_steps < 0 or (args.rounds is not None and args.rounds < 1) or (
            args.threads is not None and args.threads < 1):
        raise ConfigError("--steps must be >= 1, --warmup-steps >= 0, --rounds >= 1 and --threads >= 1")
    from ..threads import apply_thread_policy
    apply_thread_policy(args.threads, knob="--threads N or OMP_NUM_THREADS=N")
    if args.json is not None:
        claim_output([args.json], overwrite=args.overwrite, what="benchmark output")
    prepare_runtime_env()
    cfg = load_config(args.config, args.overrides)
    plans, skipped = _plans(cfg, args.engines)  # every engine's refusal before anything is built
    # One process group serves every engine (setup_distributed starts it once); each engine gets the
    # Topology of its own plan (megatron's groups for DeepSpeed under TP, a DeviceMesh for torch).
    topos = {name: setup_distributed(plan) for name, plan in plans.items()}
    topo = next(iter(topos.values()))
    cfg = prepare_data(cfg, is_main=topo.is_main)
    rounds = args.rounds or (1 if topo.device.type == "cuda" else 4)
    rounds = min(rounds, args.steps)
    from ..atomic import atomic_write_text

    def save_partial(partial: dict) -> None:
        if topo.is_main and args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(args.json, json.dumps(dict(partial, skipped=skipped), indent=2) + "\n")

    result = measure(cfg, topo, steps=args.steps, warmup=args.warmup_steps, rounds=rounds, bare=not args.no_bare,
                     on_partial=save_partial, topos=topos)
    result["skipped"] = skipped
    result["command"] = {"config": args.config, "overrides": list(args.overrides), "steps": args.steps,
                         "engines": list(plans)}
    if topo.is_main:
        print("\n".join(report_lines(result)))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return exit_codes.OK
