"""check_engines(): an untested DeepSpeed / megatron-core fails at start-up with one actionable line."""
from __future__ import annotations

import pytest

from megafixed import versions


@pytest.fixture
def installed(monkeypatch):
    have = {"deepspeed": "0.19.8", "megatron-core": "0.16.1"}
    monkeypatch.setattr(versions, "installed_version", lambda dist: have.get(dist))
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    return have


def test_the_installed_engines_are_the_tested_ones():
    assert versions.engine_problems() == [], "setup.py / versions.TESTED and the environment disagree"


@pytest.mark.parametrize("ds", ["0.19.8", "0.19.12", "0.19.8+cpu"])
def test_tested_range_passes(installed, ds):
    installed["deepspeed"] = ds
    versions.check_engines()


@pytest.mark.parametrize("ds", ["0.19.7", "0.20.0", "0.20.0rc1", "1.0", "0.15.4"])
def test_untested_version_fails_with_one_line_naming_both_and_the_fix(installed, ds):
    installed["deepspeed"] = ds
    with pytest.raises(versions.UntestedEngineError) as err:
        versions.check_engines()
    msg = str(err.value)
    assert "\n" not in msg
    assert f"deepspeed {ds} is installed" in msg and "tested with deepspeed 0.19.8 (<0.20)" in msg
    assert 'pip install "deepspeed>=0.19.8,<0.20"' in msg and "MEGAFIXED_ALLOW_UNTESTED=1" in msg
    assert "megatron-core" not in msg
    assert isinstance(err.value, ValueError)  # the CLI prints ValueErrors as one line, exit 2


def test_missing_engine_is_named(installed):
    del installed["megatron-core"]
    with pytest.raises(versions.UntestedEngineError, match=r'megatron-core is not installed.*pip install '
                                                           r'"megatron-core>=0.16.1,<0.17"'):
        versions.check_engines()


def test_escape_hatch_downgrades_to_a_warning(installed, monkeypatch):
    installed["megatron-core"] = "0.17.0"
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match=r"megatron-core 0.17.0 is installed.*running anyway"):
        versions.check_engines()
    monkeypatch.setenv(versions.ALLOW_ENV, "0")  # "0" means no
    with pytest.raises(versions.UntestedEngineError):
        versions.check_engines()


def test_setup_py_pins_the_same_ranges():
    from pathlib import Path

    setup = (Path(__file__).resolve().parent.parent / "setup.py").read_text()
    for dist, (low, high) in versions.TESTED.items():
        assert f'"{dist}>={low},<{high}"' in setup
