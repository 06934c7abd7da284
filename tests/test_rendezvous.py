"""The rendezvous on one machine (no Slurm): one bounded wait, signals end it at once, peers named.

The bug these pin: a rank whose master never came ignored SIGTERM, waited two TCPStore tries of
120 s (241 s, against the documented MEGAFIXED_RDZV_TIMEOUT of 120) and died with c10d's line only.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _env import launch_free_env
from _train_data import TINY_MODEL

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path, rank: int, port: int, timeout: str, name: str, run: str = "") -> subprocess.Popen:
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    env = launch_free_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="localhost",
                          MASTER_PORT=str(port), MEGAFIXED_RDZV_TIMEOUT=timeout, OMP_NUM_THREADS="1")
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    err = open(tmp_path / f"{name}.err", "w")
    return subprocess.Popen([sys.executable, "-m", "megafixed.cli", "train", str(cfg), "data.mock=true", *TINY_MODEL,
                             "train.global_batch=8", "train.micro_batch=4", "train.max_steps=2",
                             "validation.interval=0", f"train.run_dir={tmp_path / (run or name)}"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)


def _wait_for_line(path: Path, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout  # a bound for a hang: the line stays once written
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path}: {path.read_text()[-2000:]}")


@pytest.mark.multiprocess
def test_a_lone_rank_gives_up_once_with_our_line_and_signals_end_the_wait_at_once(tmp_path):
    # four processes at once (start-up dominates): rank 1 alone, rank 0 alone, two that get a signal
    port = _free_port()  # nothing listens there
    procs = {"alone": _start(tmp_path, 1, port, "4", "alone"),
             "master": _start(tmp_path, 0, _free_port(), "3", "master"),
             "SIGTERM": _start(tmp_path, 1, _free_port(), "600", "SIGTERM"),
             "SIGINT": _start(tmp_path, 1, _free_port(), "600", "SIGINT")}
    for name in procs:
        _wait_for_line(tmp_path / f"{name}.err", "rendezvous at localhost:")
    waiting_since = time.monotonic()
    for name in ("SIGTERM", "SIGINT"):
        procs[name].send_signal(getattr(signal, name))
    for name in ("SIGTERM", "SIGINT"):
        sig = getattr(signal, name)
        assert procs[name].wait(timeout=60) == 128 + sig
        err = (tmp_path / f"{name}.err").read_text()
        assert f"megafixed: {name} during the rendezvous (rank 1 of 2): exiting now" in err
        assert "Traceback" not in err
    # at once, not after their 600 s wait (the bound is generous: a loaded machine takes seconds to exit)
    assert time.monotonic() - waiting_since < 120

    # rank 1 with no master: one bounded wait (4 s + a probe), not torch's; an error line of its own
    assert procs["alone"].wait(timeout=120) == 2
    assert time.monotonic() - waiting_since < 60  # its 4 s, not c10d's minutes (generous: a loaded machine)
    err = (tmp_path / "alone.err").read_text()
    assert (f"error: rendezvous failed: rank 1 of 2 (launcher) could not reach the master (rank 0) at "
            f"MASTER_ADDR=localhost:{port} within 4s (Connection refused)") in err
    assert err.count("error:") == 1 and "TCPStore" not in err
    assert not (tmp_path / "alone").exists()

    # rank 0 with no rank 1: names the rank that never came
    assert procs["master"].wait(timeout=120) == 2
    err = (tmp_path / "master.err").read_text()
    assert "error: rendezvous timed out after 3s at MASTER_ADDR=localhost:" in err
    assert "1 of 2 ranks never arrived: rank 1; arrived: ranks 0 on " + socket.gethostname() in err
    assert err.count("error:") == 1


@pytest.mark.multiprocess
def test_two_ranks_meet_and_train(tmp_path):
    port = _free_port()
    # rank 1 first: it waits for the master
    ranks = [_start(tmp_path, r, port, "60", f"r{r}", run="run") for r in (1, 0)]
    codes = [p.wait(timeout=300) for p in ranks]
    assert codes == [0, 0], [(tmp_path / f"r{r}.err").read_text()[-2000:] for r in (1, 0)]
    assert os.path.exists(tmp_path / "run" / "metrics.jsonl")


class _BeatingStore:
    """A rendezvous store whose heartbeats advance for ``alive`` ranks only (no network)."""

    def __init__(self, alive):
        self.alive, self.reads, self.keys = alive, 0, {}

    def set_timeout(self, _t):
        pass

    def multi_get(self, keys):
        self.reads += 1
        return [str(self.reads if int(k.rsplit("/", 1)[1]) in self.alive else 0).encode() for k in keys]

    def set(self, key, value):
        self.keys[key] = value

    def check(self, keys):
        return all(k in self.keys for k in keys)


def test_the_ranks_whose_heartbeat_stands_still_are_named_with_their_node(monkeypatch, tmp_path):
    import torch.distributed as dist

    from megafixed.launch import lost, rendezvous

    peers = [{"rank": r, "host": f"node{r // 2 + 1}", "addr": f"10.0.0.{r // 2 + 1}"} for r in range(4)]
    monkeypatch.setattr(rendezvous, "_STORE", _BeatingStore(alive={0, 1}))
    monkeypatch.setattr(rendezvous, "_PEERS", peers)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(lost, "ROLL_CALL_S", 1.0)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000004\n")
    err = lost.lost_peer_error(RuntimeError("[gloo/pair.cc:553] Connection closed by peer [10.0.0.2]:4242"),
                               str(tmp_path), 20)
    assert str(err).startswith("lost ranks 2-3 on node2 (10.0.0.2): 2 of 4 ranks answered after the failure")
    assert f"The last checkpoint, {tmp_path / 'checkpoints' / 'step_00000004'}, is intact" in str(err)
    assert not err.every_rank  # rank 0 is alive and reports; rank 1 stays silent
    # not a lost peer: everyone beats, the original error stands
    monkeypatch.setattr(rendezvous, "_STORE", _BeatingStore(alive={0, 1, 2, 3}))
    assert lost.lost_peer_error(RuntimeError("gloo: Connection closed by peer"), str(tmp_path), 20) is None
    assert lost.lost_peer_error(ValueError("bad shape"), str(tmp_path), 20) is None


_MEET_WITH_OTHER_CODE = """
import sys
import megafixed.launch.rendezvous as r
from megafixed.errors import report
from megafixed.launch.world import World
rank, port = int(sys.argv[1]), int(sys.argv[2])
if rank == 1:  # this rank's node runs other code; it is still waiting for rank 0's verdict line when TERM comes
    import signal
    mine = r.record
    r.record = lambda world, addr: {**mine(world, addr), "code": "0123456789ab"}
    nap = r.time.sleep
    # the verdict's wait for rank 0 (3 s) lasts until the TERM: it cannot end before it, however slow the test
    r.time.sleep = lambda seconds: signal.pause() if seconds >= 3.0 else nap(seconds)
try:
    r.meet(World(size=2, rank=rank, local_rank=0, source="launcher"), "127.0.0.1", port, wait=60)
except Exception as exc:
    sys.exit(report(exc))
"""


@pytest.mark.multiprocess
def test_a_term_while_the_different_code_verdict_waits_for_rank0_keeps_the_verdicts_code(tmp_path):
    port = _free_port()
    # srun reports the highest task code: a rank ended by srun after rank 0's verdict (exit 2) must
    # exit 2 too, not the 143 of "TERM during the rendezvous" (a job exit 143:0, with rank 1
    # still polling the rendezvous when rank 0 refused). Rank 1 here waits for the TERM in its verdict's wait.
    procs = [subprocess.Popen([sys.executable, "-c", _MEET_WITH_OTHER_CODE, str(r), str(port)], cwd=ROOT,
                              env=launch_free_env(RANK=str(r), OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    assert procs[0].wait(timeout=120) == 2
    procs[1].send_signal(signal.SIGTERM)  # as srun --kill-on-bad-exit does once rank 0 has exited
    assert procs[1].wait(timeout=30) == 2
    err0, err1 = procs[0].stderr.read(), procs[1].stderr.read()
    assert "error: the ranks run different code" in err0 and "0123456789ab" in err0
    assert "during the rendezvous" not in err1 and "error:" not in err1  # only rank 0 prints the verdict
