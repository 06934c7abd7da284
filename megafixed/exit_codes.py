"""One exit-code policy for every ``megafixed`` verb (``cli.main`` applies it).

Schedulers and wrappers branch on these, so they never change meaning:

* ``OK`` (0): the command did what was asked.
* ``FAILED`` (1): it ran and failed (e.g. the training loss became non-finite).
* ``BAD_INPUT`` (2): bad input -- a config key, a file, a flag, a layout (argparse uses 2 as well).
  Nothing the user had was changed. A run none of whose checkpoints verifies ends here too (one line
  naming each; nothing is moved aside then).
* ``STOPPED`` (75, ``EX_TEMPFAIL``): a stop was requested (a signal, a time limit); the run saved a
  checkpoint at a safe point and the same command resumes it. Slurm requeue logic keys on it.
* ``HUNG`` (76): no training step completed within ``watchdog.timeout_s``; every live rank wrote its
  Python stacks under ``<run_dir>/faults/`` and rank 0 named the ranks that did not reach the step.
  The last checkpoint is intact; the Slurm job script requeues the job (up to ``MEGAFIXED_MAX_REQUEUES``).
* ``EXCLUDE_NODE`` (77): ``guard.max_transient_faults`` transient faults on one node (a bad step whose
  recomputation was good: ``guard.recheck``); the run saved a checkpoint and named the node(s) in
  ``<run_dir>/faults/exclude_nodes.txt``. The Slurm job script resubmits the job without them (``--exclude``).
* ``INTERRUPTED`` (130, 128 + SIGINT as shells report it): Ctrl-C. ``train`` treats the first one like
  ``STOPPED`` (finishes the step, saves, the same command resumes) but exits 130 so that a script or a
  scheduler does not requeue what a person stopped; a second Ctrl-C aborts at once with 130 too.
"""
OK = 0
FAILED = 1
BAD_INPUT = 2
STOPPED = 75
HUNG = 76
EXCLUDE_NODE = 77
INTERRUPTED = 130
