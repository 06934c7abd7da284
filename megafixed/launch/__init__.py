"""Launching training on a cluster: Slurm job scripts, rank/world detection, requeue.

* ``world.py``: who am I? (world size, rank, local rank) from torchrun, the deepspeed launcher or a
  plain ``srun`` task, checked for consistency *before* any rendezvous, and the rendezvous itself
  with a short timeout and a post-init agreement check, so a bad environment fails in seconds.
* ``head.py``: the head node's address that other nodes can reach (never loopback on several nodes);
  ``python -m megafixed.launch.head`` is what the sbatch script runs.
* ``sbatch.py``: renders ``templates/job.sbatch`` for ``megafixed submit`` and records submitted jobs.
"""
from .world import LaunchError, World, detect_world  # noqa: F401
