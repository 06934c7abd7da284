"""Move model weights between parallel layouts: gather any (TP, PP) DeepSpeed checkpoint into a
plain GPT state dict, and shard a plain state dict into any layout's DeepSpeed file set.

Two re-layout mechanisms, each for its own job (``universal.py`` is the other):
* this converter moves **weights only**, offline: ``megafixed convert``, ``train.init_from``, HF export and
  import, and every reader that needs a plain state dict. It works for any layout and ZeRO stage and needs
  nothing recorded at save time: our split rule is one table (``tensor.sharded_dim``: TP_PLAN column
  weights on dim 0, row weights on dim 1, vocabulary rows of the table and the head on dim 0) and the
  pipeline layer order is fixed (``pipeline.pipe_key_to_gpt``), so gathering is a few lines, checked
  exactly by the tests;
* a **resume** on another layout keeps the optimizer state (fp32 master weights, Adam's moments), which
  lives in ZeRO's flat partitions: that is DeepSpeed's universal checkpoint (``ds_to_universal`` +
  ``load_universal``), fed the same split rule as ``universal_checkpoint_info``.

What moves: the model weights (and the fixed code's buffers, so a code mismatch is still caught on
load). What does not: optimizer state -- a converted checkpoint is loaded with DeepSpeed's
``load_module_only=True`` (Adam moments restart). Within one layout, resume through DeepSpeed's
own save/load is bit-exact.

File layout read and written (DeepSpeed 0.19, one tag directory):
  no PP:  mp_rank_{tp:02d}_model_states.pt  {'module': state dict, ...}
  PP:     layer_{idx:02d}-model_{tp:02d}-model_states.pt  (one layer's state dict)
          + mp_rank_{k:02d}_model_states.pt  (module None; k = pp_rank * tp + tp_rank)
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from ...atomic import atomic_write_text
from ...parallel.pipeline import gpt_key_to_pipe, pipe_key_to_gpt
from ...parallel.tensor import sharded_dim
from ...run.run_dir import LATEST, PLAIN_TAG_RE, latest_problem
from ...trust.errors import UntrustedCheckpoint
from ...trust.pickles import load_weights
from ..base import ConvertError  # noqa: F401  -- engine-agnostic: every engine's reader raises it
from .file_names import MODEL_FILES

_LAYER_RE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")
_MP_RE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")
_ZERO3_RE = re.compile(r"zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$")  # weights live in optim files
# The model files (weights; not the optimizer partitions): what a weights-only reader must verify.
MODEL_FILE_RE = re.compile(MODEL_FILES)


def model_file(mp_rank: int) -> str:
    """The model-states file of model-parallel rank ``mp_rank`` (``pp_rank * tp + tp_rank``)."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def is_zero3(tag_dir: Path) -> bool:
    """ZeRO-3 keeps the weights in every rank's partition files, not in the model files."""
    return any(tag_dir.glob("zero_pp_rank_*_mp_rank_*_model_states.pt")) and \
        not any(tag_dir.glob("mp_rank_*_model_states.pt"))


def read_zero3_state_dict(tag_dir: Path) -> dict:
    """A ZeRO-3 checkpoint's full fp32 state dict, by DeepSpeed's own ``zero_to_fp32`` reader."""
    if any(tag_dir.glob("zero_pp_rank_*_mp_rank_01_model_states.pt")):
        raise ConvertError(f"{tag_dir} is a ZeRO-3 checkpoint with tensor parallelism, which this loader "
                           f"does not gather; resume it on its own layout with zero.stage=3 instead")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return dict(get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name))


def resolve_tag_dir(ckpt: str | os.PathLike, tag: str | None = None) -> Path:
    """``ckpt`` may be a tag directory, or a checkpoint root with a ``latest`` file or ``tag``."""
    root = Path(ckpt)
    if not root.exists():
        raise ConvertError(f"checkpoint {root} not found; pass a run's checkpoints directory or one of its tag "
                           f"directories (e.g. runs/NAME/checkpoints)")
    if not root.is_dir():
        raise ConvertError(f"checkpoint {root} is a file; pass the checkpoint directory (or its tag directory)")
    if tag:
        if not (root / tag).is_dir():
            raise ConvertError(f"--tag {tag}: no directory {root / tag}; tags there: {_tags(root) or 'none'}")
        return root / tag
    if any(_MP_RE.match(p.name) or _ZERO3_RE.match(p.name) for p in root.iterdir()):
        return root
    latest = root / LATEST
    if latest.exists():
        name = latest.read_text(errors="replace").strip()
        if not name:
            raise ConvertError(f"{latest} is empty (a save was interrupted); pick a tag with --tag "
                               f"(tags there: {_tags(root) or 'none'})")
        why = latest_problem(root, name, PLAIN_TAG_RE)
        if why:
            raise ConvertError(f"{latest} {why}; the checkpoint pointer is damaged: pick a tag with --tag (tags "
                               f"there: {_tags(root) or 'none'})")
        if not (root / name).is_dir():
            raise ConvertError(f"{latest} points to '{name}', which does not exist under {root}; pick a tag with "
                               f"--tag (tags there: {_tags(root) or 'none'})")
        return root / name
    raise ConvertError(f"{root} holds no mp_rank_*_model_states.pt and no 'latest' file; pass the tag "
                       f"directory itself or --tag")


def _tags(root: Path) -> str:
    return ", ".join(sorted(p.name for p in root.iterdir() if p.is_dir()))


def _load(path: Path) -> dict:
    if not path.is_file():
        raise ConvertError(f"{path} is missing; the checkpoint is incomplete: convert another tag with --tag")
    try:
        return load_weights(path, map_location="cpu")
    except UntrustedCheckpoint:
        raise
    except Exception as exc:  # zip reader / unpickler on a truncated or overwritten file
        raise ConvertError(f"{path} cannot be read ({str(exc).splitlines()[0]}); the checkpoint is corrupt or "
                           f"was cut short: convert an earlier tag with --tag") from exc


def detect_layout(tag_dir: Path) -> tuple[int, int]:
    """(tp, pp) of a checkpoint, from its file names."""
    layers = [_LAYER_RE.match(p.name) for p in tag_dir.iterdir()]
    layers = [m for m in layers if m]
    mp = [m for m in (_MP_RE.match(p.name) for p in tag_dir.iterdir()) if m]
    if not mp:
        if any(_ZERO3_RE.match(p.name) for p in tag_dir.iterdir()):
            raise ConvertError(f"{tag_dir} is a ZeRO stage 3 checkpoint (its weights are partitioned into the "
                               f"optimizer files); gather them first with DeepSpeed's zero_to_fp32.py (saved in the "
                               f"checkpoints directory)")
        raise ConvertError(f"{tag_dir} is not a DeepSpeed checkpoint (no mp_rank_*_model_states.pt)")
    if layers:
        tp = len({int(m.group(2)) for m in layers})
        return tp, len(mp) // tp
    return len(mp), 1


def recorded_model_config(tag_dir: Path) -> dict | None:
    """The ``model`` section the trainer saved with the checkpoint (client state ``config``), if any."""
    first = tag_dir / "mp_rank_00_model_states.pt"
    if not first.is_file():
        return None
    try:
        state = load_weights(first, map_location="cpu", mmap=True)
    except UntrustedCheckpoint:
        raise
    except Exception:
        state = _load(first)
    cfg = state.get("config") if isinstance(state, dict) else None
    return cfg.get("model") if isinstance(cfg, dict) else None


def check_target_layout(sd: dict, tp: int, pp: int, model: dict | None = None) -> None:
    """Refuse a layout the trainer would refuse: whole heads per TP rank, a block per stage, and
    every split dimension divisible by ``tp``. Without the recorded ``model`` config only the
    tensor shapes are checked."""
    for name, value in (("--tp", tp), ("--pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ConvertError(f"{name} {value} must be >= 1")
    if model:
        heads = model.get("n_heads")
        kv = model.get("n_kv_heads") or heads
        if heads and heads % tp:
            raise ConvertError(f"--tp {tp} does not divide the model's {heads} attention heads (model.n_heads); "
                               f"each tensor-parallel rank needs whole heads: use a --tp that divides {heads}")
        if kv and kv % tp:
            raise ConvertError(f"--tp {tp} does not divide the model's {kv} key/value heads (model.n_kv_heads); "
                               f"use a --tp that divides {kv}")
    n_blocks = _n_blocks(sd)
    if n_blocks < pp:
        raise ConvertError(f"--pp {pp}: the model has {n_blocks} blocks, fewer than {pp} pipeline stages; "
                           f"use --pp <= {n_blocks}")
    for key, value in sd.items():
        dim = sharded_dim(key)
        if dim is not None and tp > 1 and value.shape[dim] % tp:
            raise ConvertError(f"--tp {tp}: {key} has {value.shape[dim]} rows on dim {dim}, not divisible by {tp}; "
                               f"use a --tp that divides it")


def _strip(sd: dict) -> dict:
    # megatron's layers add an empty `_extra_state` entry (None) per Linear; not a weight.
    return {k: v for k, v in sd.items() if not k.endswith("_extra_state")}


def _merge_tp(shards: list[dict]) -> dict:
    out = {}
    for key in shards[0]:
        dim = sharded_dim(key)
        if dim is None or len(shards) == 1:
            out[key] = shards[0][key]
        else:
            out[key] = torch.cat([s[key] for s in shards], dim=dim)
    return out


def gather_state_dict(ckpt: str | os.PathLike, tag: str | None = None, verify: bool = True) -> dict:
    """A plain ``GPT`` state dict (full tensors, GPT key names) from a checkpoint of any layout and
    ZeRO stage. The files it reads are checked against the checkpoint's manifest first (``verify=
    False``: the caller already did): the model files, or under ZeRO-3 every rank's partitions."""
    tag_dir = resolve_tag_dir(ckpt, tag)
    zero3 = is_zero3(tag_dir)
    unverified: list = []  # the no-manifest warning (another tool's checkpoint), said once it has been read
    if verify:
        from ...run.manifest import verify_for_reading
        only = None if zero3 else lambda name: bool(MODEL_FILE_RE.match(name))
        verify_for_reading(tag_dir, only=only, warn=unverified.append)
    sd = read_zero3_state_dict(tag_dir) if zero3 else _gather(tag_dir)
    if unverified:
        from ...run.manifest import warn
        warn(unverified[0])
    return sd


def _gather(tag_dir: Path) -> dict:
    tp, pp = detect_layout(tag_dir)
    if pp == 1:
        shards = []
        for r in range(tp):
            module = _load(tag_dir / f"mp_rank_{r:02d}_model_states.pt").get("module")
            if not module:
                raise ConvertError(f"{tag_dir}: mp_rank_{r:02d} holds no module weights (a ZeRO-3 checkpoint "
                                   f"keeps them in its optimizer shards); convert it with DeepSpeed's "
                                   f"zero_to_fp32.py first")
            shards.append(_strip(module))
        return _merge_tp(shards)
    n_layer_files = max(int(_LAYER_RE.match(p.name).group(1)) for p in tag_dir.iterdir()
                        if _LAYER_RE.match(p.name)) + 1
    n_blocks = n_layer_files - 2
    out = {}
    for idx in range(n_layer_files):
        shards = [_strip(_load(tag_dir / f"layer_{idx:02d}-model_{r:02d}-model_states.pt")) for r in range(tp)]
        shards = [{pipe_key_to_gpt(idx, k, n_blocks): v for k, v in s.items()} for s in shards]
        out.update(_merge_tp(shards))
    return out


def _shard_tp(sd: dict, tp: int, rank: int) -> dict:
    out = {}
    for key, value in sd.items():
        dim = sharded_dim(key)
        if dim is None or tp == 1:
            out[key] = value.clone()
        else:
            if value.shape[dim] % tp:
                raise ConvertError(f"{key} has {value.shape[dim]} rows on dim {dim}, not divisible by tp={tp}")
            out[key] = value.chunk(tp, dim=dim)[rank].clone()
    return out


def _n_blocks(sd: dict) -> int:
    return 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))


def shard_state_dict(sd: dict, tp: int, pp: int) -> dict[str, dict]:
    """File name -> payload of a module-only DeepSpeed checkpoint for layout (tp, pp)."""
    n_blocks = _n_blocks(sd)
    if n_blocks < pp:
        raise ConvertError(f"{n_blocks} blocks cannot fill {pp} pipeline stages")
    common = {"dp_world_size": 1, "mp_world_size": tp * pp, "global_steps": 0, "global_samples": 0,
              "skipped_steps": 0, "buffer_names": [], "optimizer": None, "lr_scheduler": None,
              "converted_by": "megafixed.engine.deepspeed.convert"}
    files: dict[str, dict] = {}
    for r in range(tp):
        local = _shard_tp(sd, tp, r)
        if pp == 1:
            files[f"mp_rank_{r:02d}_model_states.pt"] = {"module": local, **common}
            continue
        per_layer: dict[int, dict] = {}
        for key, value in local.items():
            idx, pkey = gpt_key_to_pipe(key, n_blocks)
            per_layer.setdefault(idx, {})[pkey] = value
        for idx in range(n_blocks + 2):
            files[f"layer_{idx:02d}-model_{r:02d}-model_states.pt"] = per_layer.get(idx, {})
    if pp > 1:
        for k in range(tp * pp):
            files[f"mp_rank_{k:02d}_model_states.pt"] = {"module": None, **common}
    return files


def write_checkpoint(sd: dict, out: str | os.PathLike, tp: int, pp: int, tag: str = "converted",
                     run_record: dict | None = None, meta: dict | None = None) -> Path:
    """Write ``sd`` as a module-only DeepSpeed checkpoint for (tp, pp) under ``out/tag`` and point
    ``out/latest`` at it. Load it with ``engine.load_checkpoint(out, load_module_only=True)``.

    Like a trainer checkpoint it gets a ``manifest.json`` (``meta`` + every file's size and sha256)
    and, given ``run_record``, a ``run.json``, so every reader verifies it. The tag is written under
    a temporary name and renamed into place, so files of an earlier conversion to another layout (an
    extra ``mp_rank_03``) never mix with the new ones, and a crash never leaves a half tag."""
    from ...run import manifest
    from ...run.run_record import write_run_record

    check_target_layout(sd, tp, pp)
    files = shard_state_dict(sd, tp, pp)
    tag_dir = Path(out) / tag
    tmp_dir = Path(out) / f".{tag}.tmp.{os.getpid()}"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    try:
        for name, payload in files.items():
            torch.save(payload, tmp_dir / name)
        if run_record is not None:
            write_run_record(tmp_dir, run_record)
        records = {p.name: manifest.record_existing(p) for p in sorted(tmp_dir.iterdir()) if p.is_file()}
        base = {"format": manifest.FORMAT, "layout": {"tp": tp, "pp": pp, "dp": 1, "zero_stage": 0},
                "git_revision": manifest.git_revision()}
        manifest.write(tmp_dir, {**base, **(meta or {})}, records, tag=tag)
        if tag_dir.exists():
            shutil.rmtree(tag_dir)
        os.replace(tmp_dir, tag_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    atomic_write_text(Path(out) / LATEST, tag + "\n")
    return tag_dir
