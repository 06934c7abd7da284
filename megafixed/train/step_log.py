"""What each step leaves behind: a metrics record and a progress line, every ``train.log_interval``
steps, at the last step and whenever validation ran (``StepLog`` decides). Throughput (tokens/s,
MFU) is measured over the steps since the last record, without the time spent saving."""
from __future__ import annotations

import contextlib
import time
from typing import Optional

from ..run.run_dir import RunDirectory
from .metrics import MetricsLog, flops_per_token, matmul_param_count, peak_flops_per_gpu, progress_line


class StepLog:
    def __init__(self, train, model, seq_len: int, topo, engine, *, resume_step: int, sinks: list, say):
        """``train``: the config's ``train`` section (log interval, last step, run dir, tensorboard);
        ``model`` and ``seq_len`` (``data.seq_len``): the FLOPs per token MFU is measured against."""
        self.interval, self.last_step, self.say, self.world = train.log_interval, train.max_steps, say, \
            topo.world_size
        self.metrics = MetricsLog(RunDirectory(train.run_dir).path, enabled=topo.is_main,
                                  tensorboard=train.tensorboard, resume_step=resume_step, sinks=sinks)
        self.tokens_per_step = topo.plan.batch.tokens_per_step
        self.peak = peak_flops_per_gpu() if engine.device.type == "cuda" else None
        self.flops_tok = flops_per_token(model, matmul_param_count(model), seq_len) if self.peak else None
        self.history: list = []  # every record written (rank 0's are the run's)
        self.window_t, self.window_steps, self.step_times = time.perf_counter(), 0, []

    @contextlib.contextmanager
    def timing(self):
        """Around the optimizer step alone (validation and saves are not step time)."""
        t0 = time.perf_counter()
        yield
        self.window_steps += 1
        self.step_times.append(time.perf_counter() - t0)

    def record(self, step: int, lr: float, result, val: Optional[float], consumed: int, extra=None) -> None:
        """``result`` None: the step's data was skipped (``data.skip_steps``, a rollback window).
        ``extra(step)``: more fields for a record (on every rank: it may be a collective)."""
        if not (step == self.last_step or (self.interval > 0 and step % self.interval == 0) or val is not None):
            return
        more = extra(step) if extra is not None else {}
        if result is None:
            self.write({"step": step, "lr": lr, "skipped_data": True, "consumed_samples": consumed, **more,
                        **({"val_loss": val} if val is not None else {})})
            self.say(f"step {step}/{self.last_step} | data skipped (consumed without training)"
                     + (f" | val {val:.4f}" if val is not None else ""))
            return
        rec = {"step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
               "tokens_per_s": self.tokens_per_step * self.window_steps
               / max(time.perf_counter() - self.window_t, 1e-9),
               "consumed_samples": consumed, **more}
        if self.flops_tok:
            rec["mfu"] = rec["tokens_per_s"] * self.flops_tok / (self.peak * self.world)
        if val is not None:
            rec["val_loss"] = val
        if result.skipped:
            rec["skipped"] = True
        self.write(rec)
        recent = self.step_times[-50:]
        self.say(progress_line(rec, self.last_step, (self.last_step - step) * sum(recent) / len(recent)))
        self.window_t, self.window_steps = time.perf_counter(), 0

    def initial_validation(self, val: float) -> None:
        self.write({"step": 0, "val_loss": val, "consumed_samples": 0})
        self.say(f"step 0/{self.last_step} | val {val:.4f}")

    def write(self, rec: dict) -> None:
        self.metrics.write(rec)
        self.history.append(rec)

    def note(self, rec: dict) -> None:
        """A row of ``metrics.jsonl`` that is not a step's record (a bad step's verdict): not in the history."""
        self.metrics.write(rec)

    def rewind(self, step: int) -> None:
        """Back to after ``step`` (a rollback): the records past it go, from the history and the files."""
        self.history[:] = [r for r in self.history if r.get("step", 0) <= step]
        self.metrics.rewind(step)

    def not_charged(self) -> None:
        """Time spent since the last step (a checkpoint save) does not count against tokens/s."""
        self.window_t = time.perf_counter()

    def close(self) -> None:
        self.metrics.close()
