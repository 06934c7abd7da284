"""Rank and world detection, checked before the rendezvous; the rendezvous; an agreement check after it.

Three launchers are understood, in this order:

* ``torchrun`` / the ``deepspeed`` launcher: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (+ ``MASTER_ADDR``/``PORT``).
* a plain ``srun`` task (one task per GPU): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; only
  inside a job *step* (``SLURM_STEP_ID`` set). The batch shell of ``sbatch -n 8`` also has
  ``SLURM_NTASKS=8`` and ``SLURM_PROCID=0``; reading those there would make one process wait forever
  for seven ranks that were never started.
* nothing: one process.

Why the checks: the failures users report from multi-node launches are a 10-30 minute hang at the
first collective, or every node training alone. Each case that the environment already reveals is
refused here in seconds, naming the variable: a loopback master on a job spanning several nodes, a
world size that disagrees with the job (``MEGAFIXED_EXPECTED_WORLD``, set by the sbatch script to
nodes x GPUs, or the srun step's task count), torchrun agents that each formed their own world.
The rendezvous (``rendezvous.py``) waits ``MEGAFIXED_RDZV_TIMEOUT`` seconds (default 120) instead of
torch's 30 minutes and says what to check. After it, the ranks compare notes (``check_agreement``): same Slurm job, same
master, and as many nodes as the step has -- so several separate worlds can never train.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

from .. import env as env_vars
from .errors import LaunchError  # also re-exported: the other launch modules import it from here

RDZV_TIMEOUT_S = 120


@dataclass(frozen=True)
class World:
    size: int
    rank: int
    local_rank: int
    source: str  # "single" | "torchrun" | "launcher" (deepspeed/others setting RANK) | "srun"
    nnodes: Optional[int] = None  # nodes of the srun step (or torchrun's node count); None: unknown
    local_size: Optional[int] = None  # ranks on this node, when the launcher says


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    return _as_int(name, env.get(name))


def _as_int(name: str, value: Optional[str]) -> Optional[int]:
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer; unset it or fix the launcher that sets it") from None


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """True in a task that ``srun`` started (not in the batch shell, which has no step id)."""
    return env.get("SLURM_STEP_ID", env.get("SLURM_STEPID")) not in (None, "")


def detect_world(env: Optional[Mapping[str, str]] = None) -> World:
    """(size, rank, local rank, source) of this process; raises LaunchError on a half-set environment."""
    env = os.environ if env is None else env
    step = in_slurm_step(env)
    nnodes = _int(env, "SLURM_STEP_NUM_NODES") if step else None
    have = [k for k in ("RANK", "WORLD_SIZE") if env.get(k) not in (None, "")]
    if len(have) == 1:
        other = "WORLD_SIZE" if have[0] == "RANK" else "RANK"
        raise LaunchError(f"{have[0]} is set but {other} is not: a launcher sets both. Unset {have[0]} to run one "
                          f"process, or launch with torchrun, the deepspeed launcher or srun")
    if have:
        size, rank = _int(env, "WORLD_SIZE"), _int(env, "RANK")
        local = _int(env, "LOCAL_RANK")
        if local is None:
            if size > 1:
                raise LaunchError(f"RANK={rank} and WORLD_SIZE={size} are set but LOCAL_RANK is not, so this rank "
                                  f"cannot know its GPU; set LOCAL_RANK (torchrun and deepspeed do)")
            local = 0
        source = "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "launcher"
        if nnodes is None and source == "torchrun":
            nnodes = _int(env, "GROUP_WORLD_SIZE")  # torchrun: the number of agents (nodes)
        world = World(size, rank, local, source, nnodes, _int(env, "LOCAL_WORLD_SIZE"))
    elif step and _int(env, "SLURM_NTASKS") is not None:
        world = World(_int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID") or 0, _int(env, "SLURM_LOCALID") or 0,
                      "srun", nnodes)
    else:
        world = World(1, 0, 0, "single")
    if world.size < 1 or not 0 <= world.rank < world.size or world.local_rank < 0:
        raise LaunchError(f"rank {world.rank} of world size {world.size} (local rank {world.local_rank}, from "
                          f"{world.source}) is impossible; check the launcher's variables")
    return world


def _multi_node(world: World) -> bool:
    if world.nnodes is not None:
        return world.nnodes > 1
    return world.local_size is not None and world.size > world.local_size


def check_world(world: World, env: Optional[Mapping[str, str]] = None) -> None:
    """Refuse an environment that could only hang or split into several worlds (no network needed)."""
    env = os.environ if env is None else env
    expected = _as_int("MEGAFIXED_EXPECTED_WORLD", env_vars.expected_world(env))
    if expected is not None and world.size != expected:
        raise LaunchError(f"this rank sees a world of {world.size} ranks (from {world.source}) but the job asked for "
                          f"{expected} (MEGAFIXED_EXPECTED_WORLD = nodes x GPUs per node, set by the job script): "
                          f"check srun's --nodes/--ntasks-per-node, or variables such as SLURM_NTASKS_PER_NODE or "
                          f"WORLD_SIZE exported into the job")
    tasks = _int(env, "SLURM_NTASKS") if in_slurm_step(env) else None
    if tasks is not None and world.source == "torchrun" and world.local_size:
        if world.size != tasks * world.local_size:
            raise LaunchError(f"WORLD_SIZE={world.size}, but this srun step runs {tasks} torchrun agents x "
                              f"LOCAL_WORLD_SIZE={world.local_size} = {tasks * world.local_size} ranks: the agents "
                              f"did not form one world (torchrun --standalone, or a different --rdzv-endpoint per "
                              f"node). Give every node the same --nnodes $SLURM_NNODES and --rdzv-endpoint "
                              f"$HEAD:$PORT")
    elif tasks is not None and tasks > 1 and world.source == "launcher" and world.size != tasks:
        raise LaunchError(f"WORLD_SIZE={world.size} disagrees with the srun step's SLURM_NTASKS={tasks}; unset "
                          f"RANK/WORLD_SIZE inside srun (megafixed reads SLURM_PROCID/SLURM_NTASKS itself)")
    addr = env.get("MASTER_ADDR")
    if world.size > 1 and _multi_node(world) and addr:
        # head is imported where used (no cycle: it imports only .errors): the package imports this
        # module, and `python -m megafixed.launch.head` must not find head already imported (runpy).
        from .head import addresses, is_loopback
        if all(is_loopback(a) for a in addresses(addr)):
            raise LaunchError(f"MASTER_ADDR={addr} is a loopback address but this world of {world.size} ranks spans "
                              f"{world.nnodes or 'several'} nodes: ranks on other nodes would connect to themselves. "
                              f"Set MASTER_ADDR to the head node's address on the cluster network (`python -m "
                              f"megafixed.launch.head $(scontrol show hostnames $SLURM_JOB_NODELIST | head -1) "
                              f"--nodes $SLURM_JOB_NUM_NODES` prints it)")


def job_port(job_id: int) -> int:
    """A port all ranks of a Slurm job derive alike; different jobs sharing a head node get different ones."""
    return 20000 + job_id % 20000


def set_master_env(world: World, env=None) -> None:
    """Make sure MASTER_ADDR/MASTER_PORT exist: a single process picks a free loopback port; srun tasks
    without them derive the head (first node of the step) and a per-job port, identically on every rank."""
    env = os.environ if env is None else env
    if world.size == 1 and "MASTER_ADDR" not in env:
        # A lone process meets itself on a free loopback port (init_process_group), which is not
        # written to the environment: a child process (another run, a test's subprocess) would
        # inherit it and try to listen on a port this process holds.
        env.setdefault("WORLD_SIZE", "1")
        env.setdefault("RANK", "0")
        env.setdefault("LOCAL_RANK", str(world.local_rank))  # DeepSpeed's engine reads LOCAL_RANK
        return
    if world.source == "srun" and "MASTER_ADDR" not in env:
        from .head import expand_nodelist, reachable_address
        hosts = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        env["MASTER_ADDR"] = reachable_address(hosts[0], len(hosts), hosts[1] if len(hosts) > 1 else None)
    if world.source == "srun" and not env.get("MASTER_PORT"):
        env["MASTER_PORT"] = str(job_port(_int(env, "SLURM_JOB_ID") or 0))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise LaunchError(f"{' and '.join(missing)} not set for a world of {world.size} ranks (from {world.source}); "
                          f"the launcher must set them (torchrun and deepspeed do)")
    env.setdefault("WORLD_SIZE", str(world.size))
    env.setdefault("RANK", str(world.rank))
    env.setdefault("LOCAL_RANK", str(world.local_rank))


def check_agreement(world: World, env: Optional[Mapping[str, str]] = None) -> None:
    """After the rendezvous: every rank must belong to the same Slurm job, name the same master and,
    under srun, the world must cover every node of the step (else nodes train as separate worlds)."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    if world.size == 1 or not dist.is_initialized():
        return
    mine = {"host": socket.gethostname(), "master": f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}",
            "job": env.get("SLURM_JOB_ID"), "nnodes": world.nnodes}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for key, what, fix in (
            ("job", "Slurm job", "two jobs met at the same head node and port: give each job its own MASTER_PORT "
                                 "(the submit script derives it from the job id)"),
            ("master", "master", "every rank must get the same MASTER_ADDR/MASTER_PORT: compute them once in the "
                                 "batch script and export them before srun")):
        groups: dict = {}
        for rank, info in enumerate(everyone):
            groups.setdefault(info[key], []).append(rank)
        if len(groups) > 1:
            seen = "; ".join(f"ranks {ranges(r)}: {v}" for v, r in groups.items())
            raise LaunchError(f"the ranks of this world disagree on the {what} ({seen}); {fix}")
    hosts = {info["host"] for info in everyone}
    if world.nnodes and len(hosts) < world.nnodes:
        raise LaunchError(f"this world of {world.size} ranks spans {len(hosts)} of the step's {world.nnodes} nodes "
                          f"({', '.join(sorted(hosts))}): the other nodes are training as separate worlds. Give every "
                          f"node the same MASTER_ADDR/MASTER_PORT (or torchrun --rdzv-endpoint) and --nnodes")


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": rank lists in one line of an error."""
    if not ranks:
        return "none"
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)

