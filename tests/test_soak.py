"""The chaos soak at its small size (``tools/soak.py``; issue 43): one 2-rank torch-engine run (DP2) of 64 steps
hit by a fault every ~8 steps -- a kill -9 of a rank, a NaN (skipped), a spike (rolled back), a one-shot fault
(transient, recomputed), a hang, a SIGSTOPped rank and a damaged checkpoint, each kind once -- relaunched after
every exit, ends with weights bit-identical to a fault-free run given the same skip windows; every fault is
named in the logs and no file any launch left is gone. A short DeepSpeed DP2 soak does the same with a kill,
a NaN and a damaged checkpoint.

The schedule's seed is printed (``MEGAFIXED_SOAK_SEED`` picks another). Nothing races the clock: the SIGSTOP and
the damage happen at pause points (``MEGAFIXED_PAUSE``), the other faults at known steps, and the hang timeout
is only the bound the watchdog names a hang within (if it names the paused rank before a slow supervisor acts, the
supervisor damages the checkpoint or counts the stop all the same, ``tools/soak.py``'s ``_supervise``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _env import launch_free_env

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import soak  # noqa: E402

SEED = int(os.environ.get("MEGAFIXED_SOAK_SEED", "1"))


def _soak(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out, table = tmp_path / "soak", tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "tools" / "soak.py"), "--seed", str(SEED), "--out", str(out), "--json",
           str(table), "--hang-timeout", "10", "--collective-timeout", "30", *args]
    print(f"soak seed {SEED}: {' '.join(cmd[1:])}")
    done = subprocess.run(cmd, cwd=ROOT, env=launch_free_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=900)
    print(done.stdout[-6000:])  # the table, with the seed
    assert table.exists(), f"seed {SEED}: " + done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(table.read_text()), done.stdout + done.stderr


def test_the_schedule_is_seeded_and_has_every_kind_once_first():
    a = soak.schedule(SEED, 300, 30, 8, loss_rank=False)
    assert a == soak.schedule(SEED, 300, 30, 8, loss_rank=False) != soak.schedule(SEED + 1, 300, 30, 8, False)
    assert sorted(f.kind for f in a[:len(soak.KINDS)]) == sorted(soak.KINDS) and len(a) == 9
    assert all(b.step - f.step >= 15 for f, b in zip(a, a[1:]))  # a quarter of the spacing either way
    assert all(f.rank != 0 for f in a if f.kind == "sigstop") and all(f.rank == 0 for f in a if f.kind == "damage")
    assert all(f.rank is None for f in a if f.kind in ("nan", "spike", "once"))  # TP/PP: on every rank
    assert {f.spelled() for f in a if f.kind == "once"} <= {f"{x}@{f.step}:once" for f in a for x in ("nan", "spike")}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_soak_on_dp2_ends_bit_identical_with_every_fault_named_and_nothing_deleted(tmp_path):
    got, text = _soak(tmp_path, "--layout", "dp2", "--steps", "64", "--every", "8", "--save-interval", "3")
    faults = got["faults"]
    assert sorted({f["kind"] for f in faults}) == sorted(soak.KINDS), f"seed {SEED}: {faults}"
    assert got["bit_identical"] and got["tensors"] > 10, f"seed {SEED}: {got['differ']}"
    assert got["unnamed"] == [] and all(f["named"] and f["fired"] for f in faults), f"seed {SEED}: {faults}"
    assert got["lost_files"] == [], f"seed {SEED}"
    stops = sum(f["kind"] in ("exit", "hang", "sigstop", "damage") for f in faults)
    assert [r["exit"] != 0 for r in got["launches"]] == [True] * stops + [False]  # one relaunch per stop
    assert got["skipped_steps"], f"seed {SEED}: the nan and the spike skip data"
    run = tmp_path / "soak" / "run"
    assert list((run / "checkpoints").glob("step_*.damaged-corrupt"))  # the damaged one, kept
    assert list((run / "faults").glob("hang.step*.txt")) and f"seed {SEED}" in text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_short_deepspeed_soak_ends_bit_identical(tmp_path):
    got, _ = _soak(tmp_path, "--layout", "deepspeed-dp2", "--steps", "30", "--every", "8", "--save-interval", "3",
                   "--kinds", "exit,nan,damage")
    assert sorted(f["kind"] for f in got["faults"]) == ["damage", "exit", "nan"], f"seed {SEED}"
    assert got["bit_identical"] and got["unnamed"] == [] and got["lost_files"] == [], f"seed {SEED}: {got}"
