"""Resume on another layout through DeepSpeed's universal checkpoint.

Why DeepSpeed's and not a reshaper of ours: ``deepspeed.checkpoint.ds_to_universal`` already
gathers ZeRO-1/2 optimizer partitions (fp32 master weights, Adam's two moments, its step) of any
(TP, PP, DP) layout into one folder per parameter, and the engine's ``checkpoint.load_universal``
slices them again for whatever layout loads them. It needs two things from us:

* ``universal_checkpoint_info`` in the client state (``universal_info``): how each parameter is
  split under TP -- Megatron-DeepSpeed's pattern lists. Ours come from the one split rule,
  ``megafixed.parallel.tensor.sharded_dim``: column weights and biases on dim 0 (DeepSpeed's
  default), row weights on dim 1 (``PARAMETER_WITH_ROW_PARALLELISM_PATTERNS``), norms and row
  biases replicated (``TP_REPLICATED_PARAMETER_PATTERNS``), the table and the head split by
  vocabulary rows (``VOCABULARY_PARAMETER_PATTERNS``; our vocabulary is never padded). Patterns
  are the exact parameter names, so nothing matches by accident.
* parameter names that agree between the saving and the loading layout. A pipeline names its
  parameters by layer index (``3.block.attn.wq.weight``), a plain model by block
  (``blocks.2.attn.wq.weight``); ``to_universal`` links every parameter folder under both names
  (``megafixed.parallel.pipeline.gpt_key_to_pipe``), so one universal folder loads on any layout.

What it cannot cover, refused by ``unsupported`` before anything is touched: ZeRO stage 0 (its
optimizer state is torch's own ``state_dict`` in the model files, not ZeRO's flat partitions that
the converter reads) and stage 3 with a layout change (DeepSpeed's ZeRO-3 universal load does not
take our TP layers), a precision change, and checkpoints written before this info was recorded.

The universal folder is written once, by rank 0, to ``<tag>/universal`` (through a temporary name
and a rename), so a requeued job reuses it; it is pruned with its checkpoint.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch.distributed as dist

from ...run.run_dir import CheckpointError
from ...trust.pickles import load_weights

UNIVERSAL_DIR = "universal"  # inside the tag directory it was converted from
DONE = ".complete"


def gpt_param_names(model_cfg) -> list[str]:
    """Plain-GPT parameter names (tied weights once), without allocating anything."""
    from ...model.gpt import meta_gpt

    return [n for n, _ in meta_gpt(model_cfg).named_parameters()]


def layout_names(model_cfg, pp: int) -> dict[str, str]:
    """Plain-GPT name -> the name the engine of a layout with ``pp`` stages gives the parameter."""
    from ...parallel.pipeline import gpt_key_to_pipe

    names = gpt_param_names(model_cfg)
    if pp == 1:
        return {n: n for n in names}
    return {n: "{}.{}".format(*gpt_key_to_pipe(n, model_cfg.n_layers)) for n in names}


def universal_info(model_cfg, pp: int) -> dict:
    """``universal_checkpoint_info`` for the client state of a layout with ``pp`` stages."""
    from deepspeed.checkpoint import constants as C

    from ...parallel.tensor import is_vocab_parameter, sharded_dim

    row, replicated, vocab = [], [], []
    for gpt_name, name in layout_names(model_cfg, pp).items():
        exact = "^" + re.escape(name) + "$"
        dim = sharded_dim(gpt_name)
        if dim is None:
            replicated.append(exact)
        elif dim == 1:
            row.append(exact)
        if is_vocab_parameter(gpt_name):
            vocab.append(exact)
    return {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            C.ORIGINAL_VOCAB_SIZE: model_cfg.vocab_size,
            C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: row,
            C.TP_REPLICATED_PARAMETER_PATTERNS: replicated,
            C.VOCABULARY_PARAMETER_PATTERNS: vocab,
            C.PARAMETER_TO_AVERAGE_PATTERNS: [],
            C.PIPELINE_REPLICATED_PARAMETER_PATTERNS: []}


def client_state(model_cfg, pp: int) -> dict:
    """The entry every checkpoint's client state carries so that ds_to_universal can read it."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    return {UNIVERSAL_CHECKPOINT_INFO: universal_info(model_cfg, pp)}


def unsupported(old: dict, new: dict) -> Optional[str]:
    """Why a change from layout ``old`` to ``new`` (run-record layouts) cannot go through a
    universal checkpoint, or None when it can."""
    if old.get("precision") != new.get("precision"):
        return (f"train.precision changed ({old.get('precision')} -> {new.get('precision')}): the checkpoint's "
                f"optimizer keeps master weights for its own precision, and only same-precision universal "
                f"resumes are tested here")
    stages = {old.get("zero_stage"), new.get("zero_stage")}
    if 0 in stages:
        return ("zero.stage=0 keeps the optimizer state as torch's own state dict inside the model files, which "
                "DeepSpeed's universal checkpoint does not read or write; resume with zero.stage 1 or 2 on both sides")
    if 3 in stages:
        return ("zero.stage=3 checkpoints change layout only through DeepSpeed's ZeRO-3 universal path, which does "
                "not slice our tensor-parallel layers; keep zero.stage=3 on the same layout, or use zero.stage 1/2")
    return None


def universal_dir(tag_dir: Path) -> Path:
    return Path(tag_dir) / UNIVERSAL_DIR


def is_converted(tag_dir: Path) -> bool:
    return (universal_dir(tag_dir) / DONE).exists()


def to_universal(tag_dir: Path, model_cfg, out: Optional[Path] = None, log=print, verify: bool = True) -> Path:
    """Convert ``tag_dir`` (a DeepSpeed ZeRO-1/2 checkpoint with our client state) into a universal
    checkpoint at ``out`` (default ``<tag_dir>/universal``) that loads on any layout. Every file is
    checked against the manifest first (``verify=False``: the caller, the resume, already did)."""
    from deepspeed.checkpoint import constants as C
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    from ...run.manifest import verify_for_reading

    tag_dir, out = Path(tag_dir), Path(out) if out else universal_dir(tag_dir)
    if verify:
        verify_for_reading(tag_dir)
    first = tag_dir / "mp_rank_00_model_states.pt"
    if not first.exists():
        raise CheckpointError(f"{tag_dir} has no mp_rank_00_model_states.pt; it is not a ZeRO-1/2 DeepSpeed "
                              f"checkpoint that a universal checkpoint can be made from")
    head = load_weights(first, map_location="cpu", mmap=True)
    if C.UNIVERSAL_CHECKPOINT_INFO not in head:
        raise CheckpointError(f"{tag_dir} was written before megafixed recorded universal_checkpoint_info, so "
                              f"DeepSpeed cannot tell how its parameters are split; resume it once on its own layout "
                              f"(its next checkpoint carries the info), then change the layout")
    zero_stage = head.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0)
    if zero_stage not in (1, 2):
        raise CheckpointError(f"{tag_dir} was saved with zero.stage={zero_stage}; only ZeRO stage 1/2 checkpoints "
                              f"convert to a universal checkpoint (their optimizer state is partitioned the way "
                              f"ds_to_universal reads it)")
    del head
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    src = out.with_name(f".{out.name}.src.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    args = SimpleNamespace(input_folder=str(src), output_folder=str(tmp), num_extract_workers=1,
                           num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    chatter = io.StringIO()  # its progress prints and tqdm bars; shown only if it fails
    try:
        _source_view(tag_dir, src)
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal(args)
        _link_both_namings(tmp / "zero", model_cfg)
        (tmp / DONE).write_text("ds_to_universal\n")
        with contextlib.suppress(FileNotFoundError):  # it points a sibling 'latest_universal' at tmp
            (tmp.parent / "latest_universal").unlink()
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except AssertionError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"DeepSpeed's ds_to_universal could not convert {tag_dir}: {exc}. Its output: "
                              f"{chatter.getvalue()[-800:]}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(src, ignore_errors=True)
    log(f"converted {tag_dir} to a universal checkpoint in {out}")
    return out


def _source_view(tag_dir: Path, view: Path) -> None:
    """The checkpoint as ds_to_universal may read it: links to its DeepSpeed files, except model files
    whose module holds megatron-core's ``_extra_state`` entries (None, not tensors: the converter
    would call ``.float()`` on them), which are rewritten without them. The checkpoint itself is
    never modified."""
    import torch

    shutil.rmtree(view, ignore_errors=True)
    view.mkdir()
    for f in sorted(tag_dir.iterdir()):
        if not f.is_file() or not f.name.endswith(".pt"):
            continue
        if re.fullmatch(r"mp_rank_\d+_model_states\.pt", f.name):
            state = load_weights(f, map_location="cpu")
            module = state.get("module")
            if module and any(v is None for v in module.values()):
                state["module"] = type(module)((k, v) for k, v in module.items() if v is not None)
                torch.save(state, view / f.name)
                continue
        (view / f.name).symlink_to(f.resolve())


def _link_both_namings(zero: Path, model_cfg) -> None:
    """Make every parameter folder reachable under its plain-GPT name and its pipeline name."""
    pipe = layout_names(model_cfg, pp=2)  # any pp > 1 names by layer index alike
    for gpt_name, pipe_name in pipe.items():
        a, b = zero / gpt_name, zero / pipe_name
        if a.exists() and not b.exists():
            b.symlink_to(a.name)
        elif b.exists() and not a.exists():
            a.symlink_to(b.name)
        elif not a.exists():
            raise CheckpointError(f"the universal checkpoint in {zero.parent} has no state for parameter {gpt_name}")


def prepare(tag_dir: Path, model_cfg, is_main: bool, log=print) -> Path:
    """Rank 0 converts (once; a finished conversion is reused), every rank waits for it."""
    error = None
    if is_main and not is_converted(tag_dir):
        try:
            to_universal(tag_dir, model_cfg, log=log, verify=False)  # the resume verified it
        except Exception as exc:  # tell the other ranks instead of leaving them at the barrier
            error = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [repr(error) if error else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] and error is None:
            raise CheckpointError(f"rank 0 could not convert {tag_dir} to a universal checkpoint: {box[0]}")
    if error is not None:
        raise error
    return universal_dir(tag_dir)


def engine_config(ds_config: dict) -> dict:
    """The DeepSpeed config that makes ``load_checkpoint`` read a universal checkpoint."""
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
