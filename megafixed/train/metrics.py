"""Run metrics: ``metrics.jsonl`` (one JSON object per logged step), TensorBoard events, the
progress line, and model FLOPs utilisation on GPUs."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

import torch

from .. import env as env_vars
from ..atomic import atomic_write_text
from ..run.run_dir import RunDirectory


def peak_flops_per_gpu() -> Optional[float]:
    """Dense bf16 peak of this GPU by its exact name (``device_specs``), for MFU; None (MFU unknown)
    for a device not in the table. ``MEGAFIXED_PEAK_TFLOPS`` sets it by hand."""
    from ..parallel.device_specs import peak_bf16_flops

    if env_vars.peak_tflops() is not None:
        return peak_bf16_flops(None)
    if not torch.cuda.is_available():
        return None
    return peak_bf16_flops(torch.cuda.get_device_name())


def flops_per_token(model_cfg, matmul_params: int, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: 6N for the weight matmuls plus 12*L*d*T for
    attention scores. N excludes the input interface (a table lookup or a fixed code does no
    matmul), which makes the number identical for the three interfaces."""
    return 6.0 * matmul_params + 12.0 * model_cfg.n_layers * model_cfg.d_model * seq_len


def matmul_param_count(model_cfg) -> int:
    """Parameters of the whole model (all TP/PP shards) that take part in matmuls: everything but
    the input interface, whose lookup or fixed code does no matmul (a tied head still does its own)."""
    from ..model.params import count_params

    c = count_params(model_cfg)
    tied = model_cfg.vocab_size * model_cfg.d_model if model_cfg.tie_embeddings else 0
    return c.total - c.input + tied


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def progress_line(rec: dict, max_steps: int, eta_s: float) -> str:
    parts = [f"step {rec['step']}/{max_steps}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}"]
    if rec.get("grad_norm") is not None:
        parts.append(f"grad {rec['grad_norm']:.3f}")
    parts.append(f"{rec['tokens_per_s'] / 1e3:.1f}k tok/s")
    if rec.get("mfu") is not None:
        parts.append(f"mfu {100 * rec['mfu']:.1f}%")
    if rec.get("val_loss") is not None:
        parts.append(f"val {rec['val_loss']:.4f}")
    if rec.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


class MetricsLog:
    """Rank 0's sink for per-step records: JSON lines plus TensorBoard scalars.

    Files are opened on the first record, so a run that fails before its first step leaves no
    empty ``metrics.jsonl`` or event file behind. On resume, records past the resumed step
    (written by the interrupted run after its last checkpoint) are dropped first, so the file reads
    as one uninterrupted run.
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool, tensorboard: bool, resume_step: int = 0,
                 sinks: tuple = ()):
        self.enabled = enabled
        self.sinks = list(sinks)  # more writers of the same records (train/wandb_log.py)
        self.run_dir = Path(run_dir)
        self.path = RunDirectory(self.run_dir).metrics_file
        self.tensorboard = tensorboard
        self.resume_step = resume_step
        self.fh = None
        self.writer = None

    def _open(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(self.resume_step)
        self.fh = open(self.path, "a")
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            from .tb_resume import truncate_events_after

            # As metrics.jsonl above: what an interrupted run logged past its checkpoint goes.
            events = RunDirectory(self.run_dir).tensorboard_dir
            truncate_events_after(events, self.resume_step)
            self.writer = SummaryWriter(log_dir=str(events), purge_step=self.resume_step + 1)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
        atomic_write_text(self.path, "".join(line + "\n" for line in keep))

    def rewind(self, step: int) -> None:
        """The records (and TensorBoard events) past ``step`` go, as on a resume from ``step`` (a rollback
        went back there): the files are closed, and the next record reopens them, truncated first."""
        if self.fh is not None:
            self.fh.close()
            self.fh = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.resume_step = step

    def write(self, rec: dict) -> None:
        if not self.enabled:
            return
        if self.fh is None:
            self._open()
        self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()
        if self.writer is not None:
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"train/{key}" if not key.startswith("val") else f"valid/{key}",
                                           value, rec["step"])
            # As metrics.jsonl: on disk at once. A hang or a refusal leaves by os._exit, which flushes
            # nothing, and SummaryWriter would otherwise hold the scalars for up to two minutes.
            self.writer.flush()
        for sink in self.sinks:
            sink.write(rec)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.fh is not None:
            self.fh.close()
        if self.writer is not None:
            self.writer.close()
