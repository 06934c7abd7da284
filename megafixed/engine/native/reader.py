"""Reading a torch-native engine checkpoint in one process, without a process group.

``megafixed eval``, ``export hf``, ``convert``, ``ckpt inspect`` and ``train.init_from`` need the
full plain-GPT state dict of a checkpoint, whatever DP/FSDP/TP layout wrote it. DCP reassembles
it: a template of full-size tensors for every ``model.*`` entry of the checkpoint's ``.metadata``
is loaded with ``dcp.load(..., no_dist=True)`` (DCP's own single-process path: it reads each
chunk from whichever rank's file holds it), so no shard arithmetic of ours is involved. The
optimizer entries are not read (a reader of weights needs none of them).

Imports no engine library beyond torch, and only when called: the dispatch in
``megafixed.engine`` asks ``is_native_checkpoint`` of every checkpoint it reads.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from ..base import ConvertError
from .checkpoint import CLIENT_STATE, METADATA, MODEL, is_native_checkpoint  # noqa: F401


def _metadata(tag_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(tag_dir))
    try:
        return reader, reader.read_metadata()
    except Exception as exc:  # a truncated or foreign .metadata
        raise ConvertError(f"{tag_dir / METADATA} cannot be read ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                           f"the checkpoint is damaged: read an earlier tag") from None


def model_shapes(tag_dir) -> dict:
    """Plain-GPT name -> (shape, dtype) of every model tensor, from the index alone (no tensor read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _, md = _metadata(Path(tag_dir))
    prefix = MODEL + "."
    return {fqn[len(prefix):]: (tuple(m.size), m.properties.dtype) for fqn, m in md.state_dict_metadata.items()
            if fqn.startswith(prefix) and isinstance(m, TensorStorageMetadata)}


def read_state_dict(tag_dir, *, verify: bool = True) -> dict:
    """The full plain-GPT state dict (names as ``GPT(cfg).state_dict()``) of a native checkpoint.
    ``verify``: check every file against the manifest first (the caller may have done it)."""
    import torch
    import torch.distributed.checkpoint as dcp

    tag_dir = Path(tag_dir)
    if verify:
        from ...run.manifest import verify_for_reading

        verify_for_reading(tag_dir)
    reader, _ = _metadata(tag_dir)
    shapes = model_shapes(tag_dir)
    if not shapes:
        raise ConvertError(f"{tag_dir} holds no model weights (its {METADATA} lists no '{MODEL}.*' tensor)")
    template = {f"{MODEL}.{k}": torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
    from .checkpoint import dcp_errors, root_cause

    try:
        with warnings.catch_warnings():  # DCP says it assumes one process: that is the point here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(template, storage_reader=reader, no_dist=True)
    except dcp_errors() as exc:
        cause = root_cause(exc)
        said = str(cause).splitlines()[0] if str(cause) else repr(cause)
        raise ConvertError(f"{tag_dir}: cannot read its weights ({said}); the checkpoint is incomplete or "
                           f"corrupt: read an earlier tag") from None
    prefix = len(MODEL) + 1
    return {k[prefix:]: v for k, v in template.items()}
