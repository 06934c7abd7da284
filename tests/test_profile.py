"""``profile.steps`` / ``profile.memory_snapshot`` (megafixed/train/callbacks/profile.py): a profiled 2-rank
run's traces, read back as JSON and checked against the steps they must hold; the summary line's top
operator against self times computed from the trace itself; the snapshot option on CPU."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _overrides(shards, run_dir, *extra):
    from _train_data import tiny_overrides

    return tiny_overrides(shards, run_dir, "train.max_steps=4", "validation.interval=0", "checkpoint.interval=100",
                          *extra)


def _self_times(events: list, tid) -> dict:
    """Self time per operator name on one thread of a Chrome trace: each complete event's duration less its
    direct children's (what the profiler's key averages call self CPU time)."""
    evs = sorted((e for e in events if e.get("ph") == "X" and e.get("tid") == tid
                  and e.get("cat") in ("cpu_op", "user_annotation")), key=lambda e: (e["ts"], -e["dur"]))
    out: dict = {}
    stack: list = []  # [event, its children's time]
    for e in evs + [{"name": "", "ts": float("inf"), "dur": 0}]:
        while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
            done, children = stack.pop()
            out[done["name"]] = out.get(done["name"], 0.0) + done["dur"] - children
        if stack:
            stack[-1][1] += e["dur"]
        stack.append([e, 0.0])
    return out


def _comm_share(events: list) -> float:
    """The share of the profiled steps' span covered by communication events, any thread, from the trace."""
    steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    lo, hi = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    spans = sorted((max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])) for e in events if e.get("ph") == "X"
                   and any(w in e["name"] for w in ("gloo", "c10d", "allreduce", "all_reduce", "all_gather")))
    covered, reach = 0.0, lo
    for a, b in spans:
        if b > reach:
            covered += b - max(a, reach)
            reach = b
    return covered / (hi - lo)


def _inside(events: list, outer: dict, name_part: str) -> bool:
    end = outer["ts"] + outer["dur"]
    return any(name_part in e["name"] and outer["ts"] <= e["ts"] <= end
               for e in events if e.get("ph") == "X" and e["tid"] == outer["tid"])


@pytest.fixture(scope="module")
def profiled(tiny_shards, tmp_path_factory, torchrun):
    run = tmp_path_factory.mktemp("profiled") / "run"
    proc = torchrun(2, ["-m", "megafixed.cli", "train", "/dev/null",
                        *_overrides(tiny_shards, run, "profile.steps=2-3", "profile.top=3")])
    return run, proc.stdout + proc.stderr


def test_a_profiled_two_rank_run_writes_one_trace_per_rank_holding_the_steps_forward_and_backward(profiled):
    run, _ = profiled
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank0_steps2-3.json", "rank1_steps2-3.json"]
    for rank in (0, 1):
        events = json.loads((run / "profile" / f"rank{rank}_steps2-3.json").read_text())["traceEvents"]
        steps = {e["name"]: e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")}
        assert sorted(steps) == ["ProfilerStep#2", "ProfilerStep#3"]  # the window, not steps 1 and 4
        for step in steps.values():
            assert _inside(events, step, "aten::mm")  # forward
            assert _inside(events, step, "MmBackward0")  # backward, from the step's own thread
            assert _inside(events, step, "c10d::allreduce_") or _inside(events, step, "all_reduce")  # DP


def test_the_summary_line_names_the_top_operator_by_self_time_and_the_communication_share(profiled):
    run, out = profiled
    lines = [ln for ln in out.splitlines() if ln.startswith("profile of steps 2-3")]
    assert len(lines) == 1, out[-3000:]  # rank 0 only
    m = re.search(r"top operators by self cpu time on rank 0: ([^;]+); "
                  r"communication in flight ([\d.]+)% of the steps' wall time", lines[0])
    assert m, lines[0]
    named = [part.rsplit(" ", 1)[0] for part in m.group(1).split(", ")]
    assert len(named) == 3
    events = json.loads((run / "profile" / "rank0_steps2-3.json").read_text())["traceEvents"]
    main = next(e["tid"] for e in events if e.get("ph") == "X" and e["name"] == "ProfilerStep#2")
    selfs = _self_times(events, main)  # the training thread: gloo's own threads hold no operator of note
    ops = sorted((t, n) for n, t in selfs.items() if not n.startswith("ProfilerStep"))
    assert named[0] == ops[-1][1], (named, ops[-5:])
    share = float(m.group(2)) / 100
    assert 0 < share < 1 and share == pytest.approx(_comm_share(events), abs=0.01)
    assert "rank*_steps2-3*.json (2 ranks)" in lines[0]


def _train_in_process(shards, run_dir, *extra):
    from megafixed.config import load_config
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    said = []
    cfg = load_config(None, _overrides(shards, run_dir, "train.max_steps=3", *extra))
    topo = setup_distributed(RunPlan.for_launch(cfg))
    result = train(cfg, topo, log=said.append)
    return [r["loss"] for r in result.history if "loss" in r], said


def test_a_memory_snapshot_on_cpu_is_one_line_and_training_goes_on_unchanged(tiny_shards, tmp_path):
    plain, _ = _train_in_process(tiny_shards, tmp_path / "plain")
    snap, said = _train_in_process(tiny_shards, tmp_path / "snap", "profile.steps=2-3", "profile.memory_snapshot=true")
    assert len(plain) == 3 and snap == plain  # the same losses, to the bit
    needs = [s for s in said if "needs CUDA" in s]
    assert needs == ["profile.memory_snapshot=true needs CUDA (this run's device is cpu): no memory snapshot; "
                     "training goes on"]
    assert sorted(p.name for p in (tmp_path / "snap" / "profile").iterdir()) == ["rank0_steps2-3.json"]


def test_a_second_profile_of_the_window_never_replaces_the_first(tmp_path):
    from megafixed.train.callbacks.profile import free_path

    (tmp_path / "rank0_steps2-3.json").write_text("{}")
    assert free_path(tmp_path, "rank0_steps2-3", ".json").name == "rank0_steps2-3.2.json"
    (tmp_path / "rank0_steps2-3.2.json").write_text("{}")
    assert free_path(tmp_path, "rank0_steps2-3", ".json").name == "rank0_steps2-3.3.json"


@pytest.mark.parametrize("value, words", [("2-3,5-6", "one window of steps"), ("3-2", "first <= last"),
                                          ("x", "not a step or a range")])
def test_a_bad_window_is_one_line(tmp_path, value, words):
    proc = subprocess.run([sys.executable, "-m", "megafixed.cli", "train", "/dev/null", f"profile.steps={value}",
                           f"train.run_dir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and words in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_snapshot_without_a_window_is_refused():
    from megafixed.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="profile.memory_snapshot=true needs profile.steps"):
        load_config(None, ["profile.memory_snapshot=true"])


def test_a_hang_dumps_the_flight_recorder_only_on_cuda_with_nccl(tmp_path, monkeypatch):
    """The guard and the file layout torch's analyzer reads (``<folder>/rank_<R>``); on CPU the dump is torch's
    generic flight recorder, the one NCCL's builds also answer."""
    import pickle

    import torch
    import torch.distributed as dist

    from megafixed.train.flight_recorder import dump_flight_recorder

    assert dump_flight_recorder(tmp_path / "fr", 1) is None  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert dump_flight_recorder(tmp_path / "fr", 1) is None and not (tmp_path / "fr").exists()  # not NCCL
    monkeypatch.setattr(dist, "get_backend", lambda *a: "cpu:gloo,cuda:nccl")
    path = dump_flight_recorder(tmp_path / "fr", 1)
    assert path == tmp_path / "fr" / "rank_1"
    assert "version" in pickle.loads(path.read_bytes())


@pytest.mark.parametrize("done, max_steps, words", [(12, 50, "those steps were done before this run started"),
                                                    (0, 9, "begins after train.max_steps=9")])
def test_a_window_the_run_never_reaches_is_said_in_one_line(tmp_path, done, max_steps, words):
    from types import SimpleNamespace

    from megafixed.config import load_config
    from megafixed.train.callbacks.profile import build

    cfg = load_config(None, ["profile.steps=10-12", f"train.max_steps={max_steps}"])
    said = []
    run = SimpleNamespace(cfg=cfg, done=done, say=said.append, run_dir=tmp_path,
                          engine=SimpleNamespace(device=SimpleNamespace(type="cpu")))
    build(cfg.profile, cfg).setup(run)
    assert len(said) == 1 and said[0].startswith("profile.steps=10-12") and words in said[0]
