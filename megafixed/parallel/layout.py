"""The one layout validator: every engine-agnostic cross-field rule of a (TP, CP, PP, DP, batch) layout.

``megafixed.run_plan.RunPlan.build`` is its one caller on a run's way (the command builds the plan
once, before any process group exists, on a CPU-only login node too for ``--dry-run``), so a bad
layout fails in a second with a message naming the keys and a fix, rather than as a hang or a
shape error deep inside a collective. ``megafixed plan`` builds plans to filter candidate layouts.

Single-key ranges (``parallel.tp >= 1``, ``train.micro_batch >= 1``) are not repeated here: the
config's range table (``config_checks.RANGES``) refuses them when the config is loaded. Rules of
one engine (DeepSpeed's ZeRO combinations, what the torch-native engine does not run) are that
engine's ``support.check_supported``, which ``RunPlan.build`` calls right after this validator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError


class LayoutError(ConfigError):
    """An impossible parallel layout; the message names the constraint and a fix."""


@dataclass(frozen=True)
class BatchLayout:
    global_batch: int  # sequences per optimizer step, all data-parallel ranks together
    micro_batch: int  # sequences per forward/backward on one rank
    accum: int  # micro batches per optimizer step on one rank
    dp: int

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accum


def model_parallel_axes(parallel) -> dict[str, int]:
    """The configured axes of one model replica, by grid name; data parallelism takes the rest of
    the world. ``cp`` is named only when it splits (> 1): a run without context parallelism has the
    grid, groups and words it had before the axis existed."""
    axes = {"tp": parallel.tp, "pp": parallel.pp}
    if getattr(parallel, "cp", 1) > 1:
        axes["cp"] = parallel.cp
    return axes


def data_parallel_size(parallel, world: int) -> int:
    axes = model_parallel_axes(parallel)
    replica = math.prod(axes.values())
    if world < 1 or world % replica:
        names = " * ".join(f"parallel.{n}" for n in axes)
        raise LayoutError(f"world size {world} is not divisible by {names} = {'*'.join(map(str, axes.values()))}; "
                          f"launch a multiple of {replica} processes or change the layout")
    return world // replica


def batch_layout(train, dp: int) -> BatchLayout:
    """Reconcile global = micro * accum * dp; refuse layouts that do not divide, naming the fix."""
    g, mb = train.global_batch, train.micro_batch
    if g % (mb * dp):
        lo = (g // (mb * dp)) * mb * dp
        near = [b for b in (lo, lo + mb * dp) if b > 0]  # below g is 0 when g < mb * dp: one suggestion
        hint = "e.g. train.global_batch=" + " or ".join(map(str, near))
        raise LayoutError(f"train.global_batch={g} is not divisible by train.micro_batch * data-parallel size "
                          f"= {mb} * {dp} = {mb * dp}; pick a global batch that is a multiple ({hint}) "
                          f"or change train.micro_batch")
    return BatchLayout(global_batch=g, micro_batch=mb, accum=g // (mb * dp), dp=dp)


def _check_model_split(cfg, tp: int, pp: int) -> None:
    m = cfg.model
    if m.n_heads % tp:
        raise LayoutError(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={tp}; each "
                          f"tensor-parallel rank needs whole attention heads")
    if m.kv_heads % tp:
        raise LayoutError(f"model.n_kv_heads={m.kv_heads} is not divisible by parallel.tp={tp}; use "
                          f"more key/value heads or a smaller parallel.tp")
    if m.ffn_dim % tp:
        raise LayoutError(f"MLP width {m.ffn_dim} (model.ffn_hidden) is not divisible by parallel.tp={tp}")
    if m.vocab_size % tp:
        raise LayoutError(f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={tp}; pad the "
                          f"vocabulary to a multiple of {tp} (the output head is split by vocabulary rows)")
    # A stage must own at least one block: a stage of only codes or only the head would idle while
    # holding a full activation buffer. Uneven counts are allowed (6 layers on 4 stages).
    if m.n_layers < pp:
        raise LayoutError(f"model.n_layers={m.n_layers} is fewer than parallel.pp={pp} pipeline stages; "
                          f"every stage needs at least one block")
    if pp > 1 and m.tie_embeddings:
        raise LayoutError("model.tie_embeddings=true is not supported with parallel.pp > 1 (the table and "
                          "the head live on different stages); untie them or use parallel.pp=1")


def _check_sequence_parallel(cfg, tp: int) -> None:
    sp = cfg.parallel.sequence_parallel
    if sp and tp == 1:
        raise LayoutError("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the sequence "
                          "over the tensor-parallel group)")
    if sp and cfg.data.seq_len % tp:
        raise LayoutError(f"data.seq_len={cfg.data.seq_len} is not divisible by parallel.tp={tp}, which "
                          f"sequence parallelism needs (each rank holds seq_len/tp positions)")
    if tp > 1 and not sp and cfg.model.dropout > 0:
        # Without SP the residual stream is replicated on every TP rank, and each rank's own RNG
        # would drop different elements of it: the replicas drift apart (measured: block outputs
        # differ by up to 0.04). Under SP each rank owns distinct positions, so per-rank masks are right.
        raise LayoutError(f"model.dropout={cfg.model.dropout} with parallel.tp={tp} would drop different "
                          f"elements of the replicated residual stream on each tensor-parallel rank; set "
                          f"parallel.sequence_parallel=true (each rank then owns its positions) or model.dropout=0")


def largest_context_parallel(heads: int, seq_len: int, cp: int) -> int:
    """The largest context-parallel size up to ``cp`` that splits both these heads and this sequence."""
    return max(c for c in range(1, cp + 1) if heads % c == 0 and seq_len % c == 0)


def _check_context_parallel(cfg, tp: int, cp: int) -> None:
    """Ulysses hands every context-parallel rank whole heads of the whole sequence, and every method
    splits the sequence into ``cp`` equal shards (``tp * cp`` under sequence parallelism)."""
    if cp == 1:
        return
    m, p = cfg.model, cfg.parallel
    seq = cfg.data.seq_len
    split = tp * cp if p.sequence_parallel else cp
    if seq % split:
        what = "parallel.tp * parallel.cp" if p.sequence_parallel else "parallel.cp"
        raise LayoutError(f"data.seq_len={seq} is not divisible by {what} = {split}; each context-parallel rank "
                          f"holds an equal slice of every sequence: pick a sequence length that is a multiple of "
                          f"{split} or another parallel.cp")
    heads = m.n_heads // tp
    if p.cp_method == "ulysses" and heads % cp:
        best = largest_context_parallel(heads, seq // (tp if p.sequence_parallel else 1), cp)
        raise LayoutError(f"parallel.cp={cp} does not divide the {heads} attention heads each tensor-parallel rank "
                          f"holds (model.n_heads={m.n_heads} / parallel.tp={tp}), which Ulysses splits over the "
                          f"context-parallel ranks; the largest parallel.cp that works is {best} (or "
                          f"parallel.cp_method=ring on CUDA GPUs)")


def validate_layout(cfg, world: int, precision: Optional[str] = None) -> BatchLayout:
    """Raise ``LayoutError`` for a layout that cannot work; return its batch layout (with dp).

    ``precision`` is the resolved one (``run_plan.resolve_precision``); the engine-specific rules
    that read it are the engine's (``EngineKind.check_supported``)."""
    dp = data_parallel_size(cfg.parallel, world)
    axes = model_parallel_axes(cfg.parallel)
    tp, pp = axes["tp"], axes["pp"]
    _check_model_split(cfg, tp, pp)
    _check_sequence_parallel(cfg, tp)
    _check_context_parallel(cfg, tp, axes.get("cp", 1))
    return batch_layout(cfg.train, dp)


def check_layout(cfg, world: int) -> int:
    """The data-parallel size of a valid layout (``validate_layout(...).dp``)."""
    return validate_layout(cfg, world).dp
