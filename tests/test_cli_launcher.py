"""The deepspeed launcher puts ``--local_rank=N`` before the verb; the CLI must accept it."""
import os

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
