"""The process grid as named axes: sizes, a rank's coordinates, and the ranks of each group.

Axes are kept in megatron-core's order ``tp-cp-ep-dp-pp``, the first varying fastest::

    rank = tp_rank + tp * (cp_rank + cp * (ep_rank + ep * (dp_rank + dp * pp_rank)))

which for the axes we build today (tp, dp, pp) is DeepSpeed's ``PipeModelDataParallelTopology``
order too (pipe, data, model; model fastest). A grid holds only the axes a run names; an absent
axis has size 1 and coordinate 0, so adding one (context parallelism: ``cp``) is one more entry
and changes no other rank's coordinates. torchtitan's ``ParallelDims`` is the same idea.

Pure arithmetic, no torch: the run plan builds it on a login node, before any process group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

# megatron-core's default order (parallel_state.initialize_model_parallel(order="tp-cp-ep-dp-pp")).
GRID_ORDER = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class ParallelDims:
    """Named axis sizes in grid order, e.g. ``(("tp", 2), ("dp", 2), ("pp", 2))``."""
    axes: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, **sizes: int) -> "ParallelDims":
        """The grid of these axes (any order given; stored in ``GRID_ORDER``)."""
        unknown = sorted(set(sizes) - set(GRID_ORDER))
        if unknown:
            raise ValueError(f"unknown parallel axis {', '.join(unknown)}; known: {', '.join(GRID_ORDER)}")
        bad = {n: s for n, s in sizes.items() if not isinstance(s, int) or s < 1}
        if bad:
            raise ValueError(f"parallel axis sizes must be integers >= 1, got {bad}")
        return cls(tuple((n, sizes[n]) for n in GRID_ORDER if n in sizes))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    def size(self, name: str) -> int:
        """The size of an axis; 1 for an axis this grid does not name."""
        if name not in GRID_ORDER:
            raise ValueError(f"unknown parallel axis {name!r}; known: {', '.join(GRID_ORDER)}")
        return dict(self.axes).get(name, 1)

    @property
    def tp(self) -> int:
        return self.size("tp")

    @property
    def cp(self) -> int:
        return self.size("cp")

    @property
    def dp(self) -> int:
        return self.size("dp")

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self.axes)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on every axis of ``GRID_ORDER`` (0 on the axes the grid lacks)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        out = dict.fromkeys(GRID_ORDER, 0)
        for name, size in self.axes:  # fastest first
            out[name], rank = rank % size, rank // size
        return out

    def rank_of(self, **coords: int) -> int:
        """The global rank at these coordinates (unnamed axes: 0)."""
        rank, stride = 0, 1
        for name, size in self.axes:
            c = coords.get(name, 0)
            if not 0 <= c < size:
                raise ValueError(f"{name} coordinate {c} is outside 0..{size - 1}")
            rank, stride = rank + c * stride, stride * size
        return rank

    def group_ranks(self, *names: str) -> list[list[int]]:
        """The rank lists of the groups spanning ``names`` (e.g. ``"tp"``; ``"tp", "pp"`` for one
        model replica), each sorted, the groups ordered by their first rank. These are the groups
        megatron-core's ``RankGenerator.get_ranks("tp-pp")`` makes."""
        for n in names:
            self.size(n)  # refuses unknown names
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(v for n, v in c.items() if n not in names)
            groups.setdefault(key, []).append(rank)
        return sorted(groups.values())

    def describe(self) -> str:
        """``tp 2 x dp 2 x pp 2`` (grid order)."""
        return " x ".join(f"{n} {s}" for n, s in self.axes)
