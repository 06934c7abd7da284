"""The trainer in one process: interfaces learn, checkpoints carry the codes, schedules, the
non-finite guard, the pipeline branch, and the run-dir artefacts."""
from __future__ import annotations

import math

import pytest
import torch

from _metrics import read_metrics
from _train_data import tiny_overrides, write_shards
from megafixed.config import load_config
from megafixed.train.checkpoint import CheckpointError, read_latest
from megafixed.train.schedule import LRSchedule


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"))


def run(prefix, run_dir, *extra, stop=None, poison_lr=False):
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.trainer import train

    cfg = load_config(None, tiny_overrides(prefix, run_dir, *extra))
    if poison_lr:  # past the config's range check on purpose: the guard under test is the trainer's
        cfg.optimizer.lr = 1e30
    return train(cfg, setup_distributed(RunPlan.for_launch(cfg)), stop=stop, log=lambda *_: None)


# ----------------------------------------------------------------------------------- pure parts
def test_schedules_by_hand():
    s = LRSchedule(kind="cosine", lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=104)
    assert [s.lr_at(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr_at(4) == 1.0 and s.lr_at(54) == pytest.approx(0.55) and s.lr_at(104) == pytest.approx(0.1)
    assert s.lr_at(500) == pytest.approx(0.1)
    lin = LRSchedule(kind="linear", lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10)
    assert lin.lr_at(5) == pytest.approx(0.5)
    wsd = LRSchedule(kind="wsd", lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=100, wsd_decay_fraction=0.2)
    assert wsd.lr_at(79) == 1.0 and wsd.lr_at(90) == pytest.approx(0.5) and wsd.lr_at(100) == pytest.approx(0.0)
    assert LRSchedule(kind="constant", lr=0.3, min_lr=0, warmup_steps=2, decay_steps=9).lr_at(8) == 0.3


def test_weight_decay_groups():
    from megafixed.model import GPT
    from megafixed.run.optim import param_groups

    cfg = load_config(None, ["model.input=learned", "model.bias=true", "model.n_layers=1", "model.d_model=64",
                             "model.n_heads=4", "model.vocab_size=128"])
    model = GPT(cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: {names[id(p)] for p in g["params"]} for g in param_groups(model, cfg.optimizer)}
    assert "input.embedding.weight" in groups["no_decay"] and "head.proj.weight" in groups["decay"]
    assert all(n.endswith(".weight") and "norm" not in n for n in groups["decay"])
    assert {"blocks.0.norm1.weight", "blocks.0.attn.wq.bias", "head.norm.weight"} <= groups["no_decay"]
    cfg.optimizer.embedding_weight_decay = True
    groups = {g["name"]: {names[id(p)] for p in g["params"]} for g in param_groups(model, cfg.optimizer)}
    assert "input.embedding.weight" in groups["decay"]


# ----------------------------------------------------------------------------------- training
@pytest.mark.parametrize("kind", ["learned", "canonical", "gf2"])
def test_each_interface_trains_and_validation_loss_falls(shards, tmp_path, kind):
    result = run(shards, tmp_path, f"model.input={kind}", "train.max_steps=40", "optimizer.lr=1e-2")
    recs = read_metrics(tmp_path)
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert recs[0]["step"] == 0 and vals[0] == pytest.approx(math.log(256), abs=0.3)  # an untrained model
    assert vals[-1] < vals[0] - 1.0, vals  # clearly learned the stride rule
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) == 40 and sum(losses[-5:]) < sum(losses[:5])
    assert result.step == 40 and result.consumed_samples == 320
    assert [r["consumed_samples"] for r in recs if "loss" in r][:3] == [8, 16, 24]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "consumed_samples"):
        assert key in recs[5], key
    assert (tmp_path / "config.yaml").exists()
    assert load_config(str(tmp_path / "config.yaml")).model.input == kind


def test_codes_round_trip_through_checkpoints_and_a_changed_seed_is_refused(shards, tmp_path):
    from megafixed.codes import make_code
    from megafixed.train.evaluate import load_trained_model

    run(shards, tmp_path, "model.input=gf2", "model.code_seed=11", "train.max_steps=10", "validation.interval=0")
    tag = read_latest(tmp_path / "checkpoints")
    state = torch.load(tmp_path / "checkpoints" / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    code = make_code("gf2", 8, 11)
    assert state["input.code_rows"].tolist() == list(code.rows) and int(state["input.code_shift"]) == code.shift
    assert not any(k.startswith("input.") and k.endswith("weight") for k in state)  # no input parameters

    cfg = load_config(None, tiny_overrides(shards, tmp_path, "model.input=gf2", "model.code_seed=11"))
    model, _ = load_trained_model(cfg, tmp_path)
    assert torch.equal(model.head.proj.weight, state["head.proj.weight"])

    # refused by the resume check before anything is loaded or rewritten, naming the keys
    # ([newuser]) the refusal leads with the key the user typed; the derived rows and shift follow
    with pytest.raises(CheckpointError, match=r"model\.code_seed changed from 11 to 12 \(and model\.code_rows, "
                                              r"model\.code_shift\).*config\.yaml"):
        run(shards, tmp_path, "model.input=gf2", "model.code_seed=12", "train.max_steps=20")
    assert load_config(str(tmp_path / "config.yaml")).model.code_seed == 11  # the run's config is kept
    cfg.model.code_seed = 12
    with pytest.raises(CheckpointError, match=r"fixed code mismatch"):
        load_trained_model(cfg, tmp_path)


def test_a_checkpoint_that_does_not_fit_is_refused_in_one_line_naming_the_run_config(tmp_path):
    # torch's load_state_dict error lists every mismatched tensor on its own line; the CLI error
    # used to be dozens of lines long. Now: one line, the first few mismatches, the fix.
    from megafixed.engine.deepspeed.engine import load_files
    from megafixed.train import checkpoint

    tag_dir = tmp_path / "checkpoints" / "step_00000003"
    tag_dir.mkdir(parents=True)
    checkpoint.write_latest(tmp_path / "checkpoints", "step_00000003")
    lines = [f"\tsize mismatch for blocks.{i}.attn.wq.weight: copying a param with shape [32, 32]" for i in range(20)]

    class Engine:
        def load_checkpoint(self, *args, **kwargs):
            raise RuntimeError("Error(s) in loading state_dict for GPT:\n" + "\n".join(lines))

    with pytest.raises(CheckpointError) as err:
        load_files(Engine(), tag_dir, tag_dir.parent, tag_dir.name)
    msg = str(err.value)
    assert "\n" not in msg and "(+18 more)" in msg and "blocks.1.attn" in msg and "blocks.2.attn" not in msg
    assert f"model.* back to the run's own {tmp_path / 'config.yaml'}" in msg

    class Truncated:  # a missing/cut-short file is corruption, not "the checkpoint does not fit this model"
        def load_checkpoint(self, *args, **kwargs):
            raise FileNotFoundError(2, "No such file or directory", "zero_pp_rank_0_mp_rank_00_optim_states.pt")

    with pytest.raises(CheckpointError, match=r"step_00000003: it is incomplete or corrupt .*optim_states\.pt.*"
                                              r"point .*latest at an earlier tag"):
        load_files(Truncated(), tag_dir, tag_dir.parent, tag_dir.name)


def test_latest_pointer_and_pruning(shards, tmp_path):
    run(shards, tmp_path, "train.max_steps=5", "checkpoint.interval=1", "checkpoint.keep=2",
        "validation.interval=0", "metrics.tensorboard=true")
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    ckpt = tmp_path / "checkpoints"
    assert read_latest(ckpt) == "step_00000005"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000004", "step_00000005"]
    # Running the finished run again is a no-op resume, not a new run.
    result = run(shards, tmp_path, "train.max_steps=5", "checkpoint.interval=1", "validation.interval=0")
    assert result.resumed_from == "step_00000005" and result.step == 5 and result.history == []


def _poison_lr(*extra):
    # with run(..., poison_lr=True): lr=1e30 turns the first update into inf/NaN weights, so the
    # second step's loss is non-finite.
    return ("optimizer.grad_clip=0.0", "schedule.kind=constant", "schedule.warmup_steps=0",
            "validation.interval=0", "zero.stage=0", *extra)


def test_nonfinite_loss_stops_with_a_clear_message(shards, tmp_path):
    from megafixed.engine import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match=r"step 2: the training loss is nan.*on_nonfinite=skip"):
        run(shards, tmp_path, *_poison_lr("train.max_steps=4"), poison_lr=True)


def _engine(cfg, module):
    import deepspeed

    from megafixed.engine.deepspeed.config import deepspeed_config
    from megafixed.engine.deepspeed.muon import skip_muon_import
    from megafixed.engine.deepspeed.ops import prepare_ops
    from megafixed.parallel import setup_distributed
    from megafixed.parallel.layout import batch_layout
    from megafixed.run.optim import build_optimizer
    from megafixed.run_plan import RunPlan

    topo = setup_distributed(RunPlan.for_launch(cfg))
    layout = batch_layout(cfg.train, topo.dp)
    opt = build_optimizer(module, cfg.optimizer)
    skip_muon_import()
    with prepare_ops(accelerator_is_cpu=topo.device.type == "cpu"):  # as engine/deepspeed/build.py: no shm op build
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=deepspeed_config(cfg, layout, "fp32"))
    return engine, opt, layout


@pytest.mark.parametrize("stage", [0, 1])
def test_nonfinite_skip_drops_the_update(shards, tmp_path, stage):
    from megafixed.data.gpt_dataset import build_datasets, micro_batches
    from megafixed.engine.deepspeed.step import train_step
    from megafixed.model import GPT

    cfg = load_config(None, tiny_overrides(shards, tmp_path, f"zero.stage={stage}"))
    model = GPT(cfg.model)
    with torch.no_grad():
        model.head.proj.weight[3, 5] = float("nan")  # every loss is NaN, every gradient too
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, opt, layout = _engine(cfg, model)
    batches = micro_batches(build_datasets(cfg.data, seed=1)["train"], 0, layout.micro_batch, 0, 1)
    result = train_step(engine, opt, batches, layout.accum, dp=1, on_nonfinite="skip")
    assert result.skipped and math.isnan(result.loss)
    for n, p in engine.module.named_parameters():
        assert torch.equal(p.detach().nan_to_num(7.0), before[n].nan_to_num(7.0)), n  # untouched
    assert all(float(v.abs().sum()) == 0 for st in opt.state.values() for k, v in st.items()
               if k in ("exp_avg", "exp_avg_sq"))  # no moments either


def test_nonfinite_skip_keeps_the_run_going(shards, tmp_path):
    # Step 1 is finite and blows the weights up (lr=1e30); steps 2-4 are non-finite and skipped.
    result = run(shards, tmp_path, *_poison_lr("train.max_steps=4", "guard.on_nonfinite=skip"), poison_lr=True)
    assert result.step == 4 and [bool(r.get("skipped")) for r in result.history] == [False, True, True, True]


# ----------------------------------------------------------------------------------- pipeline branch
def test_pipeline_engine_branch_matches_plain_engine(shards, tmp_path):
    """A 1-stage deepspeed PipelineModule through train_step/eval_loss == the plain GPT engine."""
    from deepspeed.pipe import PipelineModule
    from torch import nn

    from megafixed.data.gpt_dataset import build_datasets, micro_batches
    from megafixed.engine.deepspeed.step import eval_loss, train_step
    from megafixed.model import GPT
    from megafixed.parallel import setup_distributed
    from megafixed.parallel.layout import batch_layout
    from megafixed.run_plan import RunPlan

    cfg = load_config(None, tiny_overrides(shards, tmp_path, "model.input=canonical"))
    topo = setup_distributed(RunPlan.for_launch(cfg))
    layout = batch_layout(cfg.train, topo.dp)
    data = build_datasets(cfg.data, seed=cfg.train.seed)

    class Inputs(nn.Module):
        def __init__(self, gpt):
            super().__init__()
            self.input = gpt.input

        def forward(self, ids):
            return self.input(ids)

    class BlockLayer(nn.Module):
        def __init__(self, gpt, i):
            super().__init__()
            self.block, self.rotary = gpt.blocks[i], gpt.rotary

        def forward(self, x):
            return self.block(x, *self.rotary(x.shape[1], x.device))

    def engine_for(pipeline: bool):
        torch.manual_seed(0)
        gpt = GPT(cfg.model)
        module = gpt
        if pipeline:
            module = PipelineModule([Inputs(gpt)] + [BlockLayer(gpt, i) for i in range(len(gpt.blocks))]
                                    + [gpt.head], num_stages=1, loss_fn=gpt.loss_fn, partition_method="uniform")
        engine, opt, _ = _engine(cfg, module)
        for g in opt.param_groups:
            g["lr"] = 1e-3
        return engine, opt

    losses = {}
    for pipeline in (False, True):
        engine, opt = engine_for(pipeline)
        batches = micro_batches(data["train"], 0, layout.micro_batch, 0, 1)
        steps = [train_step(engine, opt, batches, layout.accum, dp=1).loss for _ in range(3)]
        val = eval_loss(engine, micro_batches(data["valid"], 0, layout.micro_batch, 0, 1), 2, dp=1)
        losses[pipeline] = steps + [val]
        assert pipeline == (type(engine).__name__ == "PipelineEngine")
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[False][2] < losses[False][0]


def test_half_precision_keeps_the_code_buffers_exact():
    from megafixed.engine.dtypes import restore_exact_buffers
    from megafixed.model import GPT

    model = GPT(load_config(None, ["model.input=gf2", "model.code_scale=0.3", "model.n_layers=1",
                                   "model.d_model=64", "model.n_heads=4", "model.vocab_size=256",
                                   "model.code_bits=8", "model.max_seq_len=64", "data.seq_len=64"]).model)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    model.bfloat16()  # what DeepSpeed's bf16 mode does to the module
    assert model.input.code_scale.dtype == torch.bfloat16  # 0.3 is not exact in bf16
    restore_exact_buffers(model)
    assert model.input.code_scale.dtype == torch.float64 and float(model.input.code_scale) == 0.3
    assert model.blocks[0].attn.wq.weight.dtype == torch.bfloat16  # parameters keep the engine's dtype
    fresh = GPT(model.cfg)
    fresh.load_state_dict({k: v.float() if k != "input.code_scale" else v for k, v in model.state_dict().items()})
    assert float(fresh.input.code_scale) == 0.3 and torch.equal(fresh.input.code_rows, ref["input.code_rows"])
