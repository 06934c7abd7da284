"""The chaos soak (issue 43): one run hit by a seeded schedule of faults, relaunched after each exit as
Slurm's requeue would, then checked against a fault-free run bit for bit.

    python tools/soak.py --seed 7 --steps 300 --every 30 --layout torch3d --out /tmp/soak [--json table.json]

The faults, about one every ``--every`` steps (``random.Random(seed)``; every kind once before any repeats):

* ``exit``: ``faults.inject=exit@S:rank=R``, a real kill -9 of the rank;
* ``nan`` / ``spike``: a deterministic loss fault (bad data): ``guard.on_nonfinite=skip`` drops the step,
  ``guard.on_spike=rollback`` reloads the checkpoint before it and skips its data;
* ``once``: ``nan@S:once`` or ``spike@S:once``, a transient fault: the re-check trains on the recomputation;
* ``hang``: ``hang@S:rank=R``: the watchdog names it and the job exits 76;
* ``sigstop``: the supervisor pauses rank R before step S (``MEGAFIXED_PAUSE``, a known point, no race) and
  SIGSTOPs it; the other ranks' watchdog names it (exit 76), then the supervisor SIGKILLs the stopped rank;
* ``damage``: the supervisor pauses rank 0 before step S, flips a byte of the newest checkpoint's model file
  and kills the rank (a node lost with its disk damaged); the relaunch must fall back to the one before.

The supervisor relaunches after every non-zero exit (at most ``2 x faults + 3`` launches). Each launch gets the
faults it can still meet: those after the step it resumes from, less the exits, hangs and one-shot faults that
already fired (a requeue leaves a dead node behind; a flaky device does not repeat), while the deterministic
nan/spike stay (bad data is bad again). Then a fault-free run with ``data.skip_steps`` = the windows the soak
skipped (``faults/bad_steps.jsonl`` skips and ``faults/skipped_steps.json`` rollbacks) must end with the same
weights bit for bit; every fault must be named in the launch logs; no file any launch left may be gone (a
damaged checkpoint is renamed ``<tag>.damaged-<why>``, an attempt set aside under ``attempts/``). Prints a
table of faults, detection times and lost steps; ``--json`` writes it too. Exit 0 when every check holds.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("exit", "nan", "spike", "once", "hang", "sigstop", "damage")
BIG_LOCK = "/tmp/megafixed-big.lock"  # as tests/_launch.py: one launch of 6+ gloo ranks at a time (memory)
TINY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.code_bits=8",
        "model.max_seq_len=32", "data.seq_len=32", "data.mock=true", "train.global_batch=8",
        "metrics.interval=1", "validation.interval=0", "metrics.tensorboard=false", "checkpoint.keep=0",
        "optimizer.lr=3e-3", "optimizer.min_lr=3e-4", "schedule.warmup_steps=3"]
# What the soak exercises: skip for a NaN, rollback for a spike, the re-check on, no exit 77 (the count is
# high: the soak's host is the only one), rollbacks enough for every spike.
GUARD = ["guard.on_nonfinite=skip", "guard.on_spike=rollback", "guard.rollback_skip=2", "guard.max_rollbacks=100",
         "guard.recheck=true", "guard.max_transient_faults=1000"]
LAYOUTS = {  # name: (ranks, overrides)
    "torch3d": (8, ["train.engine=torch", "parallel.tp=2", "parallel.pp=2", "train.micro_batch=1"]),
    "deepspeed3d": (8, ["train.engine=deepspeed", "parallel.tp=2", "parallel.pp=2", "train.micro_batch=1",
                        "zero.stage=1"]),
    "dp2": (2, ["train.engine=torch", "train.micro_batch=4"]),
    "deepspeed-dp2": (2, ["train.engine=deepspeed", "train.micro_batch=4"]),
    "tp2dp2": (4, ["train.engine=torch", "parallel.tp=2", "train.micro_batch=2"]),
}


@dataclass
class Fault:
    kind: str
    step: int
    rank: Optional[int]  # None: every rank
    loss: str = ""  # "once": which loss fault (nan or spike)
    fired: bool = False
    named: bool = False  # its line is in the logs
    detection_s: Optional[float] = None
    lost_steps: int = 0  # steps computed and then thrown away (recomputed after the relaunch / rollback)
    outcome: str = ""
    last_step: Optional[int] = None  # a stop's: the last step done before it (until the relaunch counts the loss)
    tag: str = ""  # a damage's: the checkpoint damaged

    def spelled(self) -> Optional[str]:
        """Its ``faults.inject`` part (None: the supervisor's own fault)."""
        rank = f":rank={self.rank}" if self.rank is not None else ""
        if self.kind == "once":
            return f"{self.loss}@{self.step}{rank}:once"
        return None if self.kind in ("sigstop", "damage") else f"{self.kind}@{self.step}{rank}"

    @property
    def name(self) -> str:
        return (self.spelled() or f"{self.kind}@{self.step}:rank={self.rank}").replace(":factor=1000", "")

    def stays(self) -> bool:
        """Still injected after it fired: bad data is bad again when a relaunch recomputes the step."""
        return self.kind in ("nan", "spike")


def schedule(seed: int, steps: int, every: int, world: int, loss_rank: bool, kinds=KINDS) -> list[Fault]:
    """About one fault every ``every`` steps from step ``every`` on, jittered by a quarter of it, each kind once
    (shuffled) before any repeats. ``loss_rank``: nan/spike hit one rank (pure DP); else every rank, since under
    TP/PP a loss fault on one rank may miss the loss (a first pipeline stage holds none)."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    out, jitter = [], every // 4
    for i, step in enumerate(range(every, steps - jitter, every)):
        kind = order[i] if i < len(order) else rng.choice(kinds)
        rank = rng.randrange(world)
        if kind == "sigstop":
            rank = rng.randrange(1, world)  # rank 0 says the hang line; a frozen rank 0 cannot (see README)
        elif kind == "damage":
            rank = 0
        elif kind in ("nan", "spike", "once") and not loss_rank:
            rank = None
        out.append(Fault(kind, step + rng.randint(-jitter, jitter), rank, rng.choice(("nan", "spike"))
                         if kind == "once" else ""))
    return out


# ------------------------------------------------------------------------------------------- one launch
class Launch:
    """``torchrun`` of ``megafixed train``, its output kept with each line's arrival time."""

    def __init__(self, ranks: int, overrides: list[str], env: dict, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        lock = ["flock", BIG_LOCK] if ranks >= 6 and shutil.which("flock") else []
        cmd = [*lock, sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "megafixed.cli", "train", "/dev/null",
               *overrides]
        self.log, self.lines, self.started = open(log, "w"), [], time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)  # its own group: leftovers are killed
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def first(self, pattern: str, after: float = 0.0) -> Optional[float]:
        """When the first line matching ``pattern`` arrived (after ``after``), or None."""
        rx = re.compile(pattern)
        return next((t for t, line in list(self.lines) if t >= after and rx.search(line)), None)

    def end(self) -> int:
        self.code = self.proc.wait()
        self.ended = time.monotonic()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # a rank torchrun left behind (a stopped one)
        except ProcessLookupError:
            pass
        self.reader.join()
        self.log.close()
        return self.code

    def exits(self) -> str:
        """torchrun's exit and its workers' exit codes as its failure report lists them."""
        codes = sorted({m.group(1) for _, line in self.lines for m in [re.search(r"exitcode\s*: (-?\d+)", line)] if m})
        return f"exit {self.code}" + (f" (workers: {', '.join(codes)})" if codes else "")

    def last_step(self) -> int:
        steps = [int(m.group(1)) for _, line in self.lines for m in [re.match(r"step (\d+)/", line)] if m]
        return max(steps, default=0)


def flip_model_file(tag_dir: Path) -> Path:
    """One byte of the checkpoint's first model file flipped (its manifest's sha256 no longer holds)."""
    from megafixed.engine import is_model_file

    path = sorted(p for p in tag_dir.iterdir() if is_model_file(p.name) and not p.name.startswith("."))[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def latest_tag_dir(run_dir: Path) -> Path:
    """The checkpoint ``<run_dir>/checkpoints/latest`` names (the library's reader: a missing tag is an error)."""
    from megafixed.run.run_dir import read_latest

    ckpt = run_dir / "checkpoints"
    return ckpt / read_latest(ckpt)


def final_weights_compared(soaked: Path, reference: Path, read=None) -> tuple[bool, int, list]:
    """(bit-identical, tensors compared, names that differ) of the final checkpoints of the soaked run and of
    its fault-free reference; ``read``: a tag directory -> its full state dict (default: the engine's reader)."""
    import torch

    if read is None:
        from megafixed.engine.weights import gather_state_dict as read
    a, b = read(latest_tag_dir(soaked)), read(latest_tag_dir(reference))
    differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    return not differ and len(a) > 0, len(a), differ


# ------------------------------------------------------------------------------------------- the soak
@dataclass
class Soak:
    layout: str
    steps: int
    out: Path
    faults: list
    save_interval: int = 10
    hang_timeout_s: float = 20
    collective_timeout_s: float = 60
    launches: list = field(default_factory=list)  # (exit code, resumed step, last step) per launch
    seen_files: set = field(default_factory=set)

    @property
    def run_dir(self) -> Path:
        return self.out / "run"

    def overrides(self, run_dir: Path, *extra: str) -> list[str]:
        # The spike window: full before the first spike, 32 at most -- a short one's std is noise, and the guard
        # then finds spikes of its own (a grad norm 6 sigma over 8 steps, seen in a 300-step soak).
        # The soak's spikes are x1000: 50 sigma catches them and none of a short window's own.
        spikes = [f.step for f in self.faults if f.kind in ("spike", "once")]
        window = max(4, min(32, min(spikes, default=34) - 2))
        return [*TINY, *GUARD, *LAYOUTS[self.layout][1], f"train.run_dir={run_dir}", f"guard.spike_window={window}",
                "guard.spike_sigma=50",
                f"train.max_steps={self.steps}", f"checkpoint.interval={self.save_interval}",
                f"watchdog.timeout_s={self.hang_timeout_s}",
                f"parallel.collective_timeout_s={self.collective_timeout_s}", *extra]

    def env(self, **extra) -> dict:
        skip = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGAFIXED_PAUSE")
        env = {k: v for k, v in os.environ.items() if k not in skip}
        path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1",
                **extra}

    def run(self, say=print) -> None:
        from megafixed.run.run_dir import tag_step

        damaged: set = set()  # tags this supervisor damaged (the relaunch must pass over them)
        for n in range(1, 2 * len(self.faults) + 4):
            tags = [t for t in self._tags() if t not in damaged]
            resumed = tag_step(max(tags, key=tag_step)) if tags else 0
            pending = [f for f in self.faults if f.step > resumed and (f.stays() or not f.fired)]
            inject = ";".join(s for f in pending for s in [f.spelled()] if s)
            pause = next((f for f in sorted(pending, key=lambda f: f.step) if f.kind in ("sigstop", "damage")), None)
            marker = self.out / f"paused.{n}"
            extra: dict = {}
            if pause is not None:
                extra["MEGAFIXED_PAUSE"] = f"train.step@{pause.step}:rank={pause.rank}:file={marker}"
            say(f"launch {n}: from step {resumed}; inject {inject or '-'}; pause {extra.get('MEGAFIXED_PAUSE', '-')}")
            drill = [f"faults.inject={inject}"] if inject else []
            launch = Launch(LAYOUTS[self.layout][0], self.overrides(self.run_dir, *drill), self.env(**extra),
                            self.out / f"launch-{n}.log")
            acted = self._supervise(launch, pause, marker, damaged)
            code = launch.end()
            if acted.get("pid"):  # torchrun may start a rank in a process group of its own: the stopped one goes
                with contextlib.suppress(ProcessLookupError):
                    os.kill(acted["pid"], signal.SIGKILL)
            self.launches.append({"launch": n, "exit": code, "from_step": resumed, "last_step": launch.last_step(),
                                  "wall_s": round(launch.ended - launch.started, 1)})
            self._after_relaunch(launch, resumed)  # (first: the faults of this launch are not yet read)
            self._read_faults(launch, acted, resumed)
            self._keep_account()
            if code == 0:
                return
        raise RuntimeError(f"the soak did not finish within {len(self.launches)} launches: see {self.out}")

    def _tags(self) -> list[str]:
        from megafixed.run.run_dir import checkpoint_tags

        return checkpoint_tags(self.run_dir / "checkpoints")

    def _supervise(self, launch: Launch, pause: Optional[Fault], marker: Path, damaged: set) -> dict:
        """Until the launch ends: at the pause, SIGSTOP the rank (and SIGKILL it once the hang is named), or
        damage the newest checkpoint and kill the rank. Returns what it did, with when.

        The other ranks' hang watchdog runs on the clock while the rank is paused, so on a busy machine it may
        end the launch before this loop acts: the pause is then acted on after the launch (the checkpoint is
        damaged all the same; the rank to stop or kill is already gone), never skipped."""
        acted: dict = {}
        while launch.proc.poll() is None:
            time.sleep(0.05)
            if pause is not None and not acted:
                self._act(launch, pause, marker, damaged, acted)
            if acted and acted["fault"].kind == "sigstop" and not acted.get("killed") and launch.first(r"^hang: "):
                with contextlib.suppress(ProcessLookupError):  # torchrun may have ended it already
                    os.kill(acted["pid"], signal.SIGKILL)  # the others named it and leave: the stopped rank goes too
                acted["killed"] = True
        if pause is not None and not acted:
            self._act(launch, pause, marker, damaged, acted)
        return acted

    @staticmethod
    def _paused_pid(launch: Launch, pause: Fault, marker: Path) -> Optional[int]:
        """The paused rank's pid: from its marker file, or (the launch has ended it, and the pause removed its
        marker on the way out) from its "paused at" line; None while it has not paused."""
        with contextlib.suppress(FileNotFoundError):
            return int(marker.read_text().split()[0])
        lines = [line for _, line in list(launch.lines) if line.startswith(f"paused at train.step@{pause.step}:")]
        m = re.search(r"; pid (\d+) on ", lines[0]) if lines else None
        return int(m.group(1)) if m else None

    def _act(self, launch: Launch, pause: Fault, marker: Path, damaged: set, acted: dict) -> None:
        """Stop the paused rank, or damage the newest checkpoint and kill the rank, once it has paused. A launch
        that is over is signalled no more: its ranks are gone, and a pid of theirs may be another process's now."""
        pid = self._paused_pid(launch, pause, marker)
        if pid is None:
            return
        if pause.kind == "damage":
            tag_dir = latest_tag_dir(self.run_dir)
            acted["file"] = str(flip_model_file(tag_dir))
            damaged.add(tag_dir.name)
        alive = launch.proc.poll() is None
        if alive:
            with contextlib.suppress(ProcessLookupError):  # ended by the watchdog's verdict first: gone either way
                os.kill(pid, signal.SIGSTOP if pause.kind == "sigstop" else signal.SIGKILL)
        acted.update(fault=pause, pid=pid, at=time.monotonic(), alive=alive)
        marker.unlink(missing_ok=True)

    def _read_faults(self, launch: Launch, acted: dict, resumed: int) -> None:
        """Which faults this launch met, named by which line, how soon, and what they cost."""
        last = launch.last_step()
        for f in self.faults:
            if f.step <= resumed or f.named or f.kind in ("sigstop", "damage"):
                continue
            before = launch.first(rf"^step {f.step - 1}/") or launch.started
            if f.kind == "nan":
                self._met(f, launch.first(rf"^bad step {f.step}: the loss is nan"), before,
                          "step skipped (guard.on_nonfinite=skip)")
            elif f.kind == "spike":
                t = launch.first(rf"^bad step {f.step}: the loss .* is a spike")
                for _, line in launch.lines:
                    m = re.match(r"rollback \d+/\d+: reloaded .*step_(\d+) \(verified\); steps (\d+)-(\d+) ", line)
                    if t is not None and m and int(m.group(2)) <= f.step <= int(m.group(3)):
                        f.lost_steps = f.step - 1 - int(m.group(1))  # computed, then thrown away by the rollback
                        self._met(f, t, before, f"rolled back to step {int(m.group(1))}, steps "
                                                f"{m.group(2)}-{m.group(3)} skipped (guard.on_spike=rollback)")
            elif f.kind == "once":
                line = next((ln for _, ln in launch.lines if ln.startswith(f"transient fault at step {f.step}:")), "")
                who = re.search(r"\): (ranks? \S+ on [^.]+|no rank[^.]*)\. Trained", line)
                self._met(f, launch.first(rf"^transient fault at step {f.step}: "), before,
                          f"transient: trained on the recomputation ({who.group(1) if who else '?'} named)")
            else:  # exit, hang: the rank's own line, then the job's end or the watchdog's
                what = "dies \\(SIGKILL\\)" if f.kind == "exit" else "stops making progress"
                t0 = launch.first(rf"rank {f.rank} {what} before step {f.step}")
                if t0 is not None:
                    t = launch.ended if f.kind == "exit" else launch.first(rf"^hang: .*never reached step {f.step}")
                    named = "; the hang named" if t and f.kind == "hang" else ""
                    self._stopped(f, t, t0, last, launch.exits() + named)
        f = acted.get("fault")
        if f is not None and f.kind == "sigstop":
            # from the pause, not from the SIGSTOP: on a busy machine the watchdog may name it before we act
            since = launch.first(rf"^paused at train\.step@{f.step}:") or acted["at"]
            t = launch.first(rf"^hang: .*rank[^;]*never reached step {f.step}", after=since)
            end = "the stopped rank SIGKILLed" if acted["alive"] else "the launch ended before the SIGSTOP"
            self._stopped(f, t, since, last, f"SIGSTOP; {launch.exits()}; the hang named; {end}")
        elif f is not None:
            f.tag = Path(acted["file"]).parent.name
            how = "rank 0 killed" if acted["alive"] else "the launch had ended on the hang watchdog"
            self._stopped(f, None, acted["at"], last, f"a byte of {f.tag}/{Path(acted['file']).name} flipped; {how}")

    def _after_relaunch(self, launch: Launch, resumed: int) -> None:
        """At a relaunch's end: what each stop it follows cost, and the damage it must have passed over."""
        for f in self.faults:
            if f.last_step is not None:
                f.lost_steps, f.last_step = max(0, f.last_step - resumed), None  # done, then done again
            if f.kind == "damage" and f.fired and not f.named:
                t = launch.first(rf"{f.tag} is damaged.*moved aside to .*{f.tag}\.damaged-")
                if t is not None:
                    f.named, f.detection_s = True, round(t - launch.started, 1)
                    f.outcome += f"; the relaunch fell back to step {resumed}, {f.tag}.damaged-* kept"

    def _met(self, f: Fault, t: Optional[float], before: float, outcome: str) -> None:
        if t is not None:
            f.fired = f.named = True
            f.detection_s, f.outcome = round(t - before, 2), outcome

    def _stopped(self, f: Fault, t: Optional[float], t0: float, last: int, outcome: str) -> None:
        f.fired, f.named, f.last_step, f.outcome = True, t is not None, last, outcome
        f.detection_s = round(t - t0, 1) if t is not None else None

    def _keep_account(self) -> None:
        from megafixed.train.evidence import files_of

        self.seen_files |= set(files_of(self.run_dir)) if self.run_dir.is_dir() else set()

    # ---- the checks
    def lost_files(self) -> list[str]:
        """Files a launch left that are nowhere now: not in place, not in a damaged tag set aside, not in an
        attempt set aside."""
        from megafixed.train.evidence import files_of

        now = set(files_of(self.run_dir))
        aside = {re.sub(r"\.damaged-[^/]*", "", p) for p in now if ".damaged-" in p}
        attempts = {p.split("/", 2)[2] for p in now if p.startswith("attempts/")}
        return sorted(p for p in self.seen_files if p not in now and p not in aside and p not in attempts)

    def own_verdicts(self) -> list[Fault]:
        """The guard's verdicts no scheduled fault explains (a real spike of the run), as rows of the table."""
        bad, scheduled = self.run_dir / "faults" / "bad_steps.jsonl", {f.step for f in self.faults}
        rows = {}
        for line in bad.read_text().splitlines() if bad.exists() else []:
            rec = json.loads(line)
            if rec["step"] not in scheduled:
                rows[rec["step"]] = Fault(f"(guard) {rec['what']} {rec['kind']}", rec["step"], None, named=True,
                                          fired=True, outcome=f"not injected: {rec['action']}")
        return list(rows.values())

    def skip_windows(self) -> list[int]:
        """The steps the soak skipped: persistent bad steps (``skip``) and rollbacks' windows."""
        faults = self.run_dir / "faults"
        steps = set()
        bad = faults / "bad_steps.jsonl"
        for line in bad.read_text().splitlines() if bad.exists() else []:
            rec = json.loads(line)
            if rec.get("action") == "skip":
                steps.add(int(rec["step"]))
        windows = faults / "skipped_steps.json"
        for w in json.loads(windows.read_text())["windows"] if windows.exists() else []:
            steps |= set(range(int(w["first"]), int(w["last"]) + 1))
        return sorted(steps)

    def reference(self, say=print) -> tuple[Path, str]:
        from megafixed.step_ranges import merge, spelled

        skips = spelled(merge((s, s) for s in self.skip_windows()))
        ref = self.out / "reference"
        extra = [f"data.skip_steps={skips}"] if skips else []
        say(f"reference: fault-free, data.skip_steps={skips or '-'}")
        launch = Launch(LAYOUTS[self.layout][0], self.overrides(ref, *extra), self.env(), self.out / "reference.log")
        if launch.end() != 0:
            raise RuntimeError(f"the fault-free reference failed: see {self.out / 'reference.log'}")
        return ref, skips

    def same_weights(self, ref: Path) -> tuple[bool, int, list]:
        """(bit-identical, tensors compared, names that differ) of the two runs' final checkpoints."""
        return final_weights_compared(self.run_dir, ref)


def table(faults: list) -> str:
    rows = [("fault", "step", "rank", "named", "detected (s)", "lost steps", "outcome")]
    for f in faults:
        rows.append((f.name, str(f.step), "all" if f.rank is None else str(f.rank), "yes" if f.named else "NO",
                     "-" if f.detection_s is None else f"{f.detection_s:g}", str(f.lost_steps), f.outcome))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(" | ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]) for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seed", type=int, default=None, help="the fault schedule's seed (default: a random one, printed)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=30, help="about one fault every this many steps")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="torch3d")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"the fault kinds to draw from ({','.join(KINDS)})")
    ap.add_argument("--save-interval", type=int, default=None, help="default: a third of --every")
    ap.add_argument("--hang-timeout", type=float, default=20, help="watchdog.timeout_s")
    ap.add_argument("--collective-timeout", type=float, default=60, help="parallel.collective_timeout_s")
    ap.add_argument("--out", type=Path, required=True, help="a new directory: the run, the reference, every log")
    ap.add_argument("--json", type=Path, default=None, help="also write the table and the checks here")
    args = ap.parse_args(argv)
    seed = random.SystemRandom().randrange(10**6) if args.seed is None else args.seed
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if set(kinds) - set(KINDS) or not kinds:
        ap.error(f"--kinds: choose from {','.join(KINDS)}")
    ranks, layout = LAYOUTS[args.layout]
    pure_dp = not any(o.startswith(("parallel.tp=", "parallel.pp=")) for o in layout)
    faults = schedule(seed, args.steps, args.every, ranks, loss_rank=pure_dp, kinds=kinds)
    save = args.save_interval or max(1, args.every // 3)
    args.out.mkdir(parents=True, exist_ok=False)
    soak = Soak(args.layout, args.steps, args.out, faults, save_interval=save, hang_timeout_s=args.hang_timeout,
                collective_timeout_s=args.collective_timeout)
    print(f"soak: seed {seed}, {args.layout} on {ranks} ranks, {args.steps} steps, save every {save}, "
          f"{len(faults)} faults: {', '.join(f.name for f in faults)}", flush=True)
    t0 = time.monotonic()
    soak.run(say=lambda s: print(s, flush=True))
    soak_s = time.monotonic() - t0
    ref, skips = soak.reference(say=lambda s: print(s, flush=True))
    same, tensors, differ = soak.same_weights(ref)
    lost = soak.lost_files()
    unnamed = [f.name for f in faults if not f.named]
    print(table(sorted(faults + soak.own_verdicts(), key=lambda f: f.step)))
    print(f"seed {seed}; {len(soak.launches)} launches in {soak_s:.0f}s; skipped steps {skips}; final weights "
          f"{'bit-identical' if same else 'DIFFER'} to the fault-free reference ({tensors} tensors"
          + (f", differ: {differ[:5]}" if differ else "") + f"); faults not named: {unnamed or 'none'}; "
          f"files lost: {lost or 'none'}")
    report = {"seed": seed, "layout": args.layout, "ranks": ranks, "steps": args.steps, "every": args.every,
              "save_interval": save, "faults": [{k: v for k, v in asdict(f).items()} for f in faults],
              "own_verdicts": [asdict(f) for f in soak.own_verdicts()], "launches": soak.launches,
              "soak_s": round(soak_s, 1), "skipped_steps": skips,
              "bit_identical": same, "tensors": tensors, "differ": differ, "unnamed": unnamed, "lost_files": lost}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if same and not unnamed and not lost else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's megafixed, not another installed one
    sys.exit(main())
