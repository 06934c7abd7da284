"""Config loading and its errors: every bad input names the key and the fix."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megafixed.config import Config, ConfigError, load_config, save_config
from megafixed.train.ds_config import batch_layout

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


def test_required_keys_exist_with_defaults():
    cfg = Config()
    assert cfg.model.input in ("learned", "canonical", "gf2")
    for section, key in [("model", "code_seed"), ("train", "max_steps"), ("train", "save_interval"),
                         ("train", "log_interval"), ("train", "eval_interval"), ("train", "run_dir"),
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
    ("train.log_interval=0", r"train\.log_interval=0 must be >= 1"),  # was a ZeroDivisionError mid-run
    ("train.micro_batch=0", r"train\.micro_batch=0 must be >= 1"),
    ("train.max_steps=-1", r"train\.max_steps=-1 must be >= 0"),
    ("parallel.tp=0", r"parallel\.tp=0 must be >= 1"),
])
def test_bad_values_are_named(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_zero_eval_interval_still_means_no_evaluation():
    assert load_config(None, ["train.eval_interval=0"]).train.eval_interval == 0


def test_batch_that_does_not_divide_is_refused_with_a_fix():
    cfg = load_config(None, ["train.global_batch=12", "train.micro_batch=8"])
    with pytest.raises(ConfigError, match=r"global_batch=12 is not divisible by .*8 \* 1 = 8.*global_batch=8 or 16"):
        batch_layout(cfg, dp=1)
    cfg = load_config(None, ["train.global_batch=12", "train.micro_batch=4"])
    with pytest.raises(ConfigError, match=r"4 \* 2 = 8"):
        batch_layout(cfg, dp=2)
    lay = batch_layout(cfg, dp=3)  # 12 = 4 * 1 * 3
    assert (lay.micro_batch, lay.accum, lay.dp) == (4, 1, 3)
    assert batch_layout(load_config(None, ["train.global_batch=64", "train.micro_batch=4"]), dp=2).accum == 8


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
    assert again == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["input"] == "gf2"


def test_quickstart_config_is_valid_and_canonical():
    cfg = load_config(str(CONFIGS / "quickstart.yaml"))
    assert cfg.model.input == "canonical" and cfg.data.source and cfg.model.vocab_size <= 2 ** cfg.model.code_bits
