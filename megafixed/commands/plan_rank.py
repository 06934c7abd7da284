"""How ``megafixed plan`` orders its rows, and a row as the overrides a run takes.

The rows that fit are ranked by the plan's own step-time lower bound (``plan_fake.step_time_bound``:
the dense matmul FLOPs at the GPU's peak, stretched by the pipeline bubble where the engine models
its pipeline, against the collectives' bus bytes at the links' data-sheet bandwidth), fastest
first; equal bounds go to the row with less memory. A row the bound cannot judge (a pipeline whose
engine has no model of its stages' bubble: DeepSpeed's, so far; or a GPU/link with no data sheet)
comes after the judged ones, in the fixed preference the table had before it had a bound: least
model parallelism, the smallest shard degree, the biggest micro batch. Rows that do not fit come
last, in that same preference.

Row K (1-based, in this order) is ``--pick K``: the overrides ``megafixed train`` and ``megafixed
submit`` take; ``submit --layout best`` applies row 1 (``best_layout``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError


def _old_preference(e) -> tuple:
    # least model parallelism (cheapest communication), least ZeRO (0 and 1 move the same bytes) or,
    # under FSDP2, the smallest shard degree, the biggest micro batch, no SP, least memory
    lay = e.layout
    return (lay.tp * lay.pp, lay.planner.rank_sharding(lay), -lay.micro_batch, lay.sequence_parallel, e.total)


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


def ranked(estimates: list, extras: dict, budget: float) -> list:
    return sorted(estimates, key=lambda e: rank_key(e, extras[id(e)]["step_time_estimate"], budget))


LAYOUT_KEYS = ("parallel.tp", "parallel.pp", "parallel.sequence_parallel", "train.micro_batch")


def layout_keys(planner) -> tuple:
    """Every key a row sets: the engine-neutral ones and its engine's sharding (and split) keys."""
    return LAYOUT_KEYS + tuple(planner.LAYOUT_KEYS)


def overrides_of(layout, precision: str, config_precision: str) -> list[str]:
    """Row ``layout`` as ``section.key=value`` overrides (what ``megafixed train``/``submit`` take)."""
    out = [f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", *layout.planner.sharding_overrides(layout),
           f"train.micro_batch={layout.micro_batch}",
           f"parallel.sequence_parallel={'true' if layout.sequence_parallel else 'false'}"]
    if precision != config_precision:  # the plan sized another precision than the run would resolve
        out.append(f"train.precision={precision}")
    return out


def config_precision(cfg) -> str:
    """The precision the config's run resolves to on a GPU (``auto``: bf16)."""
    from ..run_plan import resolve_precision

    return resolve_precision(cfg, gpu=True)


def pick(estimates: list, budget: float, k: int, cfg, precision: str, gib: float) -> list[str]:
    """Row ``k``'s overrides; a ConfigError (one line, exit 2) past the last row or for a row that
    does not fit."""
    fitting = sum(e.total <= budget for e in estimates)
    if not 1 <= k <= len(estimates):
        raise ConfigError(f"--pick {k}: the plan has {len(estimates)} rows ({fitting} fit); pick a row "
                          f"from 1 to {max(fitting, 1)}")
    e = estimates[k - 1]
    if e.total > budget:
        hint = f"pick a row from 1 to {fitting}" if fitting else \
            "no layout fits: turn on train.activation_checkpointing, lower data.seq_len, or add GPUs"
        raise ConfigError(f"--pick {k}: row {k} does not fit ({e.total / gib:.2f} GiB per GPU > "
                          f"{budget / gib:.0f} GiB); {hint}")
    return overrides_of(e.layout, precision, config_precision(cfg))


@dataclass
class Choice:
    """The layout a plan chose for a run (``submit --layout best``), and which plan chose it."""
    overrides: list
    row: int
    fitting: int
    step_s_lower_bound: float | None
    total_gib: float
    plan: str  # the `megafixed plan` command line that lists this row first

    def as_dict(self) -> dict:
        return {"chosen_by": self.plan, "row": self.row, "rows_that_fit": self.fitting,
                "overrides": self.overrides, "step_s_lower_bound": self.step_s_lower_bound,
                "total_gib": round(self.total_gib, 3)}


def plan_rows(cfg, gpus: int, budget: float, precision: str, links) -> tuple[list, dict]:
    """(every layout's estimate in rank order, {id(estimate): its row extras}): what the table lists."""
    from ..parallel.memory import estimate
    from .plan import feasible_layouts
    from .plan_fake import row_extras

    estimates = [estimate(cfg.model, cfg.data.seq_len, lay, precision)
                 for lay in feasible_layouts(cfg, gpus, precision=precision)]
    extras = {id(e): row_extras(cfg, e, links, None, precision) for e in estimates}
    return ranked(estimates, extras, budget), extras


def best_layout(config: str, overrides: list, gpus: int, *, gpu_mem: str, gpu_type: str, gpus_per_node: int,
                inter: str) -> Choice:
    """Row 1 of ``megafixed plan`` for this run (``submit --layout best``); a ConfigError when a given
    override already sets a layout key, or when no layout fits."""
    import shlex
    from types import SimpleNamespace

    from ..config import load_config
    from ..engines import engine_kind
    from ..parallel.memory import GiB
    from .plan import parse_bytes

    cfg = load_config(config, overrides)
    planner = engine_kind(cfg.train.engine).hook("planner")
    given = {item.split("=", 1)[0].strip() for item in overrides}
    clash = sorted(given & set(layout_keys(planner)))
    if clash:
        raise ConfigError(f"--layout best chooses {', '.join(layout_keys(planner))} itself; drop the override "
                          f"{', '.join(clash)} or drop --layout best")
    budget = parse_bytes(gpu_mem)
    precision = config_precision(cfg)
    links = SimpleNamespace(gpu_type=gpu_type, gpus_per_node=gpus_per_node, inter=inter)
    rows, extras = plan_rows(cfg, gpus, budget, precision, links)
    fitting = [e for e in rows if e.total <= budget]
    if not fitting:
        raise ConfigError(f"--layout best: no layout of {gpus} GPUs x {budget / GiB:.0f} GiB fits this config; turn "
                          f"on train.activation_checkpointing, lower data.seq_len, or add GPUs "
                          f"(megafixed plan {config} --gpus {gpus} --all lists them)")
    e = fitting[0]
    bound = extras[id(e)]["step_time_estimate"]
    command = ["megafixed", "plan", config, *overrides, "--gpus", str(gpus), "--gpu-mem", gpu_mem,
               "--gpu-type", gpu_type, "--gpus-per-node", str(gpus_per_node), "--inter", inter,
               "--precision", precision]
    return Choice(overrides_of(e.layout, precision, precision), 1, len(fitting),
                  bound["step_s_lower_bound"] if bound and not_judged(e, bound) is None else None, e.total / GiB,
                  " ".join(shlex.quote(c) for c in command))
