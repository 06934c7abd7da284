"""The engine seam without DeepSpeed: the checkpoint commit protocol runs for any ``Engine``
(here a fake one that writes one file), and what the DeepSpeed engine refuses by name. Each test
takes well under a second (no process group, no engine library)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megafixed.config import ConfigError, load_config


class FileEngine:
    """A minimal ``Engine``: its checkpoint is one ``torch.save`` of a tensor."""

    name = "fake"

    def __init__(self, fail_with: BaseException | None = None):
        self.module, self.device = torch.nn.Linear(2, 2), torch.device("cpu")
        self.fail_with, self.loaded = fail_with, []

    def save(self, tag_dir, client_state, *, on_written, on_failed):
        tag_dir.mkdir(parents=True, exist_ok=True)
        if self.fail_with is not None:
            (tag_dir / "weights.pt").write_bytes(b"half")
            raise self.fail_with
        path = tag_dir / "weights.pt"
        torch.save({"w": self.module.weight.detach(), "client": client_state}, path)
        from megafixed.run.manifest import sha256_file

        on_written({str(path): {"size": path.stat().st_size, "sha256": sha256_file(path)}})

    def wait_for_saves(self):
        pass

    @property
    def saved_bytes(self):
        return 16

    def load(self, tag_dir, *, relayout=False):
        self.loaded.append((Path(tag_dir).name, relayout))
        return torch.load(Path(tag_dir) / "weights.pt", weights_only=False)["client"]


def _checkpointer(tmp_path, *overrides):
    from megafixed.train.checkpoint import Checkpointer, RunIdentity

    cfg = load_config(None, [f"train.run_dir={tmp_path / 'run'}", "train.max_steps=6", "checkpoint.interval=2",
                             "checkpoint.keep=2", "data.mock=true", *overrides])
    plan = SimpleNamespace(tp=1, pp=1, dp=1, engine_plan=SimpleNamespace(zero_stage=cfg.zero.stage),
                           precision="fp32")  # a RunPlan's layout
    topo = SimpleNamespace(rank=0, world_size=1, tp=1, pp=1, dp=1, is_main=True, plan=plan)
    return Checkpointer(cfg, topo, RunIdentity.of(cfg, plan))


def test_the_commit_protocol_runs_for_any_engine(tmp_path):
    from megafixed.run import manifest
    from megafixed.run.run_dir import RunDirectory

    ckpt, engine = _checkpointer(tmp_path), FileEngine()
    state = lambda: {"schedule": {}, "config": {}}  # noqa: E731
    saved = [ckpt.save(engine, step, step * 8, state) for step in range(1, 7)]
    assert saved == [None, "step_00000002", None, "step_00000004", None, "step_00000006"]  # its own cadence
    rd = RunDirectory(tmp_path / "run")
    assert rd.read_latest() == "step_00000006" and rd.tags() == ["step_00000004", "step_00000006"]  # rotation
    tag_dir = rd.tag_dir("step_00000006")
    names = sorted(p.name for p in tag_dir.iterdir())
    assert names == ["manifest.json", "run.json", "weights.pt"]  # no rank marker left behind
    listed = json.loads(rd.manifest_file("step_00000006").read_text())
    assert [f["name"] for f in listed["files"]] == ["run.json", "weights.pt"]
    assert listed["step"] == 6 and listed["consumed_samples"] == 48
    assert json.loads(rd.run_record_file("step_00000006").read_text())["layout"]["tp"] == 1
    assert manifest.check_file(tag_dir, {"name": "weights.pt", **listed["files"][1]}, checksum=False) is None
    assert ckpt.save(engine, 3, 24, state, force=True) == "step_00000003"  # a stop request saves off-cadence

    # ... and loads it back through the engine, the resume point verified first
    point = _checkpointer(tmp_path).resume_point()
    assert point.tag == "step_00000003" and not point.relayout
    client = ckpt.load(engine, point)
    assert engine.loaded == [("step_00000003", False)] and client["step"] == 3 and client["consumed_samples"] == 24
    assert len(client["rng"]) == 1  # every rank's RNG state went into the client state


def test_a_failed_engine_save_leaves_latest_on_the_previous_checkpoint(tmp_path):
    from megafixed.run.run_dir import RunDirectory

    ckpt = _checkpointer(tmp_path)
    state = lambda: {"schedule": {}, "config": {}}  # noqa: E731
    ckpt.save(FileEngine(), 2, 16, state)
    with pytest.raises(RuntimeError, match="boom"):
        ckpt.save(FileEngine(fail_with=RuntimeError("boom")), 4, 32, state)
    rd = RunDirectory(tmp_path / "run")
    assert rd.read_latest() == "step_00000002" and rd.tags() == ["step_00000002"]  # the partial tag is gone


def test_compile_under_pipeline_parallelism_is_refused_by_name():
    from megafixed.run_plan import RunPlan

    cfg = load_config(None, ["train.compile=true", "data.mock=true", "parallel.pp=2"])
    with pytest.raises(ConfigError, match=r"^train\.compile=true is not supported with pipeline parallelism "
                                          r"\(parallel\.pp=2\); set train\.compile=false, or parallel\.pp=1$"):
        RunPlan.build(cfg, 2, gpu=False)  # refused by the plan, before any process group or engine
    assert RunPlan.build(load_config(None, ["train.compile=true", "data.mock=true"]), 1, gpu=False).dims.pp == 1


def test_the_deepspeed_engine_has_every_member_of_the_protocol():
    from megafixed.engine.base import Engine
    from megafixed.engine.deepspeed.engine import DeepSpeedEngine

    members = {n for n in dir(Engine) if not n.startswith("_")} | set(Engine.__annotations__)
    missing = [n for n in sorted(members) if not hasattr(DeepSpeedEngine, n) and n not in ("module", "device")]
    assert not missing and isinstance(DeepSpeedEngine.module, property) and isinstance(DeepSpeedEngine.device, property)
    assert {"train_step", "eval_loss", "save", "load", "load_weights", "wait_for_saves"} <= members


# The engine seam's size: every member (method, property, annotated attribute) of every protocol in
# ``engine/protocols.py`` and ``engine/base.py``. What the trainer, the planner and the checkpoint readers
# call, and nothing else: words for messages and what an engine records are its ``EngineFacts`` (one member).
SEAM_MEMBERS = {"EngineKind": 13, "CheckpointFormat": 5, "Planner": 12, "Engine": 9, "StepHook": 2}


def _protocol_members() -> dict:
    import inspect

    from megafixed.engine import base, protocols

    out = {}
    for module in (protocols, base):
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and cls.__module__ == module.__name__ and getattr(cls, "_is_protocol", False):
                members = {n for n in vars(cls) if not n.startswith("_")} | set(cls.__dict__.get("__annotations__", {}))
                out[name] = sorted(members)
    return out


def test_the_engine_seam_does_not_regrow():
    members = _protocol_members()
    assert set(members) == set(SEAM_MEMBERS), sorted(members)  # a new protocol is counted here too
    assert members["StepHook"] == ["judge", "loss"]  # the count sees methods ...
    assert {"module", "device", "saved_bytes"} <= set(members["Engine"])  # ... annotations and properties
    sizes = {name: len(m) for name, m in members.items()}
    grown = {name: (sizes[name], most) for name, most in SEAM_MEMBERS.items() if sizes[name] > most}
    assert not grown, f"engine protocols grew past the seam's size (now, allowed): {grown}; {members}"
    assert sum(sizes.values()) <= sum(SEAM_MEMBERS.values()) == 41
