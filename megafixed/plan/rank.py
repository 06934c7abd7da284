"""How ``megafixed plan`` orders its rows, and a row as the overrides a run takes.

The rows that fit are ranked by the plan's own step-time lower bound (``bound.step_time_bound``:
the dense matmul FLOPs at the GPU's peak, stretched by the pipeline bubble where the engine models
its pipeline, against the collectives' bus bytes at the links' data-sheet bandwidth), fastest
first; equal bounds go to the row with less memory. A row the bound cannot judge (a pipeline whose
engine has no model of its stages' bubble: DeepSpeed's, so far; or a GPU/link with no data sheet)
comes after the judged ones, in the fixed preference the table had before it had a bound: least
model parallelism, the smallest shard degree, the biggest micro batch. Rows that do not fit come
last, in that same preference.

Row K (1-based, in this order) is ``--pick K``: the overrides ``megafixed train`` and ``megafixed
submit`` take; ``submit --layout best`` applies row 1 (``best.best_layout``). Arithmetic over
the rows only: the rows (``rows``) and the bound (``bound``) import this, not the reverse.
"""
from __future__ import annotations

from ..errors import ConfigError


def _old_preference(e) -> tuple:
    # least model parallelism (cheapest communication; cp splits the model's work as tp does), least ZeRO
    # (0 and 1 move the same bytes) or, under FSDP2, the smallest shard degree, the biggest micro batch,
    # no SP, least memory
    lay = e.layout
    return (lay.tp * lay.pp * lay.cp, lay.planner.rank_sharding(lay), -lay.micro_batch, lay.sequence_parallel,
            e.total)


def not_judged(e, bound) -> str | None:
    """Why the step-time bound cannot rank row ``e`` (None: it can)."""
    if e.layout.pp > 1 and not e.pipeline:
        return "not judged: no model of this engine's pipeline stages (bubble, overlap) yet"
    if bound is None:
        return "not judged: no data sheet for this GPU or link (--gpu-type, --inter)"
    return None


def rank_key(e, bound, budget: float) -> tuple:
    """Fitting rows first; among them the judged ones by their bound, then by memory; then the
    unjudged ones and the rows that do not fit, each in the old preference."""
    fits = e.total <= budget
    if fits and not_judged(e, bound) is None:
        return (0, 0, bound["step_s_lower_bound"], e.total, _old_preference(e))
    return (0 if fits else 1, 1, 0.0, 0.0, _old_preference(e))


def ranked(rows: list, budget: float) -> list:
    """``rows`` (``PlanRow``s) in rank order."""
    return sorted(rows, key=lambda r: rank_key(r.estimate, r.step_time, budget))


LAYOUT_KEYS = ("parallel.tp", "parallel.pp", "parallel.sequence_parallel", "train.micro_batch", "parallel.cp")


def layout_keys(facts) -> tuple:
    """Every key a row sets: the engine-neutral ones and its engine's sharding (and split) keys (``facts``:
    the engine's ``EngineFacts``)."""
    return LAYOUT_KEYS + tuple(facts.layout_keys)


def overrides_of(layout, precision: str, config_precision: str) -> list[str]:
    """Row ``layout`` as ``section.key=value`` overrides (what ``megafixed train``/``submit`` take)."""
    out = [f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", *layout.planner.sharding_overrides(layout),
           f"train.micro_batch={layout.micro_batch}",
           f"parallel.sequence_parallel={'true' if layout.sequence_parallel else 'false'}", f"parallel.cp={layout.cp}"]
    if precision != config_precision:  # the plan sized another precision than the run would resolve
        out.append(f"train.precision={precision}")
    return out


def config_precision(cfg) -> str:
    """The precision the config's run resolves to on a GPU (``auto``: bf16)."""
    from ..run_plan import resolve_precision

    return resolve_precision(cfg, gpu=True)


def pick(rows: list, budget: float, k: int, cfg, precision: str, gib: float) -> list[str]:
    """Row ``k``'s overrides (``rows`` in rank order); a ConfigError (one line, exit 2) past the last
    row or for a row that does not fit."""
    fitting = sum(r.total <= budget for r in rows)
    if not 1 <= k <= len(rows):
        raise ConfigError(f"--pick {k}: the plan has {len(rows)} rows ({fitting} fit); pick a row "
                          f"from 1 to {max(fitting, 1)}")
    e = rows[k - 1].estimate
    if e.total > budget:
        hint = f"pick a row from 1 to {fitting}" if fitting else \
            "no layout fits: turn on train.activation_checkpointing, lower data.seq_len, or add GPUs"
        raise ConfigError(f"--pick {k}: row {k} does not fit ({e.total / gib:.2f} GiB per GPU > "
                          f"{budget / gib:.0f} GiB); {hint}")
    return overrides_of(e.layout, precision, config_precision(cfg))
