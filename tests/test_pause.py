"""``MEGAFIXED_PAUSE`` (megafixed/pause.py): a process stops at the point it names, says so in a file,
and goes on when the file is removed or a signal it handles arrives; a malformed value is one line."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _pause import ended, pause_env, wait_paused
from megafixed import pause

ROOT = Path(__file__).resolve().parent.parent

# A stand-in for a long job: 5 "batches", the pause point reached after each, a line per batch done.
WORKER = textwrap.dedent("""
    import signal, sys
    from megafixed import pause
    if sys.argv[1] == "usr1":
        signal.signal(signal.SIGUSR1, lambda *_: print("handler ran", flush=True))
    if sys.argv[1] == "term":  # preprocess --submit's: unwind
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = pause.armed("preprocess.batch", group=2)
    try:
        for batch in range(1, 6):
            if p is not None:
                p.reached(batch)
            print(f"batch {batch} done", flush=True)
    finally:
        print("unwound", flush=True)
""")


def _start(tmp_path, how: str, spec: str):
    marker = tmp_path / "paused"
    env = {**os.environ, **pause_env(spec, marker)}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, how], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, marker


@pytest.mark.parametrize("how", ["release", "usr1", "term"])
def test_the_process_stops_at_its_point_until_released_or_signalled(tmp_path, how):
    proc, marker = _start(tmp_path, how, "preprocess.batch@2:group=2")
    wait_paused(marker, ended(proc))
    pid, host, spelled = marker.read_text().split()
    assert (int(pid), host, spelled) == (proc.pid, socket.gethostname(), "preprocess.batch@2:group=2")
    if how == "release":
        marker.unlink()
    else:
        proc.send_signal(signal.SIGUSR1 if how == "usr1" else signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    lines = out.splitlines()
    if how == "term":  # the handler's SystemExit unwound from inside the pause, before batch 2
        assert proc.returncode == 143 and lines == ["batch 1 done", "unwound"], out
    else:  # batch 2 only after the release (the handler ran while paused), then on to the end: paused once
        assert proc.returncode == 0, err
        assert lines == ["batch 1 done", *(["handler ran"] if how == "usr1" else []),
                         *(f"batch {b} done" for b in range(2, 6)), "unwound"], out
    assert not marker.exists()  # removed as the pause ended
    assert err.count("paused at preprocess.batch@2:group=2 (MEGAFIXED_PAUSE; pid") == 1, err


def test_another_group_or_point_does_not_pause_and_unset_costs_nothing(tmp_path):
    proc, marker = _start(tmp_path, "release", "preprocess.batch@2:group=1")  # the worker is group 2
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.count("done") == 5 and not marker.exists()
    assert pause.armed("train.step", env={}, rank=0) is None
    assert pause.armed("train.step", env={"MEGAFIXED_PAUSE": "bench.row@3"}, rank=0) is None
    assert pause.armed("train.step", env={"MEGAFIXED_PAUSE": "train.step@3:rank=1"}, rank=0) is None
    assert pause.armed("train.step", env={"MEGAFIXED_PAUSE": "train.step@3:host=elsewhere"}, rank=0) is None
    p = pause.armed("train.step", env={"MEGAFIXED_PAUSE": f"train.step@3:host={socket.gethostname()}:file=/a:b"},
                    rank=0)
    assert (p.point, p.at, p.file) == ("train.step", 3, "/a:b")
    p = pause.armed("train.step", env={"MEGAFIXED_PAUSE": "train.step@4:file=/x/paused.{rank}"}, rank=1)
    assert p.file == "/x/paused.1"  # one file per rank where several pause at once
    with pytest.raises(pause.PauseError, match=r"file= names \{group\}, which this process does not know"):
        pause.armed("train.step", env={"MEGAFIXED_PAUSE": "train.step@5:file=/x/paused.{group}"}, rank=1)


@pytest.mark.parametrize("raw, why", [
    ("train.stop@3", "names no pause point ('train.stop')"),
    ("train.step", "needs @N with N >= 1 after train.step"),
    ("train.step@0", "needs @N with N >= 1"),
    ("train.step@3:group=1", "has an option 'group=1' that train.step does not take"),
    ("train.step@3:rank=one", "has rank='one', not a number"),
    ("bench.row@3:file=", "has an empty file="),
])
def test_a_malformed_value_is_one_line_naming_the_grammar(raw, why):
    with pytest.raises(pause.PauseError) as info:
        pause.armed("train.step", env={"MEGAFIXED_PAUSE": raw}, rank=0)
    text = str(info.value)
    assert why in text and "expected POINT@N" in text and "\n" not in text


def test_the_checkpoint_file_point_names_the_step_of_the_save():
    p = pause.armed("checkpoint.file", env={"MEGAFIXED_PAUSE": "checkpoint.file@4"})
    assert (p.point, p.at, p.file) == ("checkpoint.file", 4, None)
    assert pause.armed("checkpoint.file", env={"MEGAFIXED_PAUSE": "train.step@4"}) is None
    with pytest.raises(pause.PauseError, match="does not take"):
        pause.armed("checkpoint.file", env={"MEGAFIXED_PAUSE": "checkpoint.file@4:rank=0"})
