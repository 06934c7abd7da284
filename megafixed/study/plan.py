"""Which runs a study consists of, and where each one lives."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError


@dataclass(frozen=True)
class StudyRun:
    interface: str
    seed: int
    point: tuple = ()  # ((key, value), ...) of this grid point; () without --grid
    run_dir: Path = field(default=Path("."))

    @property
    def point_name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.point) or "base"

    @property
    def overrides(self) -> list[str]:
        """What makes this run differ from the study's base config. The seed is ``train.seed``:
        it sets the backbone init (paired across interfaces, see ``model.gpt.param_seed``) and the
        data order (identical across interfaces for the same seed)."""
        return [f"{k}={v}" for k, v in self.point] + [f"model.input={self.interface}", f"train.seed={self.seed}",
                                                      f"train.run_dir={self.run_dir}"]


def parse_list(text: str, what: str, cast=str) -> list:
    """``what`` is the flag (``--seeds``, ``--grid model.n_layers``): every error names it."""
    from ..arglists import parse_list as parse

    return parse(text, what, cast, example={int: "0,1,2"}.get(cast, "a,b"))


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``["model.n_layers=2,4", "train.max_steps=300,1200"]`` -> [(key, [values]), ...]."""
    grid = []
    for spec in specs or []:
        if "=" not in spec or "." not in spec.split("=", 1)[0]:
            raise ConfigError(f"--grid {spec!r} must look like section.key=V1,V2 (e.g. model.n_layers=2,4,8)")
        key, values = spec.split("=", 1)
        grid.append((key.strip(), parse_list(values, f"--grid {key}")))
    keys = [k for k, _ in grid]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--grid names a key twice: {keys}")
    return grid


def plan_runs(out: Path, interfaces: list[str], seeds: list[int], grid: list[tuple[str, list[str]]]) -> list[StudyRun]:
    from ..model.interfaces import INTERFACES

    bad = [i for i in interfaces if i not in INTERFACES]
    if bad:
        raise ConfigError(f"--interfaces {','.join(bad)}: unknown; choose from {','.join(INTERFACES)}")
    if len(set(interfaces)) != len(interfaces) or len(set(seeds)) != len(seeds):
        raise ConfigError("--interfaces and --seeds must not repeat an entry")
    points = [tuple(zip([k for k, _ in grid], values)) for values in itertools.product(*[v for _, v in grid])]
    runs = []
    for point in points or [()]:
        # With a grid, one folder per point (<out>/model.n_layers=4/gf2-s0); without one the runs sit in
        # <out> itself (<out>/gf2-s0), as a user reading `--out runs/study` expects. A study started when
        # they went to <out>/base keeps that folder, so its finished runs are not trained again.
        legacy = out / "base"
        base = out / ",".join(f"{k}={v}" for k, v in point) if point else (legacy if legacy.is_dir() else out)
        for interface in interfaces:
            for seed in seeds:
                runs.append(StudyRun(interface, seed, point, base / f"{interface}-s{seed}"))
    return runs
