"""The planner: which layouts of a run fit N GPUs, how fast each could step, and which one to run.

Beside the memory and traffic models it ranks (``megafixed.parallel.memory``, ``.traffic``), above the
run plan (each candidate layout must build one) and the engine registry (each engine's ``Planner``
does its sharding arithmetic). ``megafixed plan`` (``commands/plan.py``) only parses and prints:

* ``rows``: every candidate layout whose run plan builds, each a ``PlanRow`` (its memory estimate and
  the fields beside it), in rank order; ``parse_bytes`` reads ``--gpu-mem``;
* ``bound``: the analytic traffic and the step-time lower bound of a row;
* ``rank``: the order, ``--pick K`` and a row as the overrides a run takes;
* ``fake``: ``--fake``, one real step per row under fake tensors, in a process of its own;
* ``best``: ``submit --layout best``, row 1 for the job's GPUs.
"""
