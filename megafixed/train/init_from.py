"""``train.init_from``: start a new run from another checkpoint's weights (module only, step 0).

The source may be any megafixed run or the output of ``megafixed import hf``, in any TP/PP layout.
Its weights are gathered into a plain state dict (``trained_state_dict``, the one loading path),
re-sharded for *this* run's layout (``parallel.convert.write_checkpoint``) into a temporary folder
in the run directory (every rank reads it, as they read checkpoints), and loaded with DeepSpeed's
``load_module_only=True``: DeepSpeed then refreshes its fp32/ZeRO master copies from the loaded
weights, which a plain ``load_state_dict`` into the wrapped module would not. Adam moments, the
step and the data position start from zero.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from ..config import ConfigError

# Model fields that may differ between the source and the new run: they change no parameter.
FREE_MODEL_KEYS = ("dropout", "init_std", "max_seq_len", "fused_first_layer")


def check_compatible(source_model: dict, model_cfg) -> None:
    from ..config import config_from_dict, resolve_code

    new = resolve_code(config_from_dict({"model": model_cfg.__dict__})).model.__dict__
    old = resolve_code(config_from_dict({"model": source_model})).model.__dict__
    if old.get("code_rows") is not None and old.get("code_rows") == new.get("code_rows"):
        old = {k: v for k, v in old.items() if k not in ("code_seed", "code_affine")}
        new = {k: v for k, v in new.items() if k not in ("code_seed", "code_affine")}
    diff = [k for k in sorted(set(old) | set(new)) if k not in FREE_MODEL_KEYS and old.get(k) != new.get(k)]
    if diff:
        k = diff[0]
        raise ConfigError(f"train.init_from: model.{k} is {new.get(k)!r} here but {old.get(k)!r} in the source "
                          f"checkpoint" + (f" (also {', '.join('model.' + d for d in diff[1:4])})" if diff[1:] else "")
                          + "; set model.* to the source's values (its config.yaml records them)")


def load_initial_weights(engine, cfg, topo) -> str:
    """Load ``cfg.train.init_from`` into ``engine``; returns a line for the log."""
    from ..interop.run_source import resolve_run
    from ..parallel.convert import write_checkpoint
    from .evaluate import trained_state_dict

    src = resolve_run(cfg.train.init_from)
    check_compatible(src.config.model.__dict__, cfg.model)
    tmp = Path(cfg.train.run_dir) / ".init_from"
    if topo.is_main:
        sd = trained_state_dict(src.run_dir / "checkpoints", src.tag)
        shutil.rmtree(tmp, ignore_errors=True)
        write_checkpoint(sd, tmp, tp=topo.tp, pp=topo.pp, tag="init")
    if dist.is_initialized():
        dist.barrier()
    try:
        # Megatron's TP layers expect an (empty) `_extra_state` entry a converted checkpoint lacks;
        # strict loading would refuse it, so with TP the keys are compared here instead.
        strict = topo.tp == 1
        if not strict and topo.pp == 1:
            import torch
            payload = torch.load(tmp / "init" / f"mp_rank_{topo.tp_rank:02d}_model_states.pt", map_location="cpu",
                                 weights_only=False)["module"]
            want = {k for k in engine.module.state_dict() if not k.endswith("_extra_state")}
            if set(payload) != want:
                missing, extra = sorted(want - set(payload))[:4], sorted(set(payload) - want)[:4]
                raise ConfigError(f"train.init_from {src.tag_dir}: its weights do not fit this model "
                                  f"(missing {missing}, extra {extra})")
        path, _ = engine.load_checkpoint(str(tmp), tag="init", load_module_only=True, load_optimizer_states=False,
                                         load_lr_scheduler_states=False, load_module_strict=strict)
        if path is None:
            raise ConfigError(f"train.init_from {src.tag_dir}: DeepSpeed loaded nothing")
    finally:
        if dist.is_initialized():
            dist.barrier()
        if topo.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
    from .engine import restore_exact_buffers
    restore_exact_buffers(engine.module)
    return f"initialised from {src.tag_dir} (weights only; step 0, fresh optimizer state)"
