"""``train.init_from``: start a new run from another checkpoint's weights (module only, step 0).

The source may be any megafixed run or the output of ``megafixed import hf``, in any TP/PP layout.
Its weights are gathered into a plain state dict (``trained_state_dict``, the one loading path)
and handed to the engine (``Engine.load_weights``), which lays them out for *this* run (the
DeepSpeed engine: a module-only checkpoint in a scratch folder of the run directory, loaded with
``load_module_only=True`` so that its fp32/ZeRO master copies follow). Adam moments, the step and
the data position start from zero.
"""
from __future__ import annotations

from ..config import ConfigError
from ..run.run_dir import RunDirectory
from .config_diff import config_diff, resolved

# Model fields that may differ between the source and the new run: they change no parameter.
FREE_MODEL_KEYS = ("dropout", "init_std", "max_seq_len", "fused_first_layer")


def check_compatible(source_model: dict, model_cfg) -> None:
    diff = config_diff(resolved({"model": source_model}), resolved({"model": model_cfg.__dict__}))
    keys = [k.split(".", 1)[1] for k in diff if k.startswith("model.")]
    keys = [k for k in keys if k not in FREE_MODEL_KEYS]
    if keys:
        k = keys[0]
        old, new = diff[f"model.{k}"]
        raise ConfigError(f"train.init_from: model.{k} is {new!r} here but {old!r} in the source "
                          f"checkpoint" + (f" (also {', '.join('model.' + d for d in keys[1:4])})" if keys[1:] else "")
                          + "; set model.* to the source's values (its config.yaml records them)")


def load_initial_weights(engine, cfg, topo) -> str:
    """Load ``cfg.train.init_from`` into ``engine``; returns a line for the log."""
    from ..trust.owner import check_run_dir
    from .evaluate import trained_state_dict
    from .run_source import resolve_run

    check_run_dir(cfg.train.init_from, trusted=cfg.train.trust_run_dir, flag="train.trust_run_dir=true")
    src = resolve_run(cfg.train.init_from)
    check_compatible(src.config.model.__dict__, cfg.model)
    # Rank 0 reads (and so verifies) the source before any engine work; the engine asks for it there.
    state = trained_state_dict(RunDirectory(src.run_dir).checkpoints, src.tag) if topo.is_main else None

    def read():  # other ranks read only if the engine asks them to (the torch engine's pipeline stages)
        return state if topo.is_main else trained_state_dict(RunDirectory(src.run_dir).checkpoints, src.tag)

    try:
        engine.load_weights(read, RunDirectory(cfg.train.run_dir).init_scratch())
    except ConfigError as exc:
        raise ConfigError(f"train.init_from {src.tag_dir}: {exc}") from None
    return f"initialised from {src.tag_dir} (weights only; step 0, fresh optimizer state)"
