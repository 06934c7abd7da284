"""The torch engine's checkpoint format, as the engine registry asks for it (``megafixed.engines.
CheckpointFormat``): a DCP checkpoint (its ``.metadata`` index and one shard file per rank, whatever the
layout), so its layout and model config come from the run record, and it needs no re-layout format.
Imports DCP only when a reader is called."""
from __future__ import annotations

from pathlib import Path


def read_state_dict(tag_dir, *, verify: bool = True) -> dict:
    from .reader import read_state_dict as read

    return read(Path(tag_dir), verify=verify)


def weights_in_every_rank_file(tag_dir) -> bool:
    from .checkpoint import weights_in_every_rank_file as every

    return every(Path(tag_dir))


def _recorded(tag_dir) -> dict:
    from ...run.run_record import read_run_record

    return read_run_record(Path(tag_dir)) or {}


def detect_layout(tag_dir) -> tuple[int, int]:
    """(tp, pp) from its run record (its DCP files are one per rank whatever the layout)."""
    lay = _recorded(tag_dir).get("layout") or {}
    return int(lay.get("tp", 1)), int(lay.get("pp", 1))


def recorded_model_config(tag_dir):
    return (_recorded(tag_dir).get("config") or {}).get("model")


def to_relayout_format(tag_dir, model_cfg, out=None, log=print):
    from ..base import ConvertError

    raise ConvertError(f"{tag_dir} is a torch-engine (train.engine=torch) checkpoint, which already loads on "
                       f"any DP/TP layout with its optimizer state (DCP reshards it on load): rerun "
                       f"`megafixed train` on the new layout; --universal is for DeepSpeed checkpoints")
