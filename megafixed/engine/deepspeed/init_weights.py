"""Initial weights for a new run (``train.init_from``), loaded the DeepSpeed way.

The full plain-GPT state dict (read on rank 0) is re-sharded for *this* run's layout
(``convert.write_checkpoint``) into a scratch folder in the run directory (every rank reads it,
as they read checkpoints), and loaded with DeepSpeed's ``load_module_only=True``: DeepSpeed then
refreshes its fp32/ZeRO master copies from the loaded weights, which a plain ``load_state_dict``
into the wrapped module would not. Adam moments, the step and the data position start from zero.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from ...config import ConfigError
from ...trust.pickles import load_weights
from ..common import key_mismatch
from ..dtypes import restore_exact_buffers
from .convert import model_file, write_checkpoint

TAG = "init"


def load_module_only(engine, read_state_dict: Callable[[], dict], scratch: Path) -> None:
    topo = engine.topo
    if topo.is_main:
        sd = read_state_dict()
        shutil.rmtree(scratch, ignore_errors=True)
        write_checkpoint(sd, scratch, tp=topo.tp, pp=topo.pp, tag=TAG)
    if dist.is_initialized():
        dist.barrier()
    try:
        # Megatron's TP layers expect an (empty) `_extra_state` entry a converted checkpoint lacks;
        # strict loading would refuse it, so with TP the keys are compared here instead.
        strict = topo.tp == 1
        if not strict and topo.pp == 1:
            payload = load_weights(scratch / TAG / model_file(topo.tp_rank), map_location="cpu")["module"]
            why = key_mismatch((k for k in engine.module.state_dict() if not k.endswith("_extra_state")), payload)
            if why:
                raise ConfigError(why)
        path, _ = engine.ds.load_checkpoint(str(scratch), tag=TAG, load_module_only=True,
                                            load_optimizer_states=False, load_lr_scheduler_states=False,
                                            load_module_strict=strict)
        if path is None:
            raise ConfigError("DeepSpeed loaded nothing")
    finally:
        if dist.is_initialized():
            dist.barrier()
        if topo.is_main:
            shutil.rmtree(scratch, ignore_errors=True)
    restore_exact_buffers(engine.module)
