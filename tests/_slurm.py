"""A real one-node Slurm cluster on localhost for the tests (Debian's slurm-wlm + munge, as root).

``.ci/run`` installs the packages; this module starts munged (if no munged answers yet),
slurmctld and ``slurmd -N localhost`` with a private slurm.conf, state and ports under a temp
dir, and stops what it started. ``start_cluster`` returns a reason string instead of a cluster
where Slurm cannot start here (no packages, not root, a daemon that does not come up), and the
tests skip with that reason.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from _env import launch_free_env

CONF = """\
ClusterName=megafixed-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
# A requeued job waits out its old credential's lifetime before it may start again (120 s by default);
# releasing it sooner gets it killed ("Job credential revoked"). 10 s keeps the requeue test short.
AuthInfo=cred_expire=10
# The main and the backfill scheduler every second instead of every 60 / 30 s: a job that becomes
# eligible (a requeued job's credential expired, an array's next task) starts then, not at the next pass.
SchedulerParameters=sched_interval=1,bf_interval=1
# KillWait: seconds between TERM and KILL at a time limit / scancel (30 is Slurm's default)
KillWait=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    root: Path
    env: dict
    started: list = field(default_factory=list)  # (name, pid) of daemons we started

    def run(self, *cmd: str, check: bool = True, timeout: int = 60) -> subprocess.CompletedProcess:
        out = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}{out.stdout}")
        return out

    def job_state(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...); {} once the job is gone."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        if out.returncode != 0:
            return {}
        return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)

    def wait_for(self, job_id: str, states: set, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout  # a bound for a hang: the states waited for are ones a job stays in
        while time.monotonic() < deadline:
            info = self.job_state(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} did not reach {states} in {timeout}s: {self.job_state(job_id)}\n"
                             f"{self.logs()}")

    def logs(self) -> str:
        return "".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        for _name, pid in reversed(self.started):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _munge_works() -> bool:
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        return cred.returncode == 0 and subprocess.run(["unmunge"], input=cred.stdout, capture_output=True,
                                                       timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _pid(path: Path, timeout: float = 120) -> int | None:
    deadline = time.monotonic() + timeout  # a bound for a hang: a loaded machine starts a daemon slowly
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text().split()[0])
        time.sleep(0.1)
    return None



def ensure_munged(cluster: "Cluster") -> str | None:
    """Start munged (shared by every test cluster) unless one already answers; its pid joins the
    cluster's daemons. Returns why it could not start (the cluster is stopped then), else None."""
    if _munge_works():
        return None
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], capture_output=True, timeout=30)
    pid = _pid(Path("/run/munge/munged.pid"))
    if pid:
        cluster.started.append(("munged", pid))
    if not _munge_works():
        cluster.stop()
        return "munged did not start (runuser -u munge -- /usr/sbin/munged)"
    return None


def start_cluster(root: Path) -> Cluster | str:
    """A running cluster, or the reason Slurm cannot start here."""
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "munged", "munge")
               if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; `apt-get install slurm-wlm munge`)"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root, and the tests do not run as root"
    root.mkdir(parents=True, exist_ok=True)
    for d in ("state", "spool"):
        (root / d).mkdir(exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(root=root, ctld_port=_free_port(), slurmd_port=_free_port()))
    env = launch_free_env(SLURM_CONF=str(conf))  # the jobs inherit it (sbatch and srun export it)
    cluster = Cluster(root, env)
    problem = ensure_munged(cluster)
    if problem:
        return problem
    for name, cmd in (("slurmctld", ["slurmctld", "-f", str(conf)]),
                      ("slurmd", ["slurmd", "-f", str(conf), "-N", "localhost"])):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        pid = _pid(root / f"{name}.pid")
        if out.returncode != 0 or pid is None:
            cluster.stop()
            return f"{name} did not start ({out.stderr.strip()[-300:]}; log {root}/{name}.log)"
        cluster.started.append((name, pid))
    deadline = time.monotonic() + 120  # a bound for a hang, not a speed
    while time.monotonic() < deadline:
        state = cluster.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
        if state == "idle":
            return cluster
        time.sleep(0.5)
    cluster.stop()
    return f"the Slurm node did not become idle in 120 s (sinfo says {state!r}); logs in {root}"
