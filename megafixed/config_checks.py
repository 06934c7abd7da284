"""Allowed ranges for every numeric config field, checked in one pass before any work starts.

Why a table: a negative ``optimizer.min_lr`` or a ``model.dropout`` of 1.5 is accepted by the
type check and then trains for hours on nonsense (or fails deep inside DeepSpeed). One table,
one reason per entry, makes the rule for each key visible, and a test checks that every numeric
field of every section has an entry, so a new field cannot slip through unchecked.

``check_ranges(cfg)`` raises ``ConfigError`` naming the key, the value and the allowed range;
``Config.validate`` calls it after the per-section checks (whose messages for sizes and the ZeRO
stage are older and kept), before any work starts.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from .errors import ConfigError

INT32_MAX = 2 ** 31 - 1


@dataclass(frozen=True)
class Range:
    lo: Optional[float] = None  # None: unbounded
    hi: Optional[float] = None
    lo_open: bool = False  # True: the bound itself is excluded
    hi_open: bool = False
    why: str = ""

    def contains(self, v: float) -> bool:
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            return False
        return True

    def text(self) -> str:
        lo = "-inf" if self.lo is None else _fmt(self.lo)
        hi = "inf" if self.hi is None else _fmt(self.hi)
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        return f"{left}{lo}, {hi}{right}"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"  # 4294967295, not 4.29497e+09


def _pos(why: str) -> Range:
    return Range(0, None, lo_open=True, why=why)


def _at_least(n: float, why: str) -> Range:
    return Range(n, None, why=why)


def _unit(why: str, lo_open: bool = False, hi_open: bool = False) -> Range:
    return Range(0, 1, lo_open=lo_open, hi_open=hi_open, why=why)


RANGES: dict[str, Range] = {
    # model
    "model.vocab_size": Range(1, INT32_MAX, why="token ids are int32 in shards and kernels"),
    "model.d_model": _at_least(1, "the model width"),
    "model.n_layers": _at_least(1, "a model needs at least one block"),
    "model.n_heads": _at_least(1, "attention needs at least one head"),
    "model.n_kv_heads": _at_least(1, "null means one key/value head per query head"),
    "model.ffn_hidden": _at_least(1, "null picks the default MLP width"),
    "model.norm_eps": Range(0, 1, lo_open=True, hi_open=True, why="a small positive constant, e.g. 1e-5"),
    "model.max_seq_len": _at_least(1, "the longest sequence the model sees"),
    "model.rope_theta": _pos("the RoPE base, e.g. 10000"),
    "model.init_std": Range(0, 1, lo_open=True, why="the weight init standard deviation, e.g. 0.02"),
    "model.dropout": _unit("a probability; 1 would drop everything", hi_open=True),
    "model.code_bits": Range(1, 31, why="ids travel as int32 in the code kernel"),
    "model.code_seed": Range(0, 2 ** 64 - 1, why="the SplitMix64 seed of the GF(2) code matrix"),
    "model.code_scale": _pos("the magnitude of the +-scale code entries"),
    # data
    "data.seq_len": _at_least(1, "tokens per training sample"),
    "data.tokenizer_train_vocab": Range(300, INT32_MAX, why="byte-level tokenizers need 256 bytes plus merges"),
    "data.num_workers": _at_least(0, "0 loads batches in the main process"),
    "data.weights[]": _at_least(0, "blend weights are non-negative shares"),
    # optimizer
    "optimizer.lr": Range(0, 1, lo_open=True, why="AdamW learning rates are small positive numbers, e.g. 3e-4"),
    "optimizer.min_lr": Range(0, 1, why="the floor of the decay; 0 decays to zero"),
    "optimizer.weight_decay": _unit("decoupled weight decay, e.g. 0.1"),
    "optimizer.beta1": _unit("Adam's first-moment decay, e.g. 0.9", hi_open=True),
    "optimizer.beta2": _unit("Adam's second-moment decay, e.g. 0.95", hi_open=True),
    "optimizer.eps": Range(0, 1, lo_open=True, hi_open=True, why="Adam's denominator guard, e.g. 1e-8"),
    "optimizer.grad_clip": _at_least(0, "the gradient-norm clip; 0 turns clipping off"),
    # schedule
    "schedule.warmup_steps": _at_least(0, "steps of linear warm-up"),
    "schedule.decay_steps": _at_least(1, "null decays over train.max_steps"),
    "schedule.wsd_decay_fraction": _unit("the share of steps spent in the final WSD decay"),
    # train
    "train.max_steps": _at_least(0, "0 only evaluates / saves"),
    "train.global_batch": _at_least(1, "sequences per optimizer step"),
    "train.micro_batch": _at_least(1, "sequences per forward/backward"),
    "metrics.interval": _at_least(1, "log every N steps"),
    "validation.interval": _at_least(0, "0 turns evaluation off"),
    "validation.iters": _at_least(0, "batches per evaluation"),
    "checkpoint.interval": _at_least(1, "checkpoint every N steps"),
    "train.seed": Range(0, 2 ** 32 - 1, why="numpy and torch seeds are 32-bit unsigned"),
    "train.threads": Range(0, 4096, why="0: OMP_NUM_THREADS, else this process's share of the cores"),
    "checkpoint.keep": Range(None, None, why="<= 0 keeps every checkpoint"),
    "guard.spike_sigma": _pos("standard deviations above the window's mean that make a spike"),
    "guard.spike_window": _at_least(2, "good steps whose mean and std judge the next one"),
    "guard.rollback_skip": _at_least(0, "steps skipped past the bad one after a rollback"),
    "guard.max_rollbacks": _at_least(0, "rollbacks before the run stops; 0: the first bad step stops it"),
    "guard.max_transient_faults": _at_least(0, "transient faults on one node before the run leaves it; 0: never"),
    "watchdog.timeout_s": _at_least(0, "seconds without a completed step; 0: from the measured step time"),
    "stragglers.factor": _pos("times the median forward compute that names a rank"),
    # parallel
    "parallel.tp": _at_least(1, "tensor-parallel size"),
    "parallel.cp": _at_least(1, "context-parallel size"),
    "parallel.pp": _at_least(1, "pipeline-parallel size"),
    "parallel.vpp": _at_least(1, "pipeline stages per rank"),
    "parallel.pp_input_head_layers": _at_least(0, "layers the input and the head each count as in the stage split"),
    "parallel.collective_timeout_s": Range(1, 86400, why="seconds a collective waits for a lost peer before failing"),
    # zero
    "zero.stage": Range(0, 3, why="DeepSpeed ZeRO stages are 0, 1, 2 and 3"),
    "zero.reduce_bucket_size": _at_least(1, "elements per gradient-reduction bucket"),
    # torch_engine
    "torch_engine.dp_replicate": _at_least(1, "HSDP's replicate degree; it must divide the data-parallel size"),
    # eval (in-loop zero-shot: megafixed/train/callbacks/zero_shot.py)
    "eval.interval": _at_least(0, "steps between zero-shot evaluations; 0 turns them off"),
    "eval.limit": _at_least(1, "documents scored per task (per MMLU subject)"),
    "eval.batch_size": _at_least(1, "packed rows per forward pass"),
    # profile (megafixed/train/callbacks/profile.py)
    "profile.memory_entries": _at_least(1, "allocation events CUDA's memory history keeps"),
    "profile.top": _at_least(0, "operators named in the profile's summary line"),
}

# Numeric fields validated where their meaning lives, not by a simple range.
CHECKED_ELSEWHERE = {
    "profile.steps": "a window of steps ('10-12'); ProfileConfig.window parses it",
    "model.code_rows": "rows of the GF(2) matrix; megafixed.codes checks shape and invertibility",
    "model.code_shift": "the affine shift b; megafixed.codes checks it fits model.code_bits",
}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(key: str, value: Any) -> None:
    rng = RANGES[key]
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number in {rng.text()} ({rng.why})")
    if not rng.contains(value):
        if rng.hi is None and rng.lo is not None:  # the common case reads best as a bound
            raise ConfigError(f"{key}={value} must be {'>' if rng.lo_open else '>='} {_fmt(rng.lo)} ({rng.why})")
        raise ConfigError(f"{key}={value} is out of range: allowed {rng.text()} ({rng.why})")


def check_ranges(cfg) -> None:
    """Raise ConfigError for the first numeric field outside its range (fields in config order)."""
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        if not dataclasses.is_dataclass(section):
            continue
        for f in dataclasses.fields(section):
            key = f"{sec.name}.{f.name}"
            value = getattr(section, f.name)
            if key in RANGES and _number(value):
                _check(key, value)
            elif f"{key}[]" in RANGES and isinstance(value, list):
                for i, item in enumerate(value):
                    if not _number(item):
                        raise ConfigError(f"{key}[{i}]={item!r} must be a number")
                    try:
                        _check(f"{key}[]", item)
                    except ConfigError as exc:
                        raise ConfigError(str(exc).replace(f"{key}[]", f"{key}[{i}]", 1)) from None
    o = cfg.optimizer
    if _number(o.min_lr) and _number(o.lr) and o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} exceeds optimizer.lr={o.lr}; the schedule decays from lr "
                          f"down to min_lr, so set min_lr <= lr")


def check_pipeline_keys_need_pp(cfg, pp: int) -> None:
    """A pipeline schedule or stages-per-rank set without a pipeline (``pp == 1``) would be ignored
    silently, so the run would not be what was asked: refuse it by name (both engines' rule, asked
    by their ``check_supported`` for the layout the run plan resolved)."""
    par = cfg.parallel
    schedule, vpp = str(par.pp_schedule), par.vpp
    if pp == 1 and (schedule.lower() != "1f1b" or vpp != 1):
        set_keys = ", ".join(k for k, default in ((f"parallel.pp_schedule={schedule}", schedule.lower() == "1f1b"),
                                                  (f"parallel.vpp={vpp}", vpp == 1)) if not default)
        raise ConfigError(f"{set_keys} configures pipeline parallelism, but parallel.pp=1 runs no pipeline; set "
                          f"parallel.pp >= 2, or leave parallel.pp_schedule (1F1B) and parallel.vpp (1) at their "
                          f"defaults")


def require_at_least(section: str, obj: Any, minimum: int, names: tuple) -> None:
    """Sizes and intervals below ``minimum`` would fail later as a ZeroDivisionError or an empty loop."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < minimum:
            raise ConfigError(f"{section}.{name}={value} must be >= {minimum}")
