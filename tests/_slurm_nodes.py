"""A real multi-node Slurm cluster on one machine, for the tests: each node a network namespace.

Layout (all addresses in 10.213.0.0/24, all inside namespaces this module creates; nothing is added
to the host's own network namespace, and no packet leaves them):

* ``mfslurm-ctl``: the "login/controller" host ``mfctl`` (10.213.0.1): the bridge ``mfbr`` and slurmctld.
  Client commands (sbatch, scontrol, scancel, ``megafixed submit``) run in it, like on a login node.
* ``mfslurm-nodeK``: compute node ``nodeK`` (10.213.0.1K, K = 1..3), a veth pair to the bridge, its own hostname
  (a UTS namespace) and its own ``slurmd -N nodeK``. Its /etc/hosts (a private mount namespace) maps its own
  name to 127.0.1.1 like Debian's installer does, and the other nodes to their addresses: the classic
  multi-node trap, so the head-node resolution of ``megafixed.launch.head`` runs for real.

munged is shared (a unix socket, which network namespaces do not separate). Ports, state, config and
log paths are private to this cluster (under its temp root), so it never meets the one-node cluster
of ``tests/_slurm.py``. Partitions group the nodes (e.g. node1+node2 for the jobs that cut a link,
node1+node3 for the others, so a cut node never carries another test's job). A TaskProlog lets a test make
one node stall before its task starts (``stall(node, job_name)``) or run another copy of megafixed
(``other_code(node, job_name, path)``).

``start_cluster`` returns a reason string where it cannot start (not root, packages missing); ``stop``
removes every daemon and namespace even after a failure, and says if one stayed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from _env import launch_free_env
from _slurm import Cluster, _pid, ensure_munged

PREFIX = "mfslurm"
CTL_NS, BRIDGE, SUBNET = f"{PREFIX}-ctl", "mfbr", "10.213.0"
CTL_ADDR = f"{SUBNET}.1"

CONF = """\
ClusterName=megafixed-nodes
SlurmctldHost=mfctl({ctl_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
# Ports inside the namespaces: they cannot collide with the one-node cluster or anything on the host.
SlurmctldPort=6917
SlurmdPort=6918
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog={root}/task_prolog.sh
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
# A requeued job waits out its old credential (cred_expire) before it may start again.
AuthInfo=cred_expire=10
KillWait=15
# A node whose link is cut is declared down this long after its last answer (Slurm's default is 300 s) and its
# jobs requeue. slurmctld pings every SlurmdTimeout/3 s, so that answer may be up to 15 s before the cut: down
# 30-60 s after it, always after the cut run's collective timeout (20 s) + roll call (5 s): the survivors speak
# first (with 30, Slurm was seen to take the node down 26 s after a cut, 1 s after the survivors).
SlurmdTimeout=45
# CPUs per node (fictional on a 2-core machine: slurmd takes the configured count): every job of a test
# module at once, so that one job's waits (timeouts, requeue) overlap another's CPU work.
SlurmdParameters=config_overrides
MessageTimeout=5
# The main and the backfill scheduler every second instead of every 60 / 30 s: a requeued job starts as soon
# as its old credential expired, instead of at the next periodic pass.
SchedulerParameters=sched_interval=1,bf_interval=1
# A finished job's record stays this long (default 300 s): a test may look at a job that ended minutes ago.
MinJobAge=3600
{nodes}
{partitions}
"""

# Runs before every task. A flag file per node and job name makes that node's tasks stall (the task
# does not start while the flag exists: until its test removes it, or the job's time limit) or run another
# megafixed (PYTHONPATH). Each task's node is recorded.
PROLOG = """#!/bin/sh
flag={root}/$(hostname)-$SLURM_JOB_NAME
# where each task ran, for the tests that check a layout (task_nodes)
echo "$SLURM_JOB_ID $SLURM_PROCID $(hostname)" >> {root}/tasks.log
while [ -e $flag.stall ]; do sleep 0.5; done
# PYTHONSAFEPATH: `python -m` would otherwise import the working directory's megafixed first
if [ -e $flag.pythonpath ]; then echo "export PYTHONPATH=$(cat $flag.pythonpath)"; echo "export PYTHONSAFEPATH=1"; fi
exit 0
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def our_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.startswith(PREFIX + "-")]


class NodesCluster(Cluster):
    """A Cluster whose client commands run in the controller's namespace (the "login node")."""

    def __init__(self, root: Path, env: dict, nodes: list[str]):
        super().__init__(root, env)
        self.nodes = nodes

    def addr(self, node: str) -> str:
        return f"{SUBNET}.1{self.nodes.index(node) + 1}"

    def in_ctl(self, cmd: list[str]) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{CTL_NS}", *cmd]

    def run(self, *cmd: str, check: bool = True, timeout: int = 60) -> subprocess.CompletedProcess:
        out = subprocess.run(self.in_ctl(list(cmd)), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}{out.stdout}")
        return out

    # --- faults a test injects ---
    def stall(self, node: str, job_name: str, on: bool = True) -> None:
        """The tasks of job ``job_name`` on ``node`` do not start while on (the job's time limit bounds it)."""
        flag = self.root / f"{node}-{job_name}.stall"
        flag.touch() if on else flag.unlink(missing_ok=True)

    def other_code(self, node: str, job_name: str, pythonpath: str) -> None:
        """The tasks of job ``job_name`` on ``node`` import megafixed from ``pythonpath``."""
        (self.root / f"{node}-{job_name}.pythonpath").write_text(pythonpath)

    def signal_job(self, job_id: str, sig: int, nodes: list[str] | None = None, ranks_only: bool = True) -> list[int]:
        """Send ``sig`` to the job's training ranks on ``nodes`` (default all); returns their pids.
        ``ranks_only=False``: to every process of the job there (the batch shell and srun too)."""
        pids = [p for node in (nodes or self.nodes) for p in self.task_pids(node, job_id, ranks_only)]
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def task_nodes(self, job_id: str) -> dict[int, str]:
        """rank -> node of every task the job started (recorded by the TaskProlog)."""
        path = self.root / "tasks.log"
        rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
        return {int(rank): node for job, rank, node in rows if job == job_id}

    def link(self, node: str, up: bool) -> None:
        """Cut (or restore) the node's only network link, on the bridge side."""
        _ip("-n", CTL_NS, "link", "set", f"v-{node}", "up" if up else "down")

    def task_pids(self, node: str, job_id: str, ranks_only: bool = True) -> list[int]:
        """The training ranks (``megafixed.cli train``) of ``job_id`` running on ``node``; ``ranks_only=False``:
        every process of the job there (its batch shell, srun and what they run)."""
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
                rank = cmd[1:3] == [b"-m", b"megafixed.cli"] and b"train" in cmd  # a rank, not srun itself
                if ranks_only and not rank:
                    continue
                env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
            except (OSError, ValueError):
                continue
            mine = env.get(b"SLURM_CONF") == str(self.root / "slurm.conf").encode()  # not an earlier cluster's job
            if mine and env.get(b"SLURM_JOB_ID") == job_id.encode() and env.get(b"SLURMD_NODENAME") == node.encode():
                pids.append(int(proc.name))
        return pids

    def wait_idle(self, timeout: float = 120, nodes: list[str] | None = None) -> None:
        """Until ``nodes`` (default: all) are idle, i.e. up and running no job (``timeout``: a bound for a hang)."""
        names = ",".join(nodes or self.nodes)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-n", names, "-o", "%t", check=False).stdout.split()
            if states and all(s == "idle" for s in states):
                return
            time.sleep(0.2)
        raise AssertionError(f"nodes {names} not idle after {timeout}s: {self.run('sinfo', '-N', check=False).stdout}")

    def stop(self) -> list[str]:
        """Stop every daemon, delete every namespace; returns the namespaces that would not go."""
        if (self.root / "slurm.conf").exists() and CTL_NS in our_namespaces():
            subprocess.run(self.in_ctl(["scancel", "--full", "--user", "root"]), env=self.env, capture_output=True,
                           timeout=30)
        for node in self.nodes:  # a cut link must not keep a daemon from hearing its TERM
            _ip("-n", CTL_NS, "link", "set", f"v-{node}", "up", check=False)
        # Not Cluster.stop: its scancel runs outside the controller's namespace, where slurmctld's address
        # does not route, and waits out MessageTimeout for nothing.
        _terminate([pid for _name, pid in self.started], kill_after=2)  # throwaway state: no clean shutdown needed
        # Anything still running inside our namespaces (a stalled prolog, a straggling rank) goes too, until none
        # is left: a slurmstepd forked while the pass runs (a job starting at teardown) would otherwise outlive its
        # deleted namespace, its ranks would keep running, and the next cluster's job of the same id would see them.
        deadline = time.monotonic() + 60  # a bound for a hang: a loaded machine reaps slowly
        while time.monotonic() < deadline:
            pids = [pid for ns in our_namespaces() for pid in _ip("netns", "pids", ns, check=False).stdout.split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.1)
        return remove_namespaces()


def _terminate(pids: list[int], kill_after: float) -> None:
    """SIGTERM to all, then SIGKILL to those still there after ``kill_after`` seconds."""
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False

    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + kill_after
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def remove_namespaces() -> list[str]:
    for ns in our_namespaces():
        _ip("netns", "delete", ns, check=False)
    return our_namespaces()


def _in_node(ns: str, hostname: str, hosts: Path, cmd: list[str]) -> list[str]:
    """``cmd`` inside network namespace ``ns``, with its own hostname and its own /etc/hosts.

    nsenter, not ``ip netns exec``: the latter remounts /sys, hiding the cgroup mounts slurmd needs."""
    script = f"mount --bind {hosts} /etc/hosts && hostname {hostname} && exec \"$@\""
    return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", script, "sh", *cmd]


def _network(nodes: list[str]) -> None:
    _ip("netns", "add", CTL_NS)
    _ip("-n", CTL_NS, "link", "set", "lo", "up")
    _ip("-n", CTL_NS, "link", "add", BRIDGE, "type", "bridge")
    _ip("-n", CTL_NS, "addr", "add", f"{CTL_ADDR}/24", "dev", BRIDGE)
    _ip("-n", CTL_NS, "link", "set", BRIDGE, "up")
    for i, node in enumerate(nodes, start=1):
        ns = f"{PREFIX}-{node}"
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", CTL_NS, "link", "add", f"v-{node}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", CTL_NS, "link", "set", f"v-{node}", "master", BRIDGE, "up")
        _ip("-n", ns, "addr", "add", f"{SUBNET}.1{i}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")


def start_cluster(root: Path, n_nodes: int = 2, partitions: dict[str, list[str]] | None = None,
                  cpus: int = 4) -> NodesCluster | str:
    """A running n-node cluster (nodes ``node1``..), or the reason it cannot start here.

    ``partitions``: name -> nodes, the first one the default (default: one partition ``debug`` of all nodes)."""
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "munged", "munge", "ip", "unshare",
                           "nsenter")
               if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        return (f"the multi-node test cluster needs {', '.join(missing)} (`apt-get install slurm-wlm munge iproute2 "
                f"util-linux`)")
    if os.geteuid() != 0:
        return "the multi-node test cluster creates network namespaces and runs Slurm's daemons as root; not root"
    nodes = [f"node{i}" for i in range(1, n_nodes + 1)]
    root.mkdir(parents=True, exist_ok=True)
    for d in ["state", *(f"spool-{n}" for n in nodes)]:
        (root / d).mkdir(exist_ok=True)
    conf = root / "slurm.conf"
    node_lines = "\n".join(f"NodeName={n} NodeAddr={SUBNET}.1{i} CPUs={cpus}" for i, n in enumerate(nodes, start=1))
    part_lines = "\n".join(f"PartitionName={name} Nodes={','.join(members)} Default={'YES' if i == 0 else 'NO'} "
                            f"MaxTime=INFINITE State=UP"
                            for i, (name, members) in enumerate((partitions or {"debug": nodes}).items()))
    conf.write_text(CONF.format(root=root, ctl_addr=CTL_ADDR, nodes=node_lines, partitions=part_lines))
    prolog = root / "task_prolog.sh"
    prolog.write_text(PROLOG.format(root=root))
    prolog.chmod(0o755)
    env = launch_free_env(SLURM_CONF=str(conf))
    cluster = NodesCluster(root, env, nodes)
    remove_namespaces()  # a previous run killed before its teardown
    try:
        _network(nodes)
    except RuntimeError as exc:
        cluster.stop()
        return f"cannot build the test network ({exc})"
    problem = ensure_munged(cluster)
    if problem:
        return problem
    daemons = [("slurmctld", "mfctl", CTL_NS, ["slurmctld", "-f", str(conf)], root / "slurmctld.pid")]
    for node in nodes:
        daemons.append((f"slurmd-{node}", node, f"{PREFIX}-{node}", ["slurmd", "-f", str(conf), "-N", node],
                        root / f"slurmd-{node}.pid"))
    for name, host, ns, cmd, pidfile in daemons:
        hosts = root / f"hosts-{host}"
        others = "".join(f"{SUBNET}.1{i} {n}\n" for i, n in enumerate(nodes, start=1) if n != host)
        own = f"{CTL_ADDR} mfctl\n" if host == "mfctl" else f"127.0.1.1 {host}\n{CTL_ADDR} mfctl\n"
        hosts.write_text("127.0.0.1 localhost\n" + own + others)
        out = subprocess.run(_in_node(ns, host, hosts, cmd), env=env, capture_output=True, text=True, timeout=60)
        pid = _pid(pidfile)
        if out.returncode != 0 or pid is None:
            cluster.stop()
            return f"{name} did not start ({out.stderr.strip()[-300:]}; log {root}/{name}.log)"
        cluster.started.append((name, pid))
    try:
        cluster.wait_idle()
    except AssertionError as exc:
        cluster.stop()
        return f"the test nodes did not become idle ({exc}); logs in {root}"
    return cluster
