"""Config loading and its errors: every bad input names the key and the fix."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from megafixed.codes import FixedCode, make_code
from megafixed.config import Config, ConfigError, load_config, resolve_code, save_config
from megafixed.parallel.layout import batch_layout

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


def test_required_keys_exist_with_defaults():
    cfg = Config()
    assert cfg.model.input in ("learned", "canonical", "gf2")
    for section, key in [("model", "code_seed"), ("train", "max_steps"), ("checkpoint", "interval"),
                         ("metrics", "interval"), ("validation", "interval"), ("train", "run_dir"),
                         ("train", "seed"), ("parallel", "tp"), ("parallel", "pp"), ("zero", "stage")]:
        assert hasattr(getattr(cfg, section), key), f"{section}.{key}"
    assert cfg.zero.stage == 1


def test_overrides_parse_yaml_values_including_exponent_without_dot():
    cfg = load_config(None, ["optimizer.lr=3e-4", "train.max_steps=7", "model.input=gf2", "train.compile=true"])
    assert cfg.optimizer.lr == pytest.approx(3e-4) and isinstance(cfg.optimizer.lr, float)
    assert cfg.train.max_steps == 7 and cfg.model.input == "gf2" and cfg.train.compile is True


def test_unknown_key_is_named_with_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.max_stepz'.*max_steps"):
        load_config(None, ["train.max_stepz=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'"):
        load_config(None, ["modle.d_model=3"])


@pytest.mark.parametrize("override, pattern", [
    ("model.input=embedding", r"model\.input='embedding' is not one of"),
    ("train.max_steps=ten", r"train\.max_steps='ten' must be an integer"),
    ("optimizer.lr=fast", r"optimizer\.lr='fast' must be a number"),
    ("train.compile=3", r"train\.compile=3 must be true or false"),
    ("zero.stage=4", r"zero\.stage must be 0, 1, 2 or 3"),
    ("model.n_heads=5", r"not divisible by model\.n_heads=5"),
    ("model.n_heads=0", r"model\.n_heads=0 must be >= 1"),  # was a ZeroDivisionError traceback
    ("model.n_layers=0", r"model\.n_layers=0 must be >= 1"),
    ("metrics.interval=0", r"metrics\.interval=0 must be >= 1"),  # was a ZeroDivisionError mid-run
    ("train.micro_batch=0", r"train\.micro_batch=0 must be >= 1"),
    ("train.max_steps=-1", r"train\.max_steps=-1 must be >= 0"),
    ("parallel.tp=0", r"parallel\.tp=0 must be >= 1"),
])
def test_bad_values_are_named(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_zero_eval_interval_still_means_no_evaluation():
    assert load_config(None, ["validation.interval=0"]).validation.interval == 0


def test_batch_that_does_not_divide_is_refused_with_a_fix():
    cfg = load_config(None, ["train.global_batch=12", "train.micro_batch=8"])
    with pytest.raises(ConfigError, match=r"global_batch=12 is not divisible by .*8 \* 1 = 8.*global_batch=8 or 16"):
        batch_layout(cfg.train, dp=1)
    cfg = load_config(None, ["train.global_batch=12", "train.micro_batch=4"])
    with pytest.raises(ConfigError, match=r"4 \* 2 = 8"):
        batch_layout(cfg.train, dp=2)
    lay = batch_layout(cfg.train, dp=3)  # 12 = 4 * 1 * 3
    assert (lay.micro_batch, lay.accum, lay.dp) == (4, 1, 3)
    assert batch_layout(load_config(None, ["train.global_batch=64", "train.micro_batch=4"]).train, dp=2).accum == 8


def test_tied_embeddings_need_a_learned_input():
    with pytest.raises(ConfigError, match=r"tie_embeddings=true needs model\.input=learned"):
        load_config(None, ["model.tie_embeddings=true", "model.input=canonical"])
    load_config(None, ["model.tie_embeddings=true", "model.input=learned"])  # fine


@pytest.mark.parametrize("kind", ["canonical", "gf2"])
def test_vocab_larger_than_code_is_refused(kind):
    with pytest.raises(ConfigError, match=r"vocab_size 5000 needs 13 code bits but the code has 12"):
        load_config(None, [f"model.input={kind}", "model.vocab_size=5000", "model.code_bits=12"])
    load_config(None, ["model.input=learned", "model.vocab_size=5000", "model.code_bits=12"])  # no code


def test_paper_configs_compose_through_include(tmp_path):
    cfg = load_config(str(CONFIGS / "paper-1.7b-gf2.yaml"))
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads, cfg.model.vocab_size) == (32, 2048, 16, 49152)
    assert cfg.model.input == "gf2" and not cfg.model.tie_embeddings and cfg.model.mlp == "gelu"
    assert cfg.data.seq_len == 2048 and cfg.train.run_dir == "runs/paper-1.7b-gf2"
    # the resolved config round-trips through config.yaml
    save_config(cfg, str(tmp_path / "config.yaml"))
    again = load_config(str(tmp_path / "config.yaml"))
    assert again == resolve_code(cfg) and again.model.code_seed == cfg.model.code_seed
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["input"] == "gf2"


@pytest.mark.parametrize("kind", ["learned", "canonical", "gf2"])
def test_paper_configs_train_on_the_papers_100b_tokens(kind):
    cfg = load_config(str(CONFIGS / f"paper-1.7b-{kind}.yaml"))
    per_step = cfg.train.global_batch * cfg.data.seq_len
    assert per_step == 1_048_576 and cfg.train.max_steps == 95_368
    assert cfg.train.max_steps * per_step == 100_000_595_968  # the smallest step count reaching 100B
    assert (cfg.train.max_steps - 1) * per_step < 100e9
    # Cosine over the whole run after a short warmup.
    assert cfg.schedule.kind == "cosine" and cfg.schedule.decay_steps is None
    assert 0 < cfg.schedule.warmup_steps <= 0.03 * cfg.train.max_steps


def test_quickstart_config_is_valid_and_canonical():
    cfg = load_config(str(CONFIGS / "quickstart.yaml"))
    assert cfg.model.input == "canonical" and cfg.data.source and cfg.model.vocab_size <= 2 ** cfg.model.code_bits


# ---------------------------------------------------------------------------- explicit gf2 recodings
# What FixedCode.gf2(16, seed=0) draws (pinned independently in tests/test_codes.py).
SEED0_ROWS = [4693, 32646, 20324, 34220, 40663, 61709, 12138, 25420,
              29289, 20347, 13056, 54544, 25366, 14450, 17743, 549]
SEED0_SHIFT = 47792
TINY16 = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=1", "model.n_heads=4",
          "model.code_bits=16", "model.max_seq_len=16", "data.seq_len=16"]


def _code(m):
    return make_code(m.input, m.code_bits, m.code_seed, m.code_affine, m.code_scale,
                     rows=m.code_rows, shift=m.code_shift)


@pytest.mark.parametrize("extra", [[], ["model.code_affine=false"],
                                   ["model.code_bits=12", "model.vocab_size=4096", "model.code_scale=0.5"]])
def test_saved_config_records_the_gf2_code_and_reloads_it(tmp_path, extra):
    cfg = load_config(None, ["model.input=gf2", "model.code_seed=1", *extra])
    drawn = FixedCode.gf2(cfg.model.code_bits, seed=1, affine=cfg.model.code_affine, scale=cfg.model.code_scale)
    save_config(cfg, str(tmp_path / "config.yaml"))
    assert cfg.model.code_rows is None and cfg.model.code_shift is None  # the caller's config is untouched
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]
    assert written["code_rows"] == list(drawn.rows) and written["code_shift"] == drawn.shift
    assert written["code_seed"] == 1  # kept as a record of where the code came from
    again = load_config(str(tmp_path / "config.yaml"))
    code = _code(again.model)
    assert (code.rows, code.shift, code.scale) == (drawn.rows, drawn.shift, drawn.scale)
    # The written rows, not the seed, define the code from now on.
    moved = load_config(str(tmp_path / "config.yaml"), ["model.code_seed=5"])
    assert _code(moved.model).rows == drawn.rows


@pytest.mark.parametrize("kind", ["canonical", "learned"])
def test_resolve_code_leaves_other_inputs_alone(kind):
    cfg = load_config(None, [f"model.input={kind}"])
    out = resolve_code(cfg)
    assert out == cfg and out is not cfg and out.model is not cfg.model
    assert out.model.code_rows is None and out.model.code_shift is None


def test_explicit_rows_build_the_same_model_buffers_as_the_seed():
    from megafixed.model import GPT
    rows = "[" + ",".join(map(str, SEED0_ROWS)) + "]"
    seeded = GPT(load_config(None, TINY16 + ["model.input=gf2", "model.code_seed=0"]).model)
    explicit_cfg = load_config(None, TINY16 + ["model.input=gf2", "model.code_seed=99", f"model.code_rows={rows}",
                                               f"model.code_shift={SEED0_SHIFT}"])
    explicit = GPT(explicit_cfg.model)
    for name in ("code_rows", "code_shift", "code_scale"):
        assert torch.equal(getattr(seeded.input, name), getattr(explicit.input, name)), name
    assert explicit.input.code_rows.tolist() == SEED0_ROWS and int(explicit.input.code_shift) == SEED0_SHIFT
    ids = torch.arange(256)[None]
    assert torch.equal(seeded.input(ids), explicit.input(ids))
    explicit.load_state_dict(seeded.state_dict())  # same code: no mismatch error
    # Rows alone mean b = 0.
    linear = GPT(load_config(None, TINY16 + ["model.input=gf2", f"model.code_rows={rows}"]).model)
    assert int(linear.input.code_shift) == 0 and linear.input.code_rows.tolist() == SEED0_ROWS


_ROWS = "[" + ",".join(map(str, SEED0_ROWS)) + "]"


@pytest.mark.parametrize("overrides, pattern", [
    (["model.input=gf2", "model.code_rows=[" + ",".join(map(str, SEED0_ROWS[:15] + SEED0_ROWS[:1])) + "]"],
     r"model\.code_rows is not invertible over GF\(2\) \(rank 15 < 16\)"),
    (["model.input=gf2", "model.code_rows=[1,2,4]"], r"model\.code_rows has 3 rows but model\.code_bits=16"),
    (["model.input=gf2", "model.code_rows=[" + ",".join(["65536"] + [str(1 << i) for i in range(1, 16)]) + "]"],
     r"model\.code_rows entries must be in \[0, 2\*\*16\).*\[65536\]"),
    (["model.input=gf2", "model.code_rows=[" + ",".join(["-1"] + [str(1 << i) for i in range(1, 16)]) + "]"],
     r"model\.code_rows entries must be in \[0, 2\*\*16\)"),
    (["model.input=gf2", "model.code_rows=[" + ",".join(["1.0"] + [str(1 << i) for i in range(1, 16)]) + "]"],
     r"model\.code_rows=.* must be a list of integers"),
    (["model.input=gf2", "model.code_rows=identity"], r"model\.code_rows=\['identity'\] must be a list of integers"),
    (["model.input=gf2", f"model.code_rows={_ROWS}", "model.code_shift=65536"],
     r"model\.code_shift=65536 must be an integer in \[0, 2\*\*16\)"),
    (["model.input=gf2", f"model.code_rows={_ROWS}", "model.code_shift=-1"], r"model\.code_shift=-1 must be"),
    (["model.input=gf2", f"model.code_rows={_ROWS}", "model.code_shift=5", "model.code_affine=false"],
     r"model\.code_shift=5 with model\.code_affine=false"),
    (["model.input=gf2", "model.code_shift=5"], r"model\.code_shift is set without model\.code_rows"),
    (["model.input=canonical", f"model.code_rows={_ROWS}"],
     r"model\.code_rows/model\.code_shift .*model\.input=canonical"),
    (["model.input=learned", "model.code_shift=0"], r"model\.code_rows/model\.code_shift .*model\.input=learned"),
], ids=["singular", "row_count", "too_big", "negative", "float", "string", "shift_big", "shift_neg",
        "shift_not_affine", "shift_alone", "canonical", "learned"])
def test_bad_explicit_code_is_named(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)


@pytest.mark.parametrize("split", ["98,1", "a,b,c", "-1,1,1", "0,0,0"])
def test_the_config_and_the_dataset_builder_refuse_a_bad_split_alike(split):
    from megafixed.data.errors import DataError
    from megafixed.data.gpt_dataset import split_shares

    with pytest.raises(ConfigError) as by_config:
        load_config(None, [f"data.split='{split}'"])
    with pytest.raises(DataError) as by_builder:
        split_shares(split)
    assert str(by_config.value) == str(by_builder.value) and f"data.split={split!r}" in str(by_builder.value)


@pytest.mark.parametrize("weights, pattern", [([1.0], r"data\.weights has 1 entries but data\.prefixes has 2"),
                                              ([1.0, -2.0], r"data\.weights\[1\]=-2\.0 must be >= 0"),
                                              ([0.0, 0.0], r"data\.weights=\[0\.0, 0\.0\] sum to 0")])
def test_blend_weights_are_checked_by_one_rule(tmp_path, weights, pattern):
    from types import SimpleNamespace

    from megafixed.data.errors import DataError
    from megafixed.data.gpt_dataset import build_datasets

    with pytest.raises(ConfigError, match=pattern):
        load_config(None, ["data.prefixes=[a,b]", f"data.weights={weights}"])
    cfg = SimpleNamespace(prefixes=[str(tmp_path / "a"), str(tmp_path / "b")], weights=weights, split="98,1,1",
                          seq_len=8, cache_dir=None)
    with pytest.raises(DataError, match=pattern):  # before any shard is looked for
        build_datasets(cfg, seed=0)


def test_fixed_code_is_the_code_the_seven_fields_name():
    from megafixed.config import ModelConfig

    m = ModelConfig(input="gf2", code_bits=9, code_seed=5, code_affine=False, code_scale=0.5)
    assert m.fixed_code() == make_code("gf2", 9, 5, False, 0.5)
    pinned = resolve_code(Config(model=m)).model
    a, b = pinned.fixed_code(), m.fixed_code()
    assert (a.rows, a.shift, a.scale, a.bits) == (b.rows, b.shift, b.scale, b.bits)  # rows/shift: the seed's code
    assert ModelConfig(input="learned").fixed_code() is None
