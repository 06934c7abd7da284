"""The deepspeed launcher puts ``--local_rank=N`` before the verb; the CLI must accept it."""
import os
from pathlib import Path

from megafixed import cli


def test_local_rank_before_the_verb_moves_to_the_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    argv = cli._take_launcher_local_rank(["--local_rank=3", "train", "cfg.yaml", "train.max_steps=2"])
    assert argv == ["train", "cfg.yaml", "train.max_steps=2"]
    assert os.environ["LOCAL_RANK"] == "3"


def test_local_rank_as_two_words_and_other_args_untouched(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    argv = cli._take_launcher_local_rank(["--local-rank", "1", "params", "x.yaml", "--json"])
    assert argv == ["params", "x.yaml", "--json"]
    assert os.environ["LOCAL_RANK"] == "1"


def test_codes_verb_runs_through_main(capsys):
    assert cli.main(["--local_rank=0", "codes", "--bits", "4", "--width", "8", "0", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    # id 5 = 0b0101, LSB first -> + - + -, tiled to width 8
    assert out[1].split() == ["5", "+-+-+-+-"]
    assert out[0].split() == ["0", "--------"]


def test_verb_errors_are_one_line_on_stderr_without_a_traceback(capsys, tmp_path):
    # A ValueError raised inside any verb (here CodeError from `codes`, ShardError from `data`)
    # is reported by cli.main as `error: ...`, exit 2, instead of a traceback.
    assert cli.main(["codes", "--bits", "2", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: token id 5 is outside [0, 3] for a 2-bit code") and "Traceback" not in err
    assert err.count("\n") == 1
    from megafixed.data.indexed import ShardWriter, bin_path
    prefix = str(tmp_path / "s")
    with ShardWriter(prefix, "uint16") as w:
        w.add_document([1, 2, 3, 4])
        w.finalize({})
    with open(bin_path(prefix), "r+b") as fh:
        fh.truncate(4)
    assert cli.main(["data", "inspect", prefix]) == 2
    assert "s.bin is truncated" in capsys.readouterr().err


def test_params_and_plan_report_bad_input_on_stderr(capsys):
    quickstart = str(Path(__file__).resolve().parent.parent / "examples" / "configs" / "quickstart.yaml")
    assert cli.main(["params", quickstart, "model.bogus=1"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown config key 'model.bogus'")
    assert cli.main(["plan", quickstart, "--gpus", "0"]) == 2
    assert "--gpus 0: the number of GPUs to plan for must be >= 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- the error boundary
def test_help_speaks_to_users_and_names_where_to_start(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "megafixed quickstart" in out and "--overwrite" in out
    assert "imported lazily" not in out  # the developer docstring stays out of --help


def test_traceback_on_request_and_for_bugs(monkeypatch, capsys):
    import pytest

    from megafixed import errors

    monkeypatch.setenv("MEGAFIXED_TRACEBACK", "1")
    with pytest.raises(Exception, match="token id 5"):
        cli.main(["codes", "--bits", "2", "5"])
    monkeypatch.delenv("MEGAFIXED_TRACEBACK")
    # a bug of ours (not a bad input) keeps its traceback: describe() has no line for it
    assert errors.describe(KeyError("x")) is None and errors.describe(TypeError("x")) is None
    with pytest.raises(KeyError):
        try:
            raise KeyError("x")
        except KeyError as exc:
            errors.report(exc)


def test_only_rank_zero_prints(monkeypatch, capsys):
    from megafixed import errors
    from megafixed.config import ConfigError

    monkeypatch.setenv("RANK", "1")
    assert errors.report(ConfigError("train.max_steps=-1 ...")) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert errors.report(ConfigError("train.max_steps=-1 ...")) == 2
    assert capsys.readouterr().err == "error: train.max_steps=-1 ...\n"


def test_library_exceptions_become_one_line():
    import gzip

    from megafixed import errors

    cases = {
        "yaml": _yaml_error(),
        "gzip": gzip.BadGzipFile("Not a gzipped file (b'{\"')"),
        "memory": MemoryError(),
        "missing": FileNotFoundError(2, "No such file or directory", "/x/data.bin"),
        "perm": PermissionError(13, "Permission denied", "/x/out"),
        "nccl": RuntimeError("Distributed package doesn't have NCCL built in"),
        "multi": ValueError("first line\nsecond line"),
    }
    for name, exc in cases.items():
        code, line = errors.describe(exc)
        assert "\n" not in line and line, name
        assert code in (1, 2), name
    assert "/x/data.bin: not found" in errors.describe(cases["missing"])[1]
    assert "parallel.backend=gloo" in errors.describe(cases["nccl"])[1]
    assert errors.describe(cases["memory"])[0] == 1


def _yaml_error():
    import yaml

    try:
        yaml.safe_load("a: [1")
    except yaml.YAMLError as exc:
        return exc
