"""Multi-node training on a real multi-node Slurm: 3 nodes (network namespaces, tests/_slurm_nodes.py),
2 CPU ranks per node and job, every job submitted by ``megafixed submit`` (its real sbatch script).

Checked: DP, TP=2 across nodes and PP=2 across nodes train with the losses of one process; the
rendezvous uses the head node's network address although its name maps to 127.0.1.1; a pre-timeout
stop checkpoints on every rank at one step, requeues and finishes with the uninterrupted losses; a
node that dies mid-step (its ranks killed, or its link cut) is named by the survivors within the
run's collective timeout, and a resubmitted job resumes from the last checkpoint with identical
losses; a node that never starts its task, or runs other code, is refused within the rendezvous
timeout, naming it. Resilience: an injected hang (``hang@3:rank=1``) exits 76 in Slurm's view, names the
rank and its node, leaves a stack file per rank, and the job script requeues it up to
``MEGAFIXED_MAX_REQUEUES``; a dp 3 job (``--nodes 2-3``) that loses its head node is requeued by Slurm
onto the two others and goes on with dp 2 and the same global batch (the one-process losses, every
step), saying it shrank; a range whose minimum would split a TP pair is refused at submit in one line.

How it fits its time budget on 2 cores (each rank spends ~10 s of CPU starting torch and DeepSpeed, so
the group is CPU-bound and every rank start counts):
* the faults form ONE run directory's life, four jobs: killed ranks -> the resubmitted job resumes and
  its node's link is cut -> the resubmitted job resumes and gets the pre-timeout USR1 -> Slurm's requeue
  finishes the run; every job resumes from the one before, and the finished run's losses (each step
  written by one of the four jobs) must be the uninterrupted job's, bit for bit;
* those run on node1+node2 (partition ``faults``); everything else on node1+node3 (``side``), submitted
  at once, so their CPU work fills the faults' timeouts, and a cut node2 carries no other job;
* TP and PP across nodes are one tp=2 x pp=2 job whose TP pairs and PP pairs both span the nodes
  (an arbitrary task layout); the single-process reference runs beside the cluster's jobs.
* the hang drill is one of those side jobs (1 rank per node); the job that loses a node runs last, on all
  three (partition ``all``), when no other job is left to disturb, 1 rank per node; its one-process
  reference (global batch 12) runs beside the first jobs.

Run as root (network namespaces), with the other Slurm tests in their own invocation, serialised with
other sessions': ``flock /tmp/megafixed-slurm.lock python -m pytest -q -n 0 -m slurm``.
"""
from __future__ import annotations

import datetime
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _slurm_nodes import start_cluster

from _metrics import read_metrics
from _pause import pause_env, wait_paused
from _train_data import tiny_overrides, write_shards
from megafixed import exit_codes
from megafixed.launch.lost import ROLL_CALL_S

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.multiprocess]

STEPS = 12  # room for three faults in one run: each job resumes, runs a few steps, and is interrupted
RDZV_TIMEOUT = 120  # the default: a dozen ranks start at once here, on 2 cores
CUT_TIMEOUT = 20  # parallel.collective_timeout_s of the job whose link is cut: the bound on detecting a dead node
# The other jobs' (a rank may start well after its peers when a dozen share 2 cores; no fault waits on it).
LONG_TIMEOUT = 120
HANG_TIMEOUT = 15  # watchdog.timeout_s of the hang drill: well above a tiny step even with a dozen ranks on 2 cores
COMMON = (f"train.max_steps={STEPS}", "validation.interval=0", "checkpoint.interval=2", "train.micro_batch=2",
          "schedule.warmup_steps=1")
FAULTS, SIDE = "faults", "side"  # partitions: node1+node2 (the faults), node1+node3 (everything else)
ALL = "all"  # the three nodes: the job that loses one (run last, when every other job has ended)
SHRINK_BATCH = "train.global_batch=12"  # dp 3 (accum 2) and dp 2 (accum 3) keep it whole


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    found = start_cluster(tmp_path_factory.mktemp("slurm-nodes"), n_nodes=3, cpus=10,
                          partitions={FAULTS: ["node1", "node2"], SIDE: ["node1", "node3"],
                                      ALL: ["node1", "node2", "node3"]})
    if isinstance(found, str):
        pytest.skip(found)
    # The jobs run `python -m megafixed.cli` from the submit directory (ROOT): this checkout's code.
    found.env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MEGAFIXED_RDZV_TIMEOUT=str(RDZV_TIMEOUT))
    yield found
    left = found.stop()
    assert not left, f"network namespaces left behind: {left}"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes-data")
    cfg = root / "empty.yaml"
    cfg.write_text("{}\n")
    return str(cfg), write_shards(root / "shards")


def _one_process_env() -> dict:
    from _env import launch_free_env

    return {k: v for k, v in launch_free_env(OMP_NUM_THREADS="1").items() if not k.startswith("SLURM_")}


@pytest.fixture(scope="module")
def reference_run(inputs, tmp_path_factory):
    """One process, same data and global batch, started beside the cluster's first jobs."""
    cfg, prefix = inputs
    root = tmp_path_factory.mktemp("nodes-ref")
    with open(root / "out.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megafixed.cli", "train", cfg,
                                 *tiny_overrides(prefix, root / "run", *COMMON)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=_one_process_env())
    yield proc, root
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def shrink_reference_run(inputs, tmp_path_factory):
    """One process with the shrinking job's global batch (12): the reference of its dp 3 and dp 2 steps alike."""
    cfg, prefix = inputs
    root = tmp_path_factory.mktemp("nodes-shrink-ref")
    with open(root / "out.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megafixed.cli", "train", cfg,
                                 *tiny_overrides(prefix, root / "run", *COMMON, SHRINK_BATCH)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=_one_process_env())
    yield proc, root
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def reference(reference_run):
    """The losses every layout must reproduce."""
    proc, root = reference_run
    assert proc.wait(timeout=300) == 0, (root / "out.log").read_text()[-3000:]
    return losses(root / "run")


def submit(cluster, inputs, run_dir, *extra, **how) -> str:
    return submit_all(cluster, inputs, {run_dir: (extra, how)})[run_dir]


def submit_all(cluster, inputs, jobs: dict) -> dict:
    """``megafixed submit`` for each ``run_dir: (extra overrides, options)``, all at once (each submit spends
    seconds of CPU importing torch); returns run_dir -> job id."""
    cfg, prefix = inputs
    procs = {}
    for run_dir, (extra, how) in jobs.items():
        cmd = cluster.in_ctl([sys.executable, "-m", "megafixed.cli", "submit", cfg, "--nodes", str(how.get("nodes", 2)),
                              "--gpus-per-node", str(how.get("per_node", 2)), "--cpu", "--cpus-per-task", "1",
                              "--time", "00:10:00", "--partition", how.get("partition", FAULTS),
                              *tiny_overrides(prefix, run_dir, *COMMON, "parallel.collective_timeout_s="
                                              f"{how.get('collective_timeout', LONG_TIMEOUT)}", *extra)])
        procs[run_dir] = subprocess.Popen(cmd, cwd=ROOT, env={**cluster.env, **how.get("env", {})},
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ids = {}
    for run_dir, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        ids[run_dir] = out.strip()
    return ids


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "loss", missing_ok=True)}


def job_log(run_dir, job_id) -> str:
    path = Path(run_dir) / "slurm" / f"{job_id}.out"
    return path.read_text() if path.exists() else ""


def finished(cluster, job, run_dir, state="COMPLETED", timeout=240) -> dict:
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=timeout)
    assert info["JobState"] == state, (info, job_log(run_dir, job)[-6000:])
    return info


def assert_same_losses(got: dict, ref: dict, what: str) -> None:
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), (what, got)
    for step in ref:
        assert math.isclose(got[step], ref[step], rel_tol=1e-5), f"{what}: step {step}: {got[step]} vs {ref[step]}"


def errors(log: str) -> int:
    """Our error lines (srun's own "srun: error: ..." lines are not ours)."""
    return sum(line.startswith("error:") for line in log.splitlines())


def wait_for_text(run_dir, job, text: str, cluster, timeout: float = 180) -> float:
    """Wait until ``text`` is in the job's log; returns the time it was seen."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in job_log(run_dir, job):
            return time.time()
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in the log of job {job} after {timeout}s: {cluster.job_state(job)}\n"
                         f"{job_log(run_dir, job)[-4000:]}")


def pause_at(run_dir, step: int, **where) -> dict:
    """The environment that stops each rank (or those of ``where``, e.g. host=node1) before ``step``
    (MEGAFIXED_PAUSE), each writing its own file: the fault lands mid-run however fast the steps are."""
    spec = f"train.step@{step}" + "".join(f":{k}={v}" for k, v in where.items())
    return pause_env(spec, Path(f"{run_dir}.paused.{step}.{{rank}}"))


def paused_ranks(cluster, job, run_dir, step: int, ranks=range(4)) -> list[Path]:
    """Until ``ranks`` of the job are stopped before ``step`` (see ``pause_at``); their files, to release them."""
    files = [Path(f"{run_dir}.paused.{step}.{r}") for r in ranks]

    def gone():
        state = cluster.job_state(job).get("JobState")
        return f"{state}: {job_log(run_dir, job)[-4000:]}" if state not in ("PENDING", "RUNNING") else None
    for f in files:
        wait_paused(f, gone)
    return files


def release(files: list[Path]) -> None:
    for f in files:
        f.unlink()


def latest(run_dir) -> Path:
    return Path(run_dir) / "checkpoints" / (Path(run_dir) / "checkpoints" / "latest").read_text().strip()


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[-1])


def resumes(cluster, run_dir, job, ckpt: Path) -> None:
    """The job resumed from ``ckpt`` (the last checkpoint of the job before it: it loaded)."""
    wait_for_text(run_dir, job, "resumed from ", cluster)
    assert f"resumed from {ckpt} (step {step_of(ckpt)}," in job_log(run_dir, job), job_log(run_dir, job)[-3000:]


# The jobs that need no interaction (node1+node3), and the first job of the faults' run (node1+node2, held
# at its TaskProlog until its test starts), are submitted together; each test then waits for its own.
SIDE_JOBS = {
    "nostart": dict(per_node=1, env={"MEGAFIXED_RDZV_TIMEOUT": "15"}),
    "interrupted": dict(per_node=1, env={"MEGAFIXED_RDZV_TIMEOUT": "600"}),  # until its test sends TERM
    "otherrev": dict(per_node=1),
    "dp": dict(),
    # TP pairs (0,1), (2,3) and PP pairs (0,2), (1,3) (topology.py's order) each span the two nodes
    "tppp": dict(extra=("parallel.tp=2", "parallel.pp=2"), layout=("node1", "node3", "node3", "node1")),
    # rank 1 (node3) never enters step 4: exit 76, requeued once by the job script, resumes from checkpoint 2,
    # hangs again, ends. Step 4, not 3: the first step after a resume gets parallel.collective_timeout_s.
    "hang": dict(per_node=1, extra=(f"watchdog.timeout_s={HANG_TIMEOUT}", "faults.inject=hang@4:rank=1"),
                 env={"MEGAFIXED_MAX_REQUEUES": "1"}),
}


@pytest.fixture(scope="module")
def passive(cluster, inputs, reference_run, shrink_reference_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("passive")
    cluster.stall("node3", "nostart")
    cluster.stall("node3", "interrupted")
    other = root / "other-revision"
    shutil.copytree(ROOT / "megafixed", other / "megafixed", ignore=shutil.ignore_patterns("__pycache__", "bundled"))
    (other / "megafixed" / "bundled").symlink_to(ROOT / "megafixed" / "bundled")
    with open(other / "megafixed" / "launch" / "head.py", "a") as f:
        f.write("# another revision of megafixed\n")
    cluster.other_code("node3", "otherrev", str(other))
    todo = {}
    for name, how in SIDE_JOBS.items():
        env = dict(how.get("env", {}))
        if "layout" in how:
            hostfile = root / f"{name}.hosts"
            hostfile.write_text("\n".join(how["layout"]) + "\n")
            env.update(SLURM_DISTRIBUTION="arbitrary", SLURM_HOSTFILE=str(hostfile))
        todo[root / name] = (how.get("extra", ()), dict(per_node=how.get("per_node", 2), env=env, partition=SIDE))
    chain = root / "chain"
    for node in ("node1", "node2"):
        cluster.stall(node, chain.name)
    todo[chain] = ((), {"env": pause_at(chain, 4)})  # every rank stops before step 4 (3 logged, checkpoint 2)
    ids = submit_all(cluster, inputs, todo)
    return {run_dir.name: (ids[run_dir], run_dir) for run_dir in todo}


@pytest.fixture(scope="module")
def dp_straight(cluster, passive):
    """The uninterrupted 2 x 2 DP job: the bit-exact reference of the interrupted run."""
    job, run_dir = passive["dp"]
    finished(cluster, job, run_dir)
    return losses(run_dir), job_log(run_dir, job)


# --- 5: a node that never starts its task, a node with other code (first: their timing is measured live) ---

def test_a_node_that_never_starts_its_task_is_named_within_the_rendezvous_timeout(cluster, passive):
    job, run_dir = passive["nostart"]
    started = wait_for_text(run_dir, job, "rank 0 of 2 on node1: rendezvous at", cluster)
    refused = wait_for_text(run_dir, job, "\nerror:", cluster)
    assert refused - started < 15 + 45  # the rendezvous timeout of this job, not the default 120 s (+ a loaded machine)
    # srun ends the step (--kill-on-bad-exit), the stalled task with it: the job's exit code is rank 0's
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=180)
    cluster.stall("node3", "nostart", on=False)
    log = job_log(run_dir, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("2:"), log[-3000:]
    assert "error: rendezvous timed out after 15s at MASTER_ADDR=" in log
    assert "1 of 2 ranks never arrived: rank 1 on node node3 (Slurm's task layout); arrived: ranks 0 on node1" in log
    assert errors(log) == 1 and "start 1," not in log  # refused once: no retry, no requeue
    assert not losses(run_dir)


def test_sigterm_during_the_rendezvous_ends_the_rank_at_once(cluster, passive):
    job, run_dir = passive["interrupted"]
    wait_for_text(run_dir, job, "rank 0 of 2 on node1: rendezvous at", cluster)
    cluster.run("scancel", "--signal=TERM", job)  # to the job's tasks, as scancel/preemption would
    t0 = time.time()
    seen = wait_for_text(run_dir, job, "megafixed: SIGTERM during the rendezvous (rank 0 of 2): exiting now", cluster)
    cluster.stall("node3", "interrupted", on=False)
    assert seen - t0 < 60  # at once, not after its 600 s wait (generous: a dozen ranks share 2 cores)
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120)
    assert info["JobState"] == "FAILED" and not losses(run_dir), job_log(run_dir, job)[-3000:]


def test_a_node_running_another_megafixed_revision_is_refused_naming_it(cluster, passive):
    job, run_dir = passive["otherrev"]
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=180)
    log = job_log(run_dir, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("2:"), log[-3000:]
    assert re.search(r"error: the ranks run different code \(ranks 0 on node1: megafixed \S+ code \w+, torch \S+; "
                     r"ranks 1 on node3: megafixed \S+ code \w+, torch \S+\); "
                     r"node3 runs other code than rank 0 \(node1\)", log), log[-3000:]
    assert errors(log) == 1 and not losses(run_dir)


# --- 4 and 3: one run directory, four jobs: killed ranks, a cut link, the pre-timeout signal, requeue ---

def test_a_node_whose_ranks_are_killed_is_named_and_its_last_checkpoint_stays_loadable(cluster, passive):
    job, run_dir = passive["chain"]
    for node in ("node1", "node2"):
        cluster.stall(node, run_dir.name, on=False)  # the job's tasks start now
    files = paused_ranks(cluster, job, run_dir, 4)
    killed = cluster.signal_job(job, signal.SIGKILL, ["node2"])
    release(files[:2])  # node1's ranks 0 and 1 go on into step 4, to meet the dead
    t0 = time.time()
    seen = wait_for_text(run_dir, job, "error: lost", cluster, timeout=120)
    info = finished(cluster, job, run_dir, state="FAILED")
    log = job_log(run_dir, job)
    assert len(killed) == 2 and info["JobState"] == "FAILED"  # srun ends with 1, or 137 if it force-kills
    line = next(ln for ln in log.splitlines() if ln.startswith("error: lost"))
    assert line.startswith(f"error: lost ranks 2-3 on node2 ({cluster.addr('node2')}): 2 of 4 ranks answered"), line
    assert f"The last checkpoint, {latest(run_dir)}, is intact" in line
    assert errors(log) == 1 and "Traceback" not in log
    # the killed ranks' sockets close at once: named after the survivors' roll call, not any timeout (the
    # collectives' is 120 s; the bound is generous for a dozen ranks on 2 cores)
    assert seen - t0 < ROLL_CALL_S + 60
    print(f"dead ranks: named {seen - t0:.1f}s after the kill")
    # the next test's job resumes from that checkpoint (it loads), and the run's losses end up identical


def test_a_node_whose_link_is_cut_is_named_within_the_collective_timeout_and_slurm_requeues_the_job(
        cluster, inputs, passive):
    _, run_dir = passive["chain"]
    before = latest(run_dir)
    cut_at = step_of(before) + 4  # a checkpoint of its own first
    job = submit(cluster, inputs, run_dir, collective_timeout=CUT_TIMEOUT, env=pause_at(run_dir, cut_at))
    resumes(cluster, run_dir, job, before)  # resubmitted after the killed ranks
    files = paused_ranks(cluster, job, run_dir, cut_at)
    cluster.link("node2", up=False)
    try:
        release(files)  # every rank goes on into the step, and node1's wait for node2's in silence
        t0 = time.time()
        seen = wait_for_text(run_dir, job, "error: lost", cluster, timeout=CUT_TIMEOUT + 120)
        # Slurm itself notices the silent node (SlurmdTimeout) and requeues the job (#SBATCH --requeue)
        info = cluster.wait_for(job, {"PENDING", "COMPLETED", "FAILED"}, timeout=120)
        requeued = time.time()
        # Cancelled, and resubmitted by the next test once node2 is back: its slurmd still holds the old run of
        # this job id (a real node returning from a failure has rebooted) and would kill a rerun under that id.
        cluster.run("scancel", job, check=False)
    finally:
        cluster.link("node2", up=True)
    log = job_log(run_dir, job)
    line = next(ln for ln in log.splitlines() if ln.startswith("error: lost"))
    assert line.startswith(f"error: lost ranks 2-3 on node2 ({cluster.addr('node2')}): 2 of 4 ranks answered"), line
    assert f"collectives wait at most parallel.collective_timeout_s={CUT_TIMEOUT}s" in line
    assert f"The last checkpoint, {latest(run_dir)}, is intact" in line and step_of(latest(run_dir)) > step_of(before)
    # the run's bound (a silent peer: no socket error), then the roll call; not torch's 30 minutes (the upper
    # bound is generous for a dozen ranks on 2 cores)
    assert CUT_TIMEOUT - 5 < seen - t0 < CUT_TIMEOUT + ROLL_CALL_S + 30
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", log[-3000:]
    print(f"cut link: named {seen - t0:.1f}s after the cut; job requeued by Slurm {requeued - t0:.1f}s after it")
    # the node comes back (an admin resumes it once the link is repaired)
    cluster.run("scontrol", "update", "nodename=node2", "state=resume", check=False)
    deadline = time.time() + 90
    while time.time() < deadline and cluster.task_pids("node2", job):  # the cut-off ranks time out and exit
        time.sleep(0.2)
    cluster.wait_idle(nodes=["node2"])


def test_usr1_stops_every_rank_at_one_step_checkpoints_once_requeues_and_finishes_identically(
        cluster, inputs, passive, dp_straight):
    _, run_dir = passive["chain"]
    before = latest(run_dir)
    job = submit(cluster, inputs, run_dir, env=pause_at(run_dir, step_of(before) + 3))  # after the cut link
    resumes(cluster, run_dir, job, before)
    paused_ranks(cluster, job, run_dir, step_of(before) + 3)  # each goes on when the signal reaches it
    # held (a running job runs on): its requeue then stays pending until released, however late the test looks
    cluster.run("scontrol", "hold", job)
    cluster.run("scancel", "--signal=USR1", "--batch", job)  # the batch shell forwards it to srun, srun to every rank
    stop = time.time()
    info = cluster.wait_for(job, {"PENDING", "COMPLETED", "FAILED"})
    first = job_log(run_dir, job)
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", first[-4000:]
    stopped_at = max(losses(run_dir))
    assert step_of(before) < stopped_at < STEPS
    # every rank stopped at that step: one "stopped" line, and one checkpoint holding all 4 ranks' files
    assert first.count(f"stopped: {stopped_at} steps") == 1 and "requeueing job" in first
    ckpt = run_dir / "checkpoints" / f"step_{stopped_at:08d}"
    assert len(list(ckpt.glob("zero_pp_rank_*_optim_states.pt"))) == 4, sorted(p.name for p in ckpt.iterdir())
    assert (ckpt / "manifest.json").exists()  # committed: every rank reported its files
    periodic = {f"step_{s:08d}" for s in range(2, stopped_at + 1, 2)}
    kept = set(sorted(periodic | {ckpt.name})[-2:])  # checkpoint.keep=2 (the default) rotates older ones out
    assert {p.name for p in (run_dir / "checkpoints").glob("step_*")} == kept
    cluster.run("scontrol", "release", job)
    info = finished(cluster, job, run_dir)
    log = job_log(run_dir, job)
    assert f"resumed from {ckpt}" in log and "start 1," in log
    restart = re.search(r"start 1, (\S+):", log).group(1)  # the requeued job's own start line (1 s resolution)
    restarted = datetime.datetime.strptime(restart, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    print(f"requeue: the job restarted {restarted.timestamp() - stop:.0f}s after its stop and finished "
          f"{time.time() - stop:.0f}s after it")
    # four jobs, three faults, each resuming from the last checkpoint of the one before: the uninterrupted losses
    assert losses(run_dir) == dp_straight[0]  # bit-identical, CPU fp32


# --- 1 + 2: layouts across nodes, and the rendezvous address ---

def test_dp_across_two_nodes_matches_one_process_and_meets_at_the_head_nodes_address(cluster, reference,
                                                                                     dp_straight):
    got, log = dp_straight
    assert_same_losses(got, reference, "dp=4 on 2 nodes")
    assert "micro 2 x accum 1 x dp 4, tp 1, pp 1" in log
    # node1's own name maps to 127.0.1.1 (Debian's /etc/hosts); megafixed.launch.head fell back to the
    # address of the route towards node3, and every rank met there
    assert "127.0.1.1 node1" in (cluster.root / "hosts-node1").read_text()
    master = re.search(r"master (\S+):(\d+) \((\S+)\)", log)
    assert master and master.groups()[::2] == (cluster.addr("node1"), "node1"), log[-3000:]
    for rank, node in ((0, "node1"), (2, "node3")):
        assert f"rank {rank} of 4 on {node}: rendezvous at {cluster.addr('node1')}:{master.group(2)}" in log
    assert "127.0.0.1:" not in log and "127.0.1.1:" not in log
    # gloo would have bound to 127.0.1.1 too (it uses the hostname's address): pinned to the node's interface
    assert "node3 resolves to loopback; gloo uses eth0 (GLOO_SOCKET_IFNAME)" in log


@pytest.mark.parametrize("groups, pairs", [
    ("tp", ((0, 1), (2, 3))),  # each TP pair on two nodes
    ("pp", ((0, 2), (1, 3))),  # each pipeline (stage 0 -> stage 1) on two nodes
])
def test_tp_and_pp_across_nodes_match_one_process(cluster, reference, passive, groups, pairs):
    job, run_dir = passive["tppp"]
    finished(cluster, job, run_dir)
    log = job_log(run_dir, job)
    assert "micro 2 x accum 4 x dp 1, tp 2, pp 2" in log
    where = cluster.task_nodes(job)
    assert where == {0: "node1", 1: "node3", 2: "node3", 3: "node1"}, where
    for a, b in pairs:
        assert where[a] != where[b], (groups, a, b, where)
    assert_same_losses(losses(run_dir), reference, f"tp 2 x pp 2 across 2 nodes ({groups} groups span them)")


# --- resilience on the cluster: a hang named with its host; a job that loses a node goes on with fewer ---

def test_a_hang_exits_76_names_the_rank_and_its_host_and_requeues_up_to_the_limit(cluster, passive):
    job, run_dir = passive["hang"]
    info = finished(cluster, job, run_dir, state="FAILED", timeout=300)
    log = job_log(run_dir, job)
    # Slurm's view: the batch script's exit code is the ranks' 76 (not srun's kill of the last ones)
    assert info["ExitCode"] == f"{exit_codes.HUNG}:0" and info["Restarts"] == "1", log[-4000:]
    # the job script saw 76 both times: requeued the first (restart 1 of MEGAFIXED_MAX_REQUEUES=1), not the second
    assert log.count(f"ended with exit code {exit_codes.HUNG}") == 2, log[-4000:]
    assert log.count(f"a step hung; requeueing job {job} (restart 1 of 1,") == 1, log[-4000:]
    assert "start 1," in log and f"resumed from {run_dir / 'checkpoints' / 'step_00000002'}" in log
    named = [ln for ln in log.splitlines() if f"no step completed within {HANG_TIMEOUT}s" in ln]
    assert len(named) == 2 and all("rank 1 on node3 never reached step 4" in ln for ln in named), log[-4000:]
    stacks = sorted(p.name for p in (run_dir / "faults").glob("hang.step00000004.rank*.txt"))
    assert stacks == ["hang.step00000004.rank00000.node1.txt", "hang.step00000004.rank00001.node3.txt"], stacks
    assert "before_step" in (run_dir / "faults" / stacks[1]).read_text()  # where rank 1 hangs
    assert latest(run_dir).name == "step_00000002" and max(losses(run_dir)) == 3


def test_transient_faults_on_a_node_resubmit_the_job_without_it_and_it_finishes_elsewhere(cluster, inputs, reference,
                                                                                         tmp_path):
    """``nan@3:once:rank=1`` with ``guard.max_transient_faults=1``: rank 1's NaN is gone when step 3 is computed
    again (a transient fault), so the run trains on, names rank 1 and its node, saves and exits 77; the job script
    submits itself again with that node excluded, and the new job resumes on the two other nodes and finishes with
    the one-process losses."""
    run_dir = tmp_path / "transient"
    cluster.wait_idle()
    job = submit(cluster, inputs, run_dir, "guard.max_transient_faults=1", "faults.inject=nan@3:once:rank=1",
                 per_node=1, partition=ALL)
    info = finished(cluster, job, run_dir, state="FAILED")
    log = job_log(run_dir, job)
    bad = cluster.task_nodes(job)[1]
    assert info["ExitCode"] == f"{exit_codes.EXCLUDE_NODE}:0", log[-4000:]
    assert "transient fault at step 3: the loss is nan (non-finite)" in log and f"rank 1 on {bad}." in log, log[-4000:]
    assert (run_dir / "faults" / "exclude_nodes.txt").read_text() == f"{bad}\n"
    found = re.search(rf"megafixed: transient faults on {bad}; resubmitted as job (\d+) without them", log)
    assert found, log[-4000:]
    after = found.group(1)
    info = finished(cluster, after, run_dir)
    assert info["ExcNodeList"] == bad and bad not in set(cluster.task_nodes(after).values()), info
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000003'} (step 3," in job_log(run_dir, after)
    assert_same_losses(losses(run_dir), reference, "dp 2: a transient fault, then on two other nodes")
    cluster.wait_idle()


def test_a_dp_job_that_loses_its_head_node_is_requeued_on_two_nodes_and_goes_on_with_the_same_losses(
        cluster, inputs, shrink_reference_run, tmp_path):
    """3 nodes x 1 rank (dp 3, ``--nodes 2-3``); node1 (the head: rank 0, the batch shell, the run lock) loses its
    ranks to SIGKILL and is declared down (what SlurmdTimeout does 45 s later, or a node health check); Slurm
    requeues the job onto node2 + node3, which resumes with dp 2 and the same global batch. The job starts on
    3 nodes at all only because a node range renders no ``--ntasks-per-node`` (sbatch would cap it at MIN)."""
    run_dir = tmp_path / "shrink"
    cluster.wait_idle()  # a node still completing the last job: Slurm would start this one on 2 of 3
    # node1's rank (rank 0) stops before step 6, past checkpoint 4 (the others wait for it in that step); the
    # requeued job, without node1, never does
    job = submit(cluster, inputs, run_dir, SHRINK_BATCH, nodes="2-3", per_node=1, partition=ALL,
                 env=pause_at(run_dir, 6, host="node1"))
    try:
        wait_for_text(run_dir, job, " node(s) x 1 ranks", cluster)
        assert re.search(r"start 0, \S+: 3 node\(s\)", job_log(run_dir, job)), job_log(run_dir, job)[:300]
        paused_ranks(cluster, job, run_dir, 6, ranks=[0])
        pids = cluster.signal_job(job, signal.SIGSTOP)
        assert len(pids) == 3 and max(losses(run_dir)) < STEPS, (pids, job_log(run_dir, job)[:600])
        before = latest(run_dir)
        # The whole node is lost at once: its batch shell and srun stop with its rank, so neither can end the job
        # (srun's --kill-on-bad-exit, then the script's exit 137: FAILED, no requeue) before Slurm hears the node
        # is down -- on a loaded machine they had outrun the two scontrol calls below.
        frozen = cluster.signal_job(job, signal.SIGSTOP, ["node1"], ranks_only=False)
        killed = cluster.signal_job(job, signal.SIGKILL, ["node1"])
        # Drained first: node1's slurmd still answers here (a lost node's does not), and ReturnToService=2 would
        # put a node that is only down back in service at its next registration, before the requeued job starts.
        cluster.run("scontrol", "update", "nodename=node1", "state=drain", "reason=lost_in_a_test")
        cluster.run("scontrol", "update", "nodename=node1", "state=down", "reason=lost_in_a_test")
        assert len(frozen) > len(killed), frozen  # the batch shell and srun were among them
        t0 = time.time()
        cluster.signal_job(job, signal.SIGCONT, ["node2", "node3"])
        resumes(cluster, run_dir, job, before)
        info = finished(cluster, job, run_dir)
        print(f"lost head node: the job resumed on 2 nodes and finished {time.time() - t0:.0f}s after the loss")
    finally:
        cluster.run("scontrol", "update", "nodename=node1", "state=resume", check=False)
    log = job_log(run_dir, job)
    assert len(killed) == 1 and info["Restarts"] == "1", log[-4000:]
    starts = re.findall(r"start (\d), \S+: (\d) node\(s\) x 1 ranks, master \S+ \((\w+)\)", log)
    assert starts == [("0", "3", "node1"), ("1", "2", "node2")], log[-4000:]
    assert "micro 2 x accum 2 x dp 3" in log and "micro 2 x accum 3 x dp 2" in log
    shrank = [ln for ln in log.splitlines() if ln.startswith("the job shrank")]
    assert shrank == [f"the job shrank: checkpoint {before.name} was written by 3 ranks on 3 nodes (dp 3), this run "
                      f"has 2 on 2 nodes (dp 2); the global batch 12 is kept by accumulating 3 micro batches per "
                      f"step"], log[-4000:]
    # the lost head's rank 0 left the run lock behind: taken over at once (an earlier start of this job), no wait
    took = [ln for ln in log.splitlines() if ln.startswith("took over the run directory lock")]
    assert len(took) == 1 and f"Slurm job {job}, since " in took[0] and \
        took[0].endswith(f": left by an earlier run of Slurm job {job})"), log[-4000:]
    record = json.loads((latest(run_dir) / "run.json").read_text())
    assert latest(run_dir).name == f"step_{STEPS:08d}" and record["nodes"] == 2 and record["layout"]["dp"] == 2
    assert record["shrunk_from"] == {"world": 3, "dp": 3, "nodes": 3}, record
    # every step, dp 3 before the loss and dp 2 after it, within 1e-5 of one process with the same global batch
    proc, ref_root = shrink_reference_run
    assert proc.wait(timeout=120) == 0, (ref_root / "out.log").read_text()[-3000:]
    assert_same_losses(losses(run_dir), losses(ref_root / "run"), "dp 3 on 3 nodes, then dp 2 on 2 (head lost)")
    cluster.wait_idle()


def test_a_node_range_whose_minimum_would_split_a_tp_pair_is_refused_at_submit_in_one_line(inputs, tmp_path):
    """With one rank per node every TP pair spans two nodes: losing one would split a pair (no cluster needed)."""
    cfg, prefix = inputs
    refused = subprocess.Popen([sys.executable, "-m", "megafixed.cli", "submit", cfg, "--nodes", "2-4",
                                "--gpus-per-node", "1", "--cpu", "--dry-run",
                                *tiny_overrides(prefix, tmp_path / "tp", *COMMON, "parallel.tp=2")],
                               cwd=ROOT, env=_one_process_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    _, err = refused.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert refused.returncode == exit_codes.BAD_INPUT and len(lines) == 1, err
    assert lines[0].startswith("error: --nodes 2-4: on 3 node(s) (3 ranks) this run cannot go on") and \
        "raise the minimum to 4" in lines[0], lines[0]
