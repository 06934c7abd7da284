"""The plan's rows: every layout of a config for N GPUs whose run plan builds, with its memory
estimate and the fields beside it (traffic, the step-time bound, a fake measurement), ranked."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..parallel.memory import Estimate, Layout


@dataclass
class PlanRow:
    """One layout of the plan: its memory ``estimate`` and its ``extras`` (``bound.row_extras``: the
    analytic traffic and step-time bound, the fake measurement once asked for), as the table and
    ``--json`` show them."""
    estimate: Estimate
    extras: dict = field(default_factory=dict)
    rank: int = 0  # its number in the ranked table (1: the first), once ranked (``plan_rows``)

    @property
    def layout(self) -> Layout:
        return self.estimate.layout

    @property
    def total(self) -> float:
        return self.estimate.total

    @property
    def step_time(self) -> dict | None:
        """The step-time bound's fields (None: no data sheet for the GPU or the links)."""
        return self.extras.get("step_time_estimate")


def parse_bytes(text: str) -> float:
    # one number (digits with at most one dot), then an optional unit: "1.2.3GB" is refused here
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--gpu-mem {text!r} must be a positive size like 80GB, 40GiB or 24G")
    # SI as the data sheets write it (80GB = 80e9 bytes); KiB/MiB/GiB/TiB are powers of 1,024
    unit = (m.group(2) or "GB").upper().rstrip("B")
    binary = unit.endswith("I")
    power = " KMGT".index(unit.rstrip("I") or " ")
    return float(m.group(1)) * (1024 if binary else 1000) ** power


def plan_rows(cfg, gpus: int, budget: float, precision: str, links) -> list[PlanRow]:
    """Every layout's row, in rank order (``rank.ranked``): what the table lists."""
    from ..parallel.memory import estimate
    from .bound import row_extras
    from .rank import ranked

    estimates = [estimate(cfg.model, cfg.data.seq_len, lay, precision)
                 for lay in feasible_layouts(cfg, gpus, precision=precision)]
    rows = ranked([PlanRow(e, row_extras(cfg, e, links, None, precision)) for e in estimates], budget)
    for i, row in enumerate(rows, 1):
        row.rank = i
    return rows


# Context-parallel sizes the plan tries: powers of two (the heads and the sequence must split by them;
# the run plan refuses the rest), up to a node's 8 GPUs beside tp 1 -- past that its all-to-alls cross
# nodes on every attention layer.
CP_SIZES = (1, 2, 4, 8)


def feasible_layouts(cfg, gpus: int, max_tp: int = 8, precision: str | None = None) -> list:
    """Every (tp, cp, pp, dp, zero, micro, sp) whose run plan builds, for ``gpus`` GPUs in ``precision``
    (None: the config's ``train.precision``, resolved for a GPU). Here, above the run plan, rather
    than in ``parallel.memory`` (which the run plan's layer sits on)."""
    from dataclasses import replace

    from ..engines import engine_kind

    planner = engine_kind(cfg.train.engine).planner
    out = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= min(gpus, max_tp)]
    for tp in tps:
        for cp in (c for c in CP_SIZES if gpus % (tp * c) == 0):
            for pp in range(1, gpus // (tp * cp) + 1):  # a pipeline's refusals are its run plan's (_builds)
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                for option in planner.sharding_options(dp):  # ZeRO stages; HSDP replicate degrees
                    for micro in (1, 2, 4, 8, 16, 32):
                        if micro * dp > cfg.train.global_batch:
                            continue
                        for sp in ((False, True) if tp > 1 else (False,)):
                            if _builds(cfg, planner, gpus, tp, pp, option, micro, sp, precision, cp):
                                for part in planner.pp_partitions(pp):  # the engine's pipeline splits to compare
                                    lay = planner.make_layout(cfg, tp, pp, dp, option, micro, sp, part)
                                    out.append(replace(lay, cp=cp, cp_method=cfg.parallel.cp_method))
    return out


def _builds(cfg, planner, gpus, tp, pp, option, micro, sp, precision, cp: int = 1) -> bool:
    """Whether the run plan of this variant of ``cfg`` builds (its layout rules and engine's refusals)."""
    import copy

    from ..config import apply_overrides
    from ..parallel.layout import LayoutError
    from ..run_plan import RunPlan

    c = copy.deepcopy(cfg)
    c.parallel.tp, c.parallel.pp, c.parallel.cp = tp, pp, cp
    if pp == 1:  # the config's pipeline schedule is for its pp > 1 rows; a run at pp 1 refuses one
        c.parallel.pp_schedule, c.parallel.vpp = "1F1B", 1
    apply_overrides(c, planner.sharding_overrides(planner.make_layout(cfg, tp, pp, gpus // (tp * cp * pp), option,
                                                                      micro, sp, cfg.parallel.pp_partition)))
    c.parallel.sequence_parallel, c.train.micro_batch = sp, micro
    c.train.precision = precision or c.train.precision
    c.parallel.backend = "auto"  # GPU memory is what is sized, whatever the config's backend
    try:
        RunPlan.build(c, gpus, gpu=True)
    except LayoutError:
        return False
    return True
