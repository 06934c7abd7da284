"""The engine registry (``megafixed.engines``): a toy third engine, registered inside this test and
nowhere else, plans, dry-runs, sizes, records and refuses through the same code the two real
engines use -- nothing in megafixed names it. In-process, no training (well under a minute)."""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

from megafixed import engines
from megafixed.cli import main
from megafixed.config import ConfigError, load_config
from megafixed.engine import protocols as roles
from megafixed.parallel.layout import LayoutError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "examples" / "configs" / "quickstart.yaml")
PAPER = str(ROOT / "examples" / "configs" / "paper-1.7b-canonical.yaml")
MARKER = "toy.marker"


@pytest.fixture(scope="module", autouse=True)
def modules_before_this_file():
    return set(sys.modules)


@dataclasses.dataclass(frozen=True)
class ToyPlan:
    zero_stage: int  # the toy shards like ZeRO (it borrows DeepSpeed's planner arithmetic)
    flavour: str
    start_words: str = "toy engine (vanilla)"  # what shards the state, in the trainer's start line


class ToyCheckpoint:
    """The toy's checkpoint format (``megafixed.engine.protocols.CheckpointFormat``): one marker file holding JSON."""

    def read_state_dict(self, tag_dir, *, verify=True):
        return {"toy": json.loads((Path(tag_dir) / MARKER).read_text())}

    def weights_in_every_rank_file(self, tag_dir):
        return False

    def detect_layout(self, tag_dir):
        return 1, 1

    def recorded_model_config(self, tag_dir):
        return None

    def to_relayout_format(self, tag_dir, model_cfg, out=None, log=print):
        raise ValueError("toy checkpoints reshard on load")


class ToyKind:
    """A toy engine (``megafixed.engine.protocols.EngineKind``), registered by a test; it borrows the
    default's planner."""

    name = "toy"
    checkpoint = ToyCheckpoint()

    def __init__(self):
        # its own words, files and record keys; the default's table column and notes, as it borrows its planner
        self.facts = dataclasses.replace(engines.default_kind().facts, default=False, record_file="toy.json",
                                         config_title="toy engine", dry_run_words="toy {flavour}",
                                         checkpoint_marker=MARKER, model_files=re.escape(MARKER),
                                         record_keys=("flavour",), derived_dirs=())

    @property
    def planner(self):
        return engines.default_kind().planner

    def make_plan(self, cfg, dp, device="cpu"):
        return ToyPlan(zero_stage=0, flavour="vanilla")

    def check_supported(self, cfg, plan):
        if plan.pp > 1:
            raise LayoutError("train.engine=toy has no pipeline; use parallel.pp=1")

    def relayout(self, old, new):
        return roles.Relayout(("tp", "dp", "flavour"),
                              None if old.get("engine") == new.get("engine") else "not a toy checkpoint")

    def setup_groups(self, plan):
        return {}

    def build(self, cfg, topo, checks=None):
        pytest.fail("a dry run must not build")

    def engine_config(self, cfg, plan):
        return {"flavour": plan.engine_plan.flavour, "dp": plan.dp}

    def prepare_runtime_env(self):
        pass

    def accelerator_name(self):
        return "cpu"

    def dry_run_lines(self, cfg, plan):
        return []


@pytest.fixture
def toy():
    kind = engines.register(ToyKind())
    yield kind
    engines.unregister("toy")


def test_the_built_in_engines_register_one_record_each():
    names = engines.names()
    assert names[0] == engines.default_kind().name  # the default first
    assert len(names) == len(set(names)) >= 2
    assert engines.kind_of({}).facts.default  # a layout without "engine" (import hf, convert): the default engine's
    with pytest.raises(ConfigError, match=r"train\.engine='nope' is not one of"):
        load_config(QUICKSTART, ["train.engine=nope"])
    # the registry module imports no engine library (nor does looking an engine up)
    assert "deepspeed" not in engines.__dict__ and all("import deepspeed" not in type(k).__doc__
                                                       for k in engines.kinds())


def test_a_toy_engine_plans_and_dry_runs(toy, capsys):
    from megafixed.run_plan import RunPlan

    cfg = load_config(QUICKSTART, ["train.engine=toy", "data.mock=true"])
    plan = RunPlan.build(cfg, 2, gpu=False)
    assert (plan.engine, plan.engine_plan, plan.engine_plan.flavour) == ("toy", ToyPlan(0, "vanilla"), "vanilla")
    assert plan.config is cfg  # what runs reads this plan's own config
    assert main(["train", QUICKSTART, "--dry-run", "--world-size", "2", "--target", "cpu",
                 "train.engine=toy", "data.mock=true"]) == 0
    out = capsys.readouterr().out
    assert "# toy engine config (written to <run_dir>/toy.json by a real run)" in out
    assert '"flavour": "vanilla"' in out and "toy vanilla. Nothing was started." in out
    assert "deepspeed" not in out.split("# toy engine config")[1]


def test_a_toy_engine_refuses_by_its_own_rule(toy, capsys):
    code = main(["train", QUICKSTART, "--dry-run", "--world-size", "2", "--target", "cpu",
                 "train.engine=toy", "data.mock=true", "parallel.pp=2", "model.n_layers=2"])
    err = capsys.readouterr().err
    assert code != 0 and "train.engine=toy has no pipeline; use parallel.pp=1" in err


def test_a_toy_engine_describes_and_records_itself(toy, tmp_path):
    from megafixed.run.run_dir import RunDirectory
    from megafixed.run.run_record import record_engine, record_layout
    from megafixed.run_plan import RunPlan
    from megafixed.train.resume import layout_changes
    from megafixed.train.trainer import _start_line

    cfg = load_config(QUICKSTART, ["train.engine=toy", "data.mock=true"])
    plan = RunPlan.build(cfg, 2, gpu=False)
    assert "toy engine (vanilla)" in _start_line(cfg, plan)
    lay = record_layout(plan)
    assert lay == {"tp": 1, "pp": 1, "dp": 2, "flavour": "vanilla", "precision": "fp32", "engine": "toy"}
    assert record_engine({"layout": lay}) == "toy" and record_engine({"layout": {}}) == engines.default_kind().name
    assert layout_changes({"layout": dict(lay, dp=1, flavour="spicy")}, plan) == [
        "the data-parallel size (world size / (tp*pp)) 1 -> 2", "flavour spicy -> vanilla"]
    assert RunDirectory(tmp_path).engine_config_file("toy") == tmp_path / "toy.json"
    from megafixed.engine import relayout_refusal

    assert relayout_refusal(dict(lay), dict(lay, dp=4)) is None
    assert relayout_refusal({"engine": engines.default_kind().name}, lay) == "not a toy checkpoint"


def test_a_toy_checkpoint_is_read_by_the_toy_engines_detector(toy, tmp_path):
    from megafixed.engine import is_model_file, weights_in_every_rank_file
    from megafixed.engine.weights import detect_layout, gather_state_dict, resolve_tag_dir

    (tmp_path / MARKER).write_text(json.dumps([1, 2, 3]))
    assert engines.checkpoint_kind(tmp_path) is toy
    assert gather_state_dict(tmp_path) == {"toy": [1, 2, 3]}
    assert resolve_tag_dir(tmp_path) == tmp_path and detect_layout(tmp_path) == (1, 1)
    assert is_model_file(MARKER) and not weights_in_every_rank_file(tmp_path)
    assert engines.checkpoint_kind(tmp_path / "elsewhere").facts.default  # no toy marker: the default's format


def test_plan_sizes_a_toy_engine(toy, capsys):
    assert main(["plan", PAPER, "--gpus", "8", "train.engine=toy", "--json"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "toy" and out["layouts"], out
    assert all(lay["layout"]["pp"] == 1 for lay in out["layouts"])  # the toy's refusal of pp > 1 holds


def _missing(obj, protocol) -> list:
    """The members of ``protocol`` (its methods, properties and annotated attributes) ``obj`` lacks."""
    members = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
    return sorted(m for m in members if not hasattr(obj, m))


def test_every_engine_answers_every_member_of_its_protocols(toy):
    # no member is optional (callers never ask with a default), so a missing one would fail only when called
    for kind in engines.kinds():
        for obj, protocol in ((kind, roles.EngineKind), (kind.checkpoint, roles.CheckpointFormat),
                              (kind.planner, roles.Planner)):
            assert not _missing(obj, protocol), (kind.name, protocol.__name__, _missing(obj, protocol))
    assert {"build", "checkpoint", "facts"} <= set(_missing(object(), roles.EngineKind))  # it can fail
    assert {"make_layout", "stage_bounds"} <= set(_missing(object(), roles.Planner))
    for kind in engines.kinds():  # its facts are all there, and only a default format claims folders unmarked
        assert isinstance(kind.facts, roles.EngineFacts)
        assert (kind.facts.checkpoint_marker is None) == kind.facts.default, kind.name


def test_the_toy_touched_no_engine_library(modules_before_this_file):
    # run last in this file: nothing above (planning, a dry run, a toy checkpoint) imported DeepSpeed's
    # runtime through the toy (`megafixed plan` may import DeepSpeed's partitioner for the default's arithmetic).
    # Counted from this file's first test: a test worker may have run another file's engine in this process.
    assert "megafixed.engine.native.build" not in set(sys.modules) - modules_before_this_file

