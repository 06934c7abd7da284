"""The command line as a new user meets it: every ``--help`` works, and a bad command line gets one
line that says what is missing (with the usage) or what was probably meant."""
from __future__ import annotations

import argparse

import pytest

from megafixed.cli import build_parser, main


def _commands(parser, path=()):
    """Every verb and sub-verb, found by walking the parser (a new verb is covered without editing this)."""
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, (*path, name))


COMMANDS = list(_commands(build_parser()[0]))


def test_the_walk_finds_the_verbs_and_their_sub_verbs():
    assert ("train",) in COMMANDS and ("bench", "kernels") in COMMANDS and ("data", "inspect") in COMMANDS
    assert len(COMMANDS) > 25


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "megafixed")
def test_every_help_prints_usage_and_exits_0(command, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*command, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: megafixed" + "".join(" " + c for c in command))


def test_a_missing_config_is_named_with_the_usage_not_the_optional_overrides(capsys):
    assert main(["train"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "the following arguments are required: CONFIG (a YAML run config" in err[0]
    assert "overrides (" not in err[0] and "required: CONFIG, overrides" not in err[0]
    assert "usage: megafixed train" in err[0] and "CONFIG [overrides ...]" in err[0]


@pytest.mark.parametrize("argv, meant", [(["trian"], "train"), (["data", "inspct", "x"], "inspect"),
                                         (["bench", "kernel"], "kernels")])
def test_a_mistyped_verb_gets_did_you_mean(argv, meant, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"did you mean {meant!r}?" in err[0]


def test_a_word_like_no_verb_gets_the_plain_list(capsys):
    assert main(["zzzzzz"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err and "invalid choice: 'zzzzzz'" in err
