"""The DeepSpeed engine's checkpoint format, as the engine registry asks for it (``megafixed.engines.
CheckpointFormat``): the files of ``convert.py`` (module files per TP/PP rank, ZeRO partitions) and
DeepSpeed's universal checkpoint as the re-layout format. The default engine: its format is what no
other engine's marker file claims (``EngineFacts.checkpoint_marker``)."""
from __future__ import annotations

from pathlib import Path

from .convert import detect_layout, is_zero3, recorded_model_config  # noqa: F401


def read_state_dict(tag_dir, *, verify: bool = True) -> dict:
    from .convert import gather_state_dict

    return gather_state_dict(Path(tag_dir), verify=verify)


def weights_in_every_rank_file(tag_dir) -> bool:
    return is_zero3(Path(tag_dir))  # ZeRO-3 keeps the weights in every rank's partition files


def to_relayout_format(tag_dir, model_cfg, out=None, log=print):
    from .universal import to_universal

    return to_universal(tag_dir, model_cfg, out=out, log=log)
