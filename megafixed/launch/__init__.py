"""Launching training on a cluster: Slurm job scripts, rank/world detection, requeue.

* ``world.py``: who am I? (world size, rank, local rank) from torchrun, the deepspeed launcher or a
  plain ``srun`` task, checked for consistency *before* any rendezvous, and a post-init agreement
  check, so a bad environment fails in seconds.
* ``rendezvous.py``: the rendezvous itself: one wait bounded by ``MEGAFIXED_RDZV_TIMEOUT``, signals end it at
  once, missing ranks/nodes and nodes running other code named; then the process group, whose
  collectives wait at most ``parallel.collective_timeout_s``; a heartbeat per rank.
* ``lost.py``: a collective that failed because a node died becomes one line naming its ranks and node.
* ``head.py``: the head node's address that other nodes can reach (never loopback on several nodes);
  ``python -m megafixed.launch.head`` is what the sbatch script runs.
* ``sbatch.py``: renders ``templates/job.sbatch`` for ``megafixed submit`` and records submitted jobs.
"""
from .world import LaunchError, World, detect_world  # noqa: F401
