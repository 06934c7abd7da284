"""Writing checkpoint files: checksummed always, in the background with ``checkpoint.async_save=true``.

``CheckpointWriter`` replaces the engine's ``checkpoint_engine`` (DeepSpeed's seam for how shard
files are written: every ``mp_rank_*``, ``layer_*`` and ``zero_pp_rank_*`` file goes through its
``save``). Each file's sha256 and size are computed from the bytes as they are written (no second
read), for the manifest (``manifest.py``).

Why not DeepSpeed's own async engines: ``DecoupledCheckpointEngine`` and ``FastCheckpointEngine``
write through DeepSpeed's async-I/O op (libaio, a GPU-node build) and the decoupled one commits
only at the *next* save; torch's ``distributed.checkpoint.async_save`` writes its own DCP format,
which DeepSpeed's loader, ``ds_to_universal`` and our converter do not read. Ours is the same idea
in plain torch: in async mode ``save`` takes a CPU copy of the state and a thread per rank
serialises it with ``torch.save`` while training continues. The files are DeepSpeed's own, so
every reader works unchanged.

On CUDA the copy does not stall training either (about 24 GB at 1.7B with Adam): each tensor is
copied into a pinned host buffer on a side stream that first waits for the training stream, so the
copy sees the state as of the save. Two orderings keep it exact: the writer thread waits for the
copy's event before it serialises (so the files, and therefore ``latest``, come after the copy),
and the training stream waits for the same event before the next optimizer update (``fence``,
called by the engine's train step), so no parameter or optimizer state changes under the copy. Forward and
backward of the next step overlap it.

Completion is agreed through files, not collectives (a collective from a background thread could
interleave with the training step's): each rank, once its files are written and fsynced, writes
``<tag>/.files.rank<r>.json`` with their records; rank 0's ``on_complete`` waits for all of them,
checks every file's size on disk, writes the run record and the manifest, and only then moves
``latest``. A second save first waits for the one in flight (``wait``).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from typing import Callable, Optional

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ... import pause as pauses
from ...run.run_dir import tag_step
from ..common import BackgroundSave


class _HashingFile:
    """A write-only binary file that hashes and counts what passes through it.

    Not the torch engine's ``native.checkpoint._HashingStream`` on purpose: that one offers
    ``fileno``/``tell`` because DCP needs them, and given a ``fileno`` torch's legacy (non-zip,
    ``zipfile_serialization=False``) writer writes storages straight to the descriptor, past the hash."""

    def __init__(self, fh):
        self.fh, self.h, self.n = fh, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.h.update(view)
        self.n += view.nbytes
        return self.fh.write(view)

    def flush(self) -> None:
        self.fh.flush()


def write_file(obj, path: str, zipfile: bool = True) -> dict:
    """``torch.save`` ``obj`` to ``path``, fsynced; returns its manifest record."""
    with open(path, "wb") as fh:
        out = _HashingFile(fh)
        torch.save(obj, out, _use_new_zipfile_serialization=zipfile)
        fh.flush()
        os.fsync(fh.fileno())
    pause = pauses.armed("checkpoint.file")  # MEGAFIXED_PAUSE: a test kills the process mid-save
    if pause is not None:
        pause.reached(tag_step(os.path.basename(os.path.dirname(path))))
    return {"size": out.n, "sha256": out.h.hexdigest()}


_SIDE_STREAMS: dict = {}  # device index -> the stream checkpoint copies run on


class HostCopier:
    """Device-to-host copies for a snapshot: CUDA tensors into pinned buffers on a side stream,
    CPU tensors by a plain copy. ``event()`` marks the copies queued so far (None if there were none
    on a GPU); nothing here blocks the host."""

    def __init__(self):
        self.stream = None
        self.queued = False

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        cuda = t.is_cuda  # the CPU path is the same copy, without pinning or a stream
        if cuda and self.stream is None:
            index = t.device.index if t.device.index is not None else torch.cuda.current_device()
            if index not in _SIDE_STREAMS:
                _SIDE_STREAMS[index] = torch.cuda.Stream(index)
            self.stream = _SIDE_STREAMS[index]
            # The state as of now: everything training queued so far (the last update) comes first.
            self.stream.wait_stream(torch.cuda.current_stream(index))
        dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)  # contiguous: views become tensors
        with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
            dst.copy_(t, non_blocking=cuda)
        if cuda:
            t.record_stream(self.stream)  # the allocator must not hand t's memory out before the copy ran
            self.queued = True
        return dst

    def event(self):
        if not self.queued:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


def snapshot(obj, copier: Optional[HostCopier] = None):
    """A copy of ``obj`` that training can no longer change: tensors copied to the host (views of one
    storage become separate tensors, which is also what DeepSpeed's own clone-before-save does).
    With CUDA tensors the copies may still be in flight: wait for ``copier.event()`` before reading."""
    copier = copier or HostCopier()
    if isinstance(obj, torch.Tensor):
        return copier.copy(obj)
    if isinstance(obj, dict):
        out = obj.copy()  # keeps OrderedDict & co.
        for k, v in obj.items():
            out[k] = snapshot(v, copier)
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(snapshot(v, copier) for v in obj)
    return obj  # ints, strings, configs, RNG states (already copies)


class CheckpointWriter(BackgroundSave, TorchCheckpointEngine):
    """DeepSpeed checkpoint engine: checksummed writes, optionally in a background thread."""

    def __init__(self, async_save: bool = False, config_params=None):
        super().__init__(config_params)
        self.name = "megafixed.CheckpointWriter"
        if config_params is None:
            self.zipfile_serialization = True  # torch.save's default
        self.async_save = async_save
        self.records: dict[str, dict] = {}  # path -> {"size", "sha256"} of the save being written
        self.handed_bytes = 0  # tensor bytes handed over in this save (a failed save says what it needed)
        self._pending: list[tuple[object, str, object]] = []  # (host state, path, its copy's CUDA event)
        self._unfenced: list = []  # copy events the training stream has not been ordered after yet
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    # ---- DeepSpeed's CheckpointEngine interface
    def save(self, state_dict, path: str):
        from ...run.save_faults import tensor_bytes

        self.handed_bytes += tensor_bytes(state_dict)
        if self.async_save:
            copier = HostCopier()
            state = snapshot(state_dict, copier)
            event = copier.event()
            if event is not None:
                self._unfenced.append(event)
            self._pending.append((state, path, event))
        else:
            self.records[path] = write_file(state_dict, path, self.zipfile_serialization)

    def fence(self) -> None:
        """Order the training stream after the checkpoint copies in flight (a GPU-side wait; the host
        does not block). ``train_step`` calls it before each optimizer update."""
        events, self._unfenced = self._unfenced, []
        for ev in events:
            torch.cuda.current_stream().wait_event(ev)

    # ---- ours
    def begin(self) -> None:
        """Start collecting a new save (after the previous one is complete)."""
        self.wait()
        self.records, self._pending, self.handed_bytes = {}, [], 0

    def finish(self, on_written: Callable[[dict], None],
               on_failed: Optional[Callable[[BaseException], BaseException]] = None) -> None:
        """The engine has handed over every file of this save: write them (async: in the background),
        then call ``on_written(records)``. A background failure is passed through ``on_failed``
        (cleanup, naming the fault) and what it returns is raised by the next ``wait``."""
        if not self.async_save:
            on_written(self.records)
            return
        pending, self._pending = self._pending, []

        def work():
            try:
                for state, path, event in pending:
                    if event is not None:
                        event.synchronize()  # the pinned copy is complete before a byte is written
                    self.records[path] = write_file(state, path, self.zipfile_serialization)
                    del state
                pending.clear()
                on_written(self.records)
            except BaseException as exc:  # re-raised in the training thread by wait()
                self._error = on_failed(exc) if on_failed is not None else exc

        self._thread = threading.Thread(target=work, name="megafixed-checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

