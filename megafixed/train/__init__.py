"""Training, on any number of nodes, through the engine seam (``megafixed.engine``).

* ``trainer.train(cfg, topo, callbacks=[...])`` (also ``megafixed.train.train``) -- the loop
  (``megafixed train``): resume, step, save, calling its callbacks' hooks.
* ``callbacks`` -- every other concern of a run, each with its own state and config section: the drills,
  validation, the hang watchdog, stragglers, the bad-step guard, W&B, the metrics log and progress lines,
  the evidence of a failed run, and the user's own (``callbacks.base.Callback``).
* ``checkpoint.Checkpointer`` -- the engine-agnostic commit protocol (markers, sizes, run record,
  manifest, atomic ``latest``, rotation, RNG), the resume point and its cadence; ``resume`` (the
  config check). The files it writes (``run_dir``, ``run_record``, ``manifest``) are ``megafixed.run``'s.
* ``validation.Validator`` (the pass the validation callback runs), ``stop`` (the stop request).
* ``evaluate.evaluate_loss / load_trained_model`` -- reusable evaluation.
* ``schedule.LRSchedule``, ``metrics``; the optimizer is ``megafixed.run.optim``.

The engine itself is whichever registered engine the plan names (``megafixed.engines``: DeepSpeed,
the default, or the torch-native one), reached through ``megafixed.engine``; nothing here imports
DeepSpeed or tests an engine's name.
Nothing is imported here so that ``import megafixed.train.schedule`` stays light.
"""


def __getattr__(name: str):
    """``megafixed.train.train(cfg, topo, callbacks=[...])``, imported when first asked for."""
    if name == "train":
        from .trainer import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
