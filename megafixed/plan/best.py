"""``megafixed submit --layout best``: the first row of ``megafixed plan`` for the job's GPUs, as the
overrides the job runs with, and a record of which plan chose it (``jobs.jsonl``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


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


def best_layout(config: str, overrides: list, gpus: int, *, gpu_mem: str, gpu_type: str, gpus_per_node: int,
                inter: str) -> Choice:
    """Row 1 of ``megafixed plan`` for this run (``submit --layout best``); a ConfigError when a given
    override already sets a layout key, or when no layout fits."""
    import shlex
    from types import SimpleNamespace

    from ..config import load_config
    from ..engines import engine_kind
    from ..parallel.memory import GiB
    from .rank import config_precision, layout_keys, not_judged, overrides_of
    from .rows import parse_bytes, plan_rows

    cfg = load_config(config, overrides)
    facts = engine_kind(cfg.train.engine).facts
    given = {item.split("=", 1)[0].strip() for item in overrides}
    clash = sorted(given & set(layout_keys(facts)))
    if clash:
        raise ConfigError(f"--layout best chooses {', '.join(layout_keys(facts))} itself; drop the override "
                          f"{', '.join(clash)} or drop --layout best")
    budget = parse_bytes(gpu_mem)
    precision = config_precision(cfg)
    links = SimpleNamespace(gpu_type=gpu_type, gpus_per_node=gpus_per_node, inter=inter)
    fitting = [r for r in plan_rows(cfg, gpus, budget, precision, links) if r.total <= budget]
    if not fitting:
        raise ConfigError(f"--layout best: no layout of {gpus} GPUs x {budget / GiB:.0f} GiB fits this config; turn "
                          f"on train.activation_checkpointing, lower data.seq_len, or add GPUs "
                          f"(megafixed plan {config} --gpus {gpus} --all lists them)")
    e, bound = fitting[0].estimate, fitting[0].step_time
    command = ["megafixed", "plan", config, *overrides, "--gpus", str(gpus), "--gpu-mem", gpu_mem,
               "--gpu-type", gpu_type, "--gpus-per-node", str(gpus_per_node), "--inter", inter,
               "--precision", precision]
    return Choice(overrides_of(e.layout, precision, precision), 1, len(fitting),
                  bound["step_s_lower_bound"] if bound and not_judged(e, bound) is None else None, e.total / GiB,
                  " ".join(shlex.quote(c) for c in command))
