"""The resilience pieces on their own, without training: the fault grammar, the skip-steps parser and
its run-directory file, the bad-step guard's arithmetic (against numpy), the straggler verdict and the
hang watchdog's stack files and exit code (in a child process)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from megafixed import step_ranges
from megafixed.run import faults
from megafixed.train.callbacks.guard.skip import SkipSteps
from megafixed.train.callbacks.guard.verdict import BadStepGuard


def test_fault_grammar():
    got = faults.parse("nan@3:rank=1; spike@6:factor=1000;slow:rank=1:factor=2.5;hang@4;exit@9:rank=0")
    assert [(f.kind, f.step, f.rank, f.factor) for f in got] == [
        ("nan", 3, 1, 1.0), ("spike", 6, None, 1000.0), ("slow", None, 1, 2.5), ("hang", 4, None, 1.0),
        ("exit", 9, 0, 1.0)]
    assert faults.parse("spike@2")[0].factor == faults.DEFAULT_FACTOR["spike"]
    plan = faults.FaultPlan(got, rank=1)
    assert math.isnan(plan.loss_factor(3)) and plan.loss_factor(6) == 1000.0 and plan.loss_factor(5) is None
    assert faults.FaultPlan(got, rank=0).loss_factor(3) is None  # the NaN is rank 1's only
    assert plan.slow == 2.5 and faults.FaultPlan(got, rank=0).slow is None
    assert faults.FaultPlan.from_config(None, 0) is None  # unset: nothing to ask per step
    assert faults.FaultPlan.from_config("  ", 0) is None


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_drill_for_a_rank_at_or_past_the_world_size_is_refused(world):
    """Rank ``world`` does not exist in a world of ``world`` ranks (0 to world - 1): a drill for it would never
    fire, silently. The last rank that exists is accepted."""
    last = faults.FaultPlan(faults.parse(f"nan@3:rank={world - 1}"), rank=0)
    assert last.refusal(world, max_steps=10, done=0) is None
    for rank in (world, world + 1):
        plan = faults.FaultPlan(faults.parse(f"nan@3:rank={rank}"), rank=0, raw=f"nan@3:rank={rank}")
        refusal = plan.refusal(world, max_steps=10, done=0)
        assert refusal is not None and f"rank {rank} is not below the world size {world}" in refusal
        assert refusal.startswith(f"faults.inject='nan@3:rank={rank}'")


@pytest.mark.parametrize("raw, names", [
    ("nan", "needs @STEP"), ("slow@3", "takes no @STEP"), ("boom@3", "is not a fault"),
    ("nan@x", "not a number"), ("nan@0", "out of range"), ("nan@3:rank=-1", "out of range"),
    ("hang@3:factor=2", "unknown option"), ("nan@3:colour=red", "unknown option"), (";", "names no fault")])
def test_fault_grammar_refuses_in_one_line(raw, names):
    with pytest.raises(faults.InjectError) as err:
        faults.parse(raw)
    text = str(err.value)
    assert names in text and faults.KEY in text and "\n" not in text
    from megafixed.errors import describe

    assert describe(err.value)[0] == 2


def test_skip_steps_parse_and_file(tmp_path):
    assert step_ranges.parse("5-6,900-1200, 7") == [(5, 7), (900, 1200)]
    assert step_ranges.parse(["3", 4]) == [(3, 4)] and step_ranges.parse(None) == []
    for bad in ("a-b", "6-5", "0", "3-"):
        with pytest.raises(step_ranges.SkipStepsError, match="data.skip_steps"):
            step_ranges.parse(bad)
    s = SkipSteps("2", tmp_path / "faults")
    assert 2 in s and 5 not in s
    s.add_window(5, 6, reason="rollback 1: spike loss at step 6", write=True)
    again = SkipSteps("2", tmp_path / "faults")  # what a resume reads back
    assert again.ranges == [(2, 2), (5, 6)] and 6 in again and 7 not in again
    assert again.windows()[0]["reason"].startswith("rollback 1")


def test_guard_matches_numpy_and_waits_for_a_full_window():
    rng = np.random.default_rng(0)
    values = list(3.0 + 0.01 * rng.standard_normal(12))
    guard = BadStepGuard(sigma=6.0, window=8, on_nonfinite="stop", on_spike="stop")
    for i, v in enumerate(values[:8]):
        assert guard.judge(i + 1, "loss", v) is None  # window not yet full: no verdict, however odd
        guard.accept(v, None)
    window = np.array(values[:8])
    limit = window.mean() + 6.0 * window.std()  # population std, as the guard's
    assert guard.judge(9, "loss", float(limit) * (1 - 1e-9)) is None
    spike = guard.judge(9, "loss", float(limit) * (1 + 1e-9) + 1e-12)
    assert spike is not None and spike.kind == "spike" and spike.action == "stop"
    assert spike.mean == pytest.approx(window.mean()) and spike.std == pytest.approx(window.std())
    assert guard.judge(9, "loss", 0.0) is None  # one-sided: a falling loss is no fault
    nan = guard.judge(9, "grad_norm", float("nan"))
    assert nan.kind == "nonfinite" and nan.what == "grad_norm"
    restored = BadStepGuard(sigma=6.0, window=8, on_nonfinite="stop", on_spike="stop")
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))  # through a checkpoint's JSON
    assert restored.judge(9, "loss", 100.0).mean == spike.mean


def test_the_forward_clock_counts_an_injected_slowdown_as_compute():
    """``slow:factor=3`` makes a forward take 3x its CPU time, and the clock (CPU time on CPU) sees it;
    outside a step (validation) nothing is timed.

    The 3x is checked against the forwards the fault itself was shown (a run timed against another run is
    noise on a shared CI box: one such pair measured 5.7x); an unslowed clock is checked to add nothing."""
    from megafixed.train.stragglers import ForwardClock, StragglerReport

    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    plan = faults.FaultPlan(faults.parse("slow:factor=3"), rank=0)
    shown = []

    def slow_down(seconds):
        shown.append(seconds)
        plan.slow_down(seconds)

    def forwards(clock, n=20):
        clock.active = True
        for _ in range(n):
            layer(x)
        clock.active = False
        return clock.take()

    plain = ForwardClock(torch.nn.Linear(1, 1), "cpu")  # hooks on another module: never fires
    assert forwards(plain) == 0.0
    slowed = ForwardClock(layer, "cpu", on_forward=slow_down)
    slow = forwards(slowed)
    assert len(shown) == 20 and all(s > 0 for s in shown)
    # The fault spins (factor - 1) x each forward's own seconds, so the clock sees 3x them; what is over that is the
    # hook's and the spin loop's own overshoot, well under a millisecond a forward.
    assert 3.0 * sum(shown) * 0.999 <= slow <= 3.0 * sum(shown) + 20 * 1e-3, (sum(shown), slow)
    layer(x)  # inactive: not counted
    assert slowed.take() == 0.0
    rep = StragglerReport(factor=1.5, world=1, device="cpu")
    rep.add_step(0.5)
    figures = rep.gather(compute_s=0.2)
    assert figures["rank_step_s"] == [0.5] and figures["rank_compute_s"] == [0.2] and figures["stragglers"] == []
    assert figures["rank_wait_s"] == [0.3]


def test_watchdog_dumps_stacks_and_exits_hung(tmp_path):
    from megafixed import exit_codes

    code = textwrap.dedent(f"""
        import time
        from megafixed.train.watchdog import HangWatchdog
        w = HangWatchdog(timeout_s=1.0, slow_phase_s=1.0, faults_dir={str(tmp_path)!r}, rank=0, world=1).start()
        w.enter(1); w.finish(1, 0.01); w.enter(2)
        def stuck_in_a_step():
            while True:  # stuck for good: only the watchdog ends it, however long it takes to notice
                time.sleep(1)
        stuck_in_a_step()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == exit_codes.HUNG, proc.stderr
    (stack,) = tmp_path.glob("hang.step00000002.rank00000.*.txt")
    assert "stuck_in_a_step" in stack.read_text()  # the main thread's frame, dumped from the watchdog's
    assert "no step completed within 1s" in proc.stdout and "step 2" in proc.stdout


def test_submit_nodes_range_renders_and_refuses_a_shrink_that_splits_tp(tmp_path, capsys):
    from megafixed.cli import main

    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    common = [str(cfg), "--gpus-per-node", "1", "--cpu", "--dry-run", "data.mock=true", "model.vocab_size=256",
              "model.code_bits=8", f"train.run_dir={tmp_path / 'run'}", "train.global_batch=12", "train.micro_batch=2"]
    assert main(["submit", *common, "--nodes", "2-3"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=2-3" in out and "# megafixed training job: 2-3 node(s) x 1 rank(s) per node = 2-3" in out
    # No --ntasks-per-node with a range (sbatch would make it --ntasks=MIN x G: never more than MIN nodes); each
    # node's CPUs are asked for instead, and srun starts G ranks on each node the job got.
    sbatch_lines = [ln for ln in out.splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --mincpus=8" in sbatch_lines and not any("--ntasks" in ln for ln in sbatch_lines), sbatch_lines
    assert 'srun --kill-on-bad-exit=1 --ntasks="$MEGAFIXED_EXPECTED_WORLD" --ntasks-per-node=1 ' in out
    # A TP pair over two one-GPU nodes cannot lose a node: refused, naming the node count and the fix.
    assert main(["submit", *common, "--nodes", "1-2", "parallel.tp=2", "train.global_batch=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nodes 1-2: on 1 node(s) (1 ranks)" in err[0] and "raise the minimum to 2" in err[0]
    assert main(["submit", *common, "--nodes", "3-2"]) == 2
    assert "MIN must not exceed MAX" in capsys.readouterr().err


def test_the_real_quickstart_trace_gets_no_verdict_and_a_spike_in_it_does():
    """Replays the loss and grad norm of every step of a real 300-step quickstart run (recorded once in
    tests/quickstart_trace.json; the run takes ~10 min on 2 cores) through the guard's defaults."""
    from pathlib import Path

    from megafixed.config import GuardConfig

    rows = json.loads((Path(__file__).parent / "quickstart_trace.json").read_text())["steps"]
    assert [r[0] for r in rows] == list(range(1, 301))

    def replay(trace):
        guard, found = BadStepGuard.from_config(GuardConfig()), []
        for step, loss, norm in trace:
            found += [v for v in (guard.judge(step, "loss", loss), guard.judge(step, "grad_norm", norm)) if v]
            guard.accept(loss, norm)
        return found

    assert replay(rows) == []
    spiked = [list(r) for r in rows]
    spiked[250][1] *= 1.5  # the same trace with one loss 1.5x: the guard must see it
    (v,) = replay(spiked)
    assert (v.step, v.kind, v.what) == (251, "spike", "loss")


class _ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts device-to-host reads (``.item()``, ``float(t)``, ``bool(t)``): each a sync on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("extra", [("zero.stage=1",), ("zero.stage=0",), ("train.engine=torch",)])
def test_the_guard_adds_no_device_read_to_a_step(tiny_shards, tmp_path, extra):
    """The same steps with and without the guard attached read the device the same number of times
    (the guard judges the values the engine reads anyway), and the guard did judge them. Attached means
    what the trainer attaches: the guard, and the re-check's bookkeeping (its loss tap noting every micro
    batch's loss, its iterator keeping the micro batches and the RNG states)."""
    from _train_data import tiny_overrides
    from megafixed.config import load_config
    from megafixed.data.gpt_dataset import build_datasets, micro_batches
    from megafixed.engine import build_engine, prepare_runtime_env
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.callbacks import CallbackHooks
    from megafixed.train.callbacks.guard import BadSteps
    from megafixed.train.callbacks.guard.recheck import StepReplay

    cfg = load_config(None, tiny_overrides(tiny_shards, tmp_path, *extra, "guard.spike_window=2",
                                          "guard.spike_sigma=1000"))  # judged, never a verdict
    prepare_runtime_env(cfg.train.engine)
    topo = setup_distributed(RunPlan.for_launch(cfg))
    engine = build_engine(cfg, topo)
    batches = micro_batches(build_datasets(cfg.data, seed=1)["train"], 0, topo.plan.batch.micro_batch, 0, 1)
    callback = BadSteps(cfg.guard, [], cfg.train.max_steps)  # the guard with its re-check's note of each loss
    guard, hook = callback.guard, CallbackHooks([callback])
    counts = {}
    for step, attached in enumerate((None, guard, None, guard), start=1):
        # as build_engine(cfg, topo, hook) gives it, and as the trainer's re-check pulls a step's batches
        engine.hook = hook if attached else None
        with _ScalarReads() as reads:
            result = engine.train_step(StepReplay(batches) if attached else batches, 1e-3, step)
        counts.setdefault(attached is not None, []).append(reads.count)
        guard.accept(result.loss, result.grad_norm)
        assert result.verdict is None and result.grad_norm is not None
    assert counts[True] == counts[False] and counts[True][0] > 0, counts
    assert guard.windows["loss"].full and guard.windows["grad_norm"].full
    assert len(callback.seen) == 2 * topo.plan.batch.accum  # the re-check noted every micro batch's loss
