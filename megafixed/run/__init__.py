"""What a run keeps on disk, and the optimizer it steps: the layer beneath the engines.

* ``run_dir.RunDirectory`` -- every file name of a run; ``run_lock`` (one trainer per run directory);
* ``run_record`` -- the layout a checkpoint was written under; ``manifest`` -- sizes and hashes, verified
  before a checkpoint is used; ``save_faults`` -- a failed save named (full disk, read-only, lost rank);
  ``checkpoint_error.CheckpointError``;
* ``optim`` -- the AdamW the engines wrap (``SkippableAdamW``), and its parameter groups.

The engines (``megafixed.engine``) and the trainer (``megafixed.train``) both use these; nothing here
imports an engine or the trainer, so the engines never reach up into ``train/``.
Nothing is imported here so that importing one module stays light.
"""
