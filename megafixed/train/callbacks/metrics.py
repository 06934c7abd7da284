"""The metrics log and progress lines as a callback (``metrics.interval``, ``metrics.tensorboard``): a record
of a step every interval, at the last step and whenever a callback asks for one (validation ran), written to
``metrics.jsonl``, TensorBoard and the sinks (W&B) on rank 0, with a progress line. Every callback's
``on_record`` may add fields first (on every rank: the stragglers' figures are a collective). Throughput
(tokens/s, MFU) is measured over the steps since the last record, without the time spent saving."""
from __future__ import annotations

import time

from ..metrics import MetricsLog, flops_per_token, matmul_param_count, peak_flops_per_gpu, progress_line
from .base import Callback


class Metrics(Callback):
    name = "metrics"

    def __init__(self, section, max_steps: int):
        self.interval, self.tensorboard, self.last_step = section.interval, section.tensorboard, max_steps
        self.log = None

    def setup(self, run) -> None:
        self.run = run
        self.log = MetricsLog(run.run_dir, enabled=run.topo.is_main, tensorboard=self.tensorboard,
                              resume_step=run.done, sinks=run.sinks)
        run.writer = self.log
        self.tokens_per_step = run.topo.plan.batch.tokens_per_step
        self.peak = peak_flops_per_gpu() if run.engine.device.type == "cuda" else None
        model = run.cfg.model
        self.flops_tok = flops_per_token(model, matmul_param_count(model), run.cfg.data.seq_len) if self.peak else None
        self.window_t, self.window_steps, self.step_times = time.perf_counter(), 0, []

    def before_compute(self, step: int) -> None:
        self._t0 = time.perf_counter()  # the optimizer step alone (validation and saves are not step time)

    def after_compute(self, step: int) -> None:
        self.window_steps += 1
        self.step_times.append(time.perf_counter() - self._t0)

    def after_step(self, step: int) -> None:
        run = self.run
        if not (step == self.last_step or (self.interval > 0 and step % self.interval == 0) or run.record_now):
            return
        result = run.result
        if result is None:  # the step's data was skipped (data.skip_steps, a rollback's window)
            rec = {"step": step, "lr": run.lr, "skipped_data": True, "consumed_samples": run.consumed}
        else:
            rec = {"step": step, "loss": result.loss, "lr": run.lr, "grad_norm": result.grad_norm,
                   "tokens_per_s": self.tokens_per_step * self.window_steps
                   / max(time.perf_counter() - self.window_t, 1e-9),
                   "consumed_samples": run.consumed}
        for cb in run.callbacks:
            cb.on_record(step, rec)
        if result is None:
            run.write(rec)
            val = rec.get("val_loss")
            run.say(f"step {step}/{self.last_step} | data skipped (consumed without training)"
                    + (f" | val {val:.4f}" if val is not None else ""))
            return
        if self.flops_tok:
            rec["mfu"] = rec["tokens_per_s"] * self.flops_tok / (self.peak * run.topo.world_size)
        if result.skipped:
            rec["skipped"] = True
        run.write(rec)
        recent = self.step_times[-50:]
        run.say(progress_line(rec, self.last_step, (self.last_step - step) * sum(recent) / len(recent)))
        self.window_t, self.window_steps = time.perf_counter(), 0

    def after_save(self, step: int, tag: str) -> None:
        self.window_t = time.perf_counter()  # the save is not charged to tokens/s

    def on_stop(self, step: int) -> None:
        self.log.close()

    def on_error(self, exc: BaseException) -> None:
        if self.log is not None:
            self.log.close()


def build(section, cfg) -> Metrics:
    return Metrics(section, cfg.train.max_steps)
