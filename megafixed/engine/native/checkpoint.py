"""Checkpoints of the torch-native engine: ``torch.distributed.checkpoint`` (DCP), sync or async.

What a tag directory holds (one DCP checkpoint, plus our client state):

- ``__<rank>_0.distcp``: each rank's shards of the model and the optimizer, written by DCP's
  ``FileSystemWriter`` (one file per rank); ``.metadata``: DCP's index of every tensor's chunks
  (written by rank 0 once every rank's file is written).
- ``client_state.pt``: the step, consumed samples, schedule, config and every rank's RNG state
  (the ``Checkpointer`` gathers them; identical on every rank, so rank 0 writes it).

The state dict is ``{"model": ..., "optim": ...}`` from ``torch.distributed.checkpoint.
state_dict.get_state_dict``: plain-GPT parameter names (FSDP2/DTensor, ``torch.compile`` and
activation-checkpoint wrappers are not in the names) and the optimizer state keyed by those names,
each tensor a DTensor of the layout that wrote it. Loading hands DCP templates of *this* layout
and DCP reshards on read (DCP's ``DefaultLoadPlanner``), so a checkpoint written on another DP,
FSDP or TP degree loads with its optimizer state; no conversion step (DeepSpeed's engine needs its
universal checkpoint for that).

Why the sizes and checksums come from our ``FileSystem``: the manifest (``run/manifest.py``)
records each file's sha256 computed from the bytes as they were written (no second read), which
is what the DeepSpeed engine's ``CheckpointWriter`` does for its files. DCP writes every file
through its ``FileSystem.create_stream``, sequentially (``tell``-based offsets, no seeks), so a
``FileSystem`` whose streams hash what passes through gives the records; ``.metadata`` is written
as ``.metadata.tmp`` and renamed, so the rename moves its record.

Async save (``checkpoint.async_save=true``): ``dcp.async_save`` stages a CPU copy of the state on the
training thread (``FileSystemWriter`` is DCP's blocking stager: training may change the weights as
soon as it returns), then writes from a background thread. That thread runs DCP's collectives
(plan gather, result gather) on a gloo group of its own, so they never interleave with the
training step's collectives on the default group. Once the files are written and fsynced, our own
thread hands the records to ``on_written`` (the ``Checkpointer``'s commit: markers, manifest,
``latest``); a failure (a full disk) goes through ``on_failed`` and is raised by the next
``wait``.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import threading
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...run.checkpoint_error import CheckpointError
from ...trust.pickles import load_weights
from ..common import BackgroundSave, corrupt_checkpoint_error, key_mismatch, misfit_checkpoint_error, one_line

CLIENT_STATE = "client_state.pt"
METADATA = ".metadata"  # DCP's index file (torch.distributed.checkpoint.filesystem._metadata_fn)
MODEL, OPTIM = "model", "optim"  # the top-level keys of the saved state dict


# ----------------------------------------------------------------------------------- file records
class _HashingStream(io.RawIOBase):
    """A write-only file that hashes and counts what passes through it (DCP writes sequentially,
    taking each item's offset from ``tell``)."""

    def __init__(self, fh):
        super().__init__()
        self.fh, self.h, self.n = fh, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.h.update(view)
        written = self.fh.write(view)
        self.n += written
        return written

    def tell(self) -> int:
        return self.n

    def fileno(self) -> int:
        return self.fh.fileno()

    def flush(self) -> None:
        if not self.fh.closed:  # IOBase.close flushes after ours closed the file
            self.fh.flush()

    def close(self) -> None:
        if not self.fh.closed:
            self.fh.flush()
            self.fh.close()
        super().close()


def _recording_filesystem():
    from torch.distributed.checkpoint.filesystem import FileSystem

    class RecordingFileSystem(FileSystem):
        """DCP's local ``FileSystem`` that records (size, sha256) of every file it writes."""

        def __init__(self):
            super().__init__()
            self.records: dict[str, dict] = {}
            self._lock = threading.Lock()  # DCP may write from several threads (thread_count)

        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            if "w" not in mode and "a" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with Path(path).open(mode) as fh:
                stream = _HashingStream(fh)
                yield stream
                stream.close()
            with self._lock:
                self.records[str(path)] = {"size": stream.n, "sha256": stream.h.hexdigest()}

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            with self._lock:
                if str(path) in self.records:
                    self.records[str(new_path)] = self.records.pop(str(path))

    return RecordingFileSystem()


def recording_writer(tag_dir: Path):
    """DCP's ``FileSystemWriter`` for ``tag_dir`` whose ``fs.records`` collect this rank's files."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(tag_dir), sync_files=True, overwrite=False)
    writer.fs = _recording_filesystem()
    return writer


def _hashed_save(obj, path: Path) -> dict:
    """``torch.save`` ``obj`` to ``path`` (fsynced); its file record."""
    with open(path, "wb") as fh:
        stream = _HashingStream(fh)
        torch.save(obj, stream)
        stream.flush()
        os.fsync(fh.fileno())
        n, digest = stream.n, stream.h.hexdigest()
    return {"size": n, "sha256": digest}


# ----------------------------------------------------------------------------------- errors
def dcp_errors() -> tuple:
    """What DCP raises: its ``CheckpointException`` is a ``BaseException`` (not an ``Exception``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def root_cause(exc: BaseException) -> BaseException:
    """DCP gathers every rank's exception into a ``CheckpointException`` (rank -> (exception,
    traceback)) without chaining them. The cause the fault namer (``run/save_faults.py``) must see
    is a filesystem error (a full disk's ``OSError``) wherever a rank hit one -- the other ranks may
    only see torch's zip writer fail -- else this rank's own, else the first."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return exc
    rank = dist.get_rank() if dist.is_initialized() else 0
    order = sorted(failures, key=lambda r: r != rank)
    errors = [failures[r][0] if isinstance(failures[r], tuple) else failures[r] for r in order]
    errors = [e for e in errors if isinstance(e, BaseException)]
    if not errors:
        return exc
    return next((e for e in errors if _filesystem_error(e)), errors[0])


def _filesystem_error(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _load_error(exc: BaseException, tag_dir: Path) -> CheckpointError:
    cause = root_cause(exc)
    if isinstance(cause, (OSError, EOFError)) or "unpickl" in str(cause).lower():
        return corrupt_checkpoint_error(tag_dir, one_line(cause, keep=1))
    return misfit_checkpoint_error(tag_dir, "torch.distributed.checkpoint", one_line(cause, keep=2))


# ----------------------------------------------------------------------------------- the format
def is_native_checkpoint(tag_dir) -> bool:
    """Written by the torch-native engine (a DCP checkpoint: its ``.metadata`` index)."""
    return (Path(tag_dir) / METADATA).is_file()


def weights_in_every_rank_file(tag_dir) -> bool:
    """Every rank's shard file holds weights (FSDP2 shards each parameter over the DP ranks), so a
    weights reader verifies them all, as for ZeRO-3."""
    return True


# ----------------------------------------------------------------------------------- re-layout
def relayout_refusal(old: dict, new: dict) -> Optional[str]:
    """Why a torch-engine checkpoint of layout ``old`` cannot load on ``new`` (run-record layouts),
    or None: another DP, FSDP (torch_engine.dp_replicate), TP or PP degree, pipeline schedule or vpp,
    or precision (the master weights and Adam moments are fp32 either way), is DCP's resharding on load."""
    engines = (old.get("engine") or "deepspeed", new.get("engine") or "deepspeed")
    if engines[0] != engines[1]:
        return (f"the checkpoint was written by train.engine={engines[0]}, whose files train.engine={engines[1]} "
                f"does not read; only its weights cross over (train.init_from)")
    # Another pipeline split, schedule or vpp too: parameter names are global (blocks.N) whatever the
    # stages, so each rank's DCP templates simply name fewer or more of them.
    return None


def _nested_param_groups(tag_dir: Path) -> bool:
    """Written with one ``param_groups`` list (before the flat optimizer state dict)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(str(tag_dir)).read_metadata().state_dict_metadata
    except Exception:  # unreadable: dcp.load names the damage
        return False
    return f"{OPTIM}.param_groups" in keys


# ----------------------------------------------------------------------------------- the checkpointer
class DcpCheckpoint(BackgroundSave):
    """One rank's DCP checkpoint files for a model (FSDP2/DTensor or plain) and its optimizer.

    The engine's ``save``/``load``/``load_weights``/``wait_for_saves``/``saved_bytes`` are these
    (``engine.py`` delegates); the commit protocol around them
    (markers, manifest, ``latest``, RNG) is the engine-agnostic ``train.checkpoint.Checkpointer``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, async_save: bool = False):
        self.model, self.optimizer = model, optimizer
        self.async_save = bool(async_save)
        self.handed_bytes = 0
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._async_group = None  # the gloo group background saves run their collectives on
        self.every_rank_reads = False  # load_weights: True for pipeline stages (pipeline_step.py)

    # ---- what the engine seam asks
    @property
    def saved_bytes(self) -> int:
        return self.handed_bytes

    def state_dict(self, flat: bool = True) -> dict:
        """``{"model": ..., "optim": ...}`` of this rank, plain-GPT names, DTensor values.

        ``flat``: the optimizer's param-group settings stored per parameter name
        (``flatten_optimizer_state_dict``, torchtitan's choice), not as one ``param_groups`` list:
        DCP keeps one copy of a non-tensor entry that every rank names alike, which is right for
        DP/TP ranks (the same groups) and wrong for pipeline stages (each rank's groups list other
        parameters). ``flat=False`` reads checkpoints written before."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer,
                                  options=StateDictOptions(flatten_optimizer_state_dict=flat))
        return {MODEL: msd, OPTIM: osd}

    def save(self, tag_dir: Path, client_state: dict, *, on_written: Callable[[dict], None],
             on_failed: Callable[[BaseException, bool], BaseException]) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save at a time (the Checkpointer waits too)
        tag_dir = Path(tag_dir)
        rank = dist.get_rank() if dist.is_initialized() else 0
        state = self.state_dict()
        from ...run.save_faults import tensor_bytes

        self.handed_bytes = tensor_bytes(state)
        tag_dir.mkdir(parents=True, exist_ok=True)
        own: dict = {}
        if rank == 0:
            own[str(tag_dir / CLIENT_STATE)] = _hashed_save(client_state, tag_dir / CLIENT_STATE)
        writer = recording_writer(tag_dir)
        if not self.async_save:
            try:
                dcp.save(state, storage_writer=writer)
            except dcp_errors() as exc:
                raise root_cause(exc) from exc
            on_written({**own, **writer.fs.records})
            return
        future = dcp.async_save(state, storage_writer=writer, process_group=self._group())
        del state  # the staged CPU copy is what is written; training may go on

        def finish():
            try:
                try:
                    future.result()
                except dcp_errors() as exc:
                    raise root_cause(exc) from exc
                on_written({**own, **writer.fs.records})
            except BaseException as exc:  # raised in the training thread by wait()
                self._error = on_failed(exc, True)

        self._thread = threading.Thread(target=finish, name="megafixed-dcp-save", daemon=True)
        self._thread.start()

    def _group(self):
        if not dist.is_initialized():
            return None
        if self._async_group is None:
            # A collective call on every rank; the first async save reaches it on every rank together.
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def load(self, tag_dir: Path, *, relayout: bool = False) -> dict:
        """Model and optimizer from ``tag_dir`` onto this layout (DCP reshards whatever layout wrote
        it, so ``relayout`` needs nothing extra); returns the client state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        tag_dir = Path(tag_dir)
        flat = not _nested_param_groups(tag_dir)
        state = self.state_dict(flat)  # this layout's templates (a fresh optimizer's moments initialised)
        try:
            dcp.load(state, checkpoint_id=str(tag_dir))
            set_state_dict(self.model, self.optimizer, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM],
                           options=StateDictOptions(flatten_optimizer_state_dict=flat))
            client = load_weights(tag_dir / CLIENT_STATE, map_location="cpu")
        except dcp_errors() as exc:
            raise _load_error(exc, tag_dir) from None
        return client

    def load_weights(self, read_state_dict: Callable[[], Optional[dict]], scratch: Path) -> None:
        """The model's weights (only) from a full plain-GPT state dict that rank 0 reads: DCP's
        ``set_model_state_dict`` broadcasts it from rank 0 and keeps this rank's shards. The
        optimizer keeps referring to the same parameters (copied into in place)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        from ...config import ConfigError
        from ..dtypes import restore_exact_buffers

        rank = dist.get_rank() if dist.is_initialized() else 0
        # pipeline stages hold different parameters: each rank reads the file and keeps its own part
        every = self.every_rank_reads
        full = read_state_dict() if rank == 0 or every else None
        own = get_model_state_dict(self.model)  # plain-GPT names (no compile/AC wrapper prefixes)
        if every:  # the whole model is the union of the stages: a source key none of them holds is refused
            stages = [sorted(own)]
            if dist.is_initialized() and dist.get_world_size() > 1:
                stages = [None] * dist.get_world_size()
                dist.all_gather_object(stages, sorted(own))
            model_keys = set().union(*map(set, stages))
        if full is not None:
            why = key_mismatch(model_keys, full) if every else None
            if every:
                full = {k: v for k, v in full.items() if k in own}
            why = why or key_mismatch(own, full)
            if why is None:
                why = next((f"{k} is {tuple(full[k].shape)} there but {tuple(own[k].shape)} here" for k in own
                            if tuple(full[k].shape) != tuple(own[k].shape)), None)
            if why is None:  # this run's dtype (a bf16 source into fp32 master weights)
                full = {k: v.to(own[k].dtype) if v.is_floating_point() else v for k, v in full.items()}
        else:
            why = None
        if dist.is_initialized():
            said = [None] * dist.get_world_size()
            dist.all_gather_object(said, why)
            why = next((w for w in said if w), None)
        if why:
            raise ConfigError(why)
        distributed = dist.is_initialized() and dist.get_world_size() > 1 and not every
        set_model_state_dict(self.model, full if full is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed))
        restore_exact_buffers(self.model)
