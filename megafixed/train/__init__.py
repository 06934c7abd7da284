"""Training on one node with DeepSpeed.

* ``trainer.train(cfg)`` -- the loop: resume, step, log, validate, save (``megafixed train``).
* ``step.train_step / eval_loss`` -- the one place that dispatches plain vs pipeline engines.
* ``checkpoint`` -- DeepSpeed shards + our atomic ``latest`` pointer, RNG capture, pruning.
* ``evaluate.evaluate_loss / load_trained_model`` -- reusable evaluation.
* ``schedule.LRSchedule``, ``optim.build_optimizer``, ``ds_config.batch_layout / deepspeed_config``,
  ``metrics.MetricsLog``, ``env.prepare_runtime_env`` (call before importing deepspeed).

Nothing is imported here so that ``import megafixed.train.schedule`` stays light.
"""
