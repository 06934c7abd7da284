"""Ctrl-C during `megafixed train`: the first SIGINT saves at the step and exits 130 with the resume
hint (as USR1 does with 75); a second one aborts at once."""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from _env import signal_after_logged_steps
from _train_data import tiny_overrides, write_shards
from megafixed import exit_codes
from megafixed.train import stop as stop_module
from megafixed.train.stop import StopRequest

ROOT = Path(__file__).resolve().parent.parent


def test_ctrl_c_through_the_cli_saves_at_the_step_and_exits_130_with_the_resume_hint(tmp_path):
    shards = write_shards(tmp_path / "shards")
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    cmd = [sys.executable, "-m", "megafixed.cli", "train", str(cfg),
           *tiny_overrides(shards, tmp_path / "run", "train.max_steps=400", "validation.interval=0",
                           "checkpoint.interval=1000", "train.threads=1")]
    proc = signal_after_logged_steps(cmd, ROOT, tmp_path / "run" / "metrics.jsonl", signal.SIGINT)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == exit_codes.INTERRUPTED == 130, err[-3000:]
    tag = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    step = int(tag.split("_")[1])
    assert 3 <= step < 400 and f"stopped: {step} steps" in out
    assert "interrupted (Ctrl-C)" in out and "Run the same command again to resume" in out
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "finishing this step and saving" in err
    # The thread policy spoke once, with the config's choice.
    assert out.count("cpu threads:") == 1 and "cpu threads: 1 intra-op (asked for" in out


def test_a_second_ctrl_c_aborts_at_once(monkeypatch, capsys):
    exits = []
    monkeypatch.setattr(stop_module.os, "_exit", exits.append)
    stop = StopRequest()
    stop._on_sigint(signal.SIGINT, None)
    assert stop.requested and stop.interrupted and stop.reason == "interrupted (Ctrl-C)" and exits == []
    stop._on_sigint(signal.SIGINT, None)
    assert exits == [130]
    assert "aborting now" in capsys.readouterr().err


def test_usr1_after_ctrl_c_keeps_the_interrupt_and_usr1_alone_is_not_one():
    stop = StopRequest()
    stop.request("received SIGUSR1")
    assert stop.requested and not stop.interrupted  # exit 75: a scheduler may requeue
    stop.request("interrupted (Ctrl-C)", interrupt=True)
    assert not stop.interrupted and stop.reason == "received SIGUSR1"  # the first reason decides


def test_the_handler_is_installed_only_when_asked():
    sig = signal.SIGINT
    before = signal.getsignal(sig)
    try:
        StopRequest().install_signal_handlers((signal.SIGUSR1,))
        assert signal.getsignal(sig) is before
        s = StopRequest()
        s.install_signal_handlers((signal.SIGUSR1,), interrupt=True)
        assert signal.getsignal(sig) == s._on_sigint
    finally:
        signal.signal(sig, before)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_a_forked_worker_keeps_the_default_signal_action():
    # Pool.terminate() SIGTERMs its workers; a worker that inherited the stop handler must still die.
    import multiprocessing as mp
    import os

    stop = StopRequest()
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        stop.install_signal_handlers((signal.SIGUSR1, signal.SIGTERM), interrupt=True)
        ctx = mp.get_context("fork")
        running = ctx.Event()

        def worker():
            running.set()
            time.sleep(60)

        proc = ctx.Process(target=worker)
        proc.start()
        assert running.wait(60)  # the child runs (its handlers inherited), not still being forked
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(timeout=30)
        assert proc.exitcode == -signal.SIGTERM and not stop.requested
    finally:
        for s, h in before.items():
            signal.signal(s, h)
