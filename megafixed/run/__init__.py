"""The layer beneath the engines: what a run keeps on disk, the optimizer it steps, and the faults a step
can be given.

* ``run_dir.RunDirectory`` -- every file name of a run; ``run_lock`` (one trainer per run directory);
* ``run_record`` -- the layout a checkpoint was written under; ``manifest`` -- sizes and hashes, verified
  before a checkpoint is used; ``save_faults`` -- a failed save named (full disk, read-only, lost rank);
  ``checkpoint_error.CheckpointError``;
* ``optim`` -- the AdamW the engines wrap (``SkippableAdamW``), and its parameter groups;
* ``faults`` -- faults injected by the config key ``faults.inject`` (NaN, spike, hang, straggler, a dead rank), for the
  tests and a user's drill.

The engines (``megafixed.engine``) and the trainer (``megafixed.train``) both use these; nothing here
imports an engine or the trainer, so the engines never reach up into ``train/``. The bad-step guard (its
verdicts, re-check, rollbacks and skipped steps) is the trainer's, one callback: ``train/callbacks/guard/``.
Nothing is imported here so that importing one module stays light.
"""
