"""Injected faults, for the tests and for a user's drill of a long run (Megatron core's
``fault_injector.py`` is the model): the config key ``faults.inject`` holds faults separated by ``;``, steps
numbered as in the logs (the first optimizer step is step 1):

* ``nan@STEP[:rank=R][:once]``: the loss of that step turns NaN on rank R (or on every rank) -- before its
  backward, so the gradients are NaN too, as a real overflow makes them;
* ``spike@STEP[:rank=R][:factor=F][:once]``: that loss is multiplied by F (default 1000), gradients with it;
* ``:once`` (nan and spike): only the step's first computation is hit, as a flaky device or a flipped bit
  would be; its re-computation (``guard.recheck``) is clean, so the fault is found transient.
  Without it the fault hits every computation of the step: a deterministic fault, as bad data is
  (Megatron core's ``--error-injection-type transient_error`` / ``persistent_error``);
* ``hang@STEP[:rank=R]``: the rank stops making progress before that step (the hang watchdog's drill);
* ``slow[:rank=R][:factor=F]``: every forward of the rank takes F times as long (default 3): a
  straggler, seen as compute (the straggler report's drill);
* ``exit@STEP[:rank=R]``: the rank dies (SIGKILL, as a lost node does) before that step.

Unset, ``FaultPlan.from_config`` returns None and the loop pays one ``is None`` test per step. A
malformed value is one ``InjectError`` line naming the bad fault and the grammar, and so is a drill that
cannot fire in this run (``FaultPlan.refusal``: a rank not below the world size, a step beyond
``train.max_steps``, a step a resumed run has already done -- unless its checkpoint was written under the
same drill, which a requeue goes on with): a drill that silently does nothing would be read as a fault
survived.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

KEY = "faults.inject"  # the config key a drill is given in (recorded in config.yaml like any other)
KINDS = ("nan", "spike", "hang", "slow", "exit")
DEFAULT_FACTOR = {"spike": 1000.0, "slow": 3.0}
ONCE = ("nan", "spike")  # the loss faults, which a re-computation of the step can tell apart
GRAMMAR = ("nan@STEP, spike@STEP, hang@STEP, exit@STEP or slow, each with optional :rank=R (and :factor=F for "
           "spike and slow, :once for nan and spike), separated by ';' -- e.g. "
           "faults.inject='nan@3:rank=1;spike@5:once;slow:rank=0:factor=2'")


class InjectError(ConfigError):
    """A malformed ``faults.inject``, or a drill that cannot fire (exit 2, one line)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: Optional[int]  # None: every step (slow)
    rank: Optional[int]  # None: every rank
    factor: float = 1.0
    once: bool = False  # only the step's first computation (a transient fault)

    def applies(self, rank: int, step: Optional[int] = None) -> bool:
        return (self.rank is None or self.rank == rank) and (step is None or self.step == step)

    def spelled(self) -> str:
        text = self.kind + (f"@{self.step}" if self.step is not None else "")
        text += f":rank={self.rank}" if self.rank is not None else ""
        text += f":factor={self.factor:g}" if self.kind in DEFAULT_FACTOR else ""
        return text + (":once" if self.once else "")

    def cannot_fire(self, world: int, max_steps: int, done: int) -> Optional[str]:
        """Why this fault can never happen in a run of ``world`` ranks that trains steps ``done + 1`` to
        ``max_steps`` (None: it can)."""
        if self.rank is not None and self.rank >= world:
            return f"rank {self.rank} is not below the world size {world} (ranks 0-{world - 1})"
        if self.step is not None and self.step > max_steps:
            return f"step {self.step} is beyond train.max_steps={max_steps}"
        if self.step is not None and self.step <= done:
            return f"step {self.step} is already done: this run resumes after step {done}"
        return None


def _bad(raw: str, part: str, why: str) -> InjectError:
    return InjectError(f"{KEY}={raw!r}: {part!r} {why}; expected {GRAMMAR}, or leave {KEY} unset")


def _number(raw: str, part: str, key: str, text: str, kind=int):
    try:
        value = kind(text)
    except ValueError:
        raise _bad(raw, part, f"has {key}={text!r}, not a number") from None
    if value < (0 if key == "rank" else 1) or value != value:
        raise _bad(raw, part, f"has {key}={text}, out of range")
    return value


def parse(raw: str) -> list[Fault]:
    """The faults named by ``raw`` (a ``faults.inject`` value), or InjectError naming the bad one."""
    faults = []
    for part in (p.strip() for p in raw.split(";")):
        if not part:
            continue
        head, *options = part.split(":")
        kind, at, step_text = head.partition("@")
        if kind not in KINDS:
            raise _bad(raw, part, f"is not a fault ({kind!r} is none of {', '.join(KINDS)})")
        if (kind == "slow") == bool(at):
            raise _bad(raw, part, "takes no @STEP" if kind == "slow" else "needs @STEP")
        step = _number(raw, part, "step", step_text) if at else None
        rank, factor, once = None, DEFAULT_FACTOR.get(kind, 1.0), False
        for opt in options:
            key, eq, value = opt.partition("=")
            if key == "once" and not eq and kind in ONCE:
                once = True
            elif key == "rank" and eq:
                rank = _number(raw, part, "rank", value)
            elif key == "factor" and eq and kind in DEFAULT_FACTOR:
                factor = _number(raw, part, "factor", value, float)
            else:
                raise _bad(raw, part, f"has an unknown option {opt!r}")
        faults.append(Fault(kind, step, rank, factor, once))
    if not faults:
        raise _bad(raw, raw, "names no fault")
    return faults


class FaultPlan:
    """This rank's share of the injected faults; the trainer and the engine's step ask it."""

    def __init__(self, faults: list[Fault], rank: int, say=print, raw: str = ""):
        self.every_rank, self.raw = list(faults), raw
        self.faults = [f for f in faults if f.applies(rank)]
        self.rank, self.say = rank, say
        self.slow = next((f.factor for f in self.faults if f.kind == "slow"), None)
        self.step, self.computation = 0, 0  # the step being computed, and which computation of it (1: the first)

    @classmethod
    def from_config(cls, inject: Optional[str], rank: int, say=print) -> Optional["FaultPlan"]:
        """``inject``: the ``faults.inject`` value (None or blank: no drill)."""
        raw = inject or ""
        return cls(parse(raw), rank, say, raw) if raw.strip() else None

    def refusal(self, world: int, max_steps: int, done: int) -> Optional[str]:
        """One line naming every fault (of any rank) that cannot fire in this run, or None."""
        bad = [(f, why) for f in self.every_rank for why in [f.cannot_fire(world, max_steps, done)] if why]
        if not bad:
            return None
        raw = self.raw or "; ".join(f.spelled() for f in self.every_rank)
        return (f"{KEY}={raw!r}: " + "; ".join(f"{f.spelled()!r} cannot fire: {why}" for f, why in bad)
                + f". A drill that cannot fire would test nothing; change it, or leave {KEY} unset")

    def _at(self, kind: str, step: int) -> Optional[Fault]:
        return next((f for f in self.faults if f.kind == kind and f.step == step
                     and not (f.once and self.computation > 1)), None)

    def loss_factor(self, step: int) -> Optional[float]:
        """What this rank's loss of (log) step ``step`` is multiplied by, or None: NaN for ``nan``."""
        if self._at("nan", step):
            return float("nan")
        spike = self._at("spike", step)
        return spike.factor if spike else None

    def before_step(self, step: int) -> None:
        """Before each computation of (log) step ``step`` on this rank (a re-check computes it again):
        ``exit`` and ``hang`` happen here, at the first."""
        self.computation = self.computation + 1 if step == self.step else 1
        self.step = step
        if self.computation > 1:
            return
        if self._at("exit", step):
            self._line(f"injected fault ({KEY}): rank {self.rank} dies (SIGKILL) before step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self._at("hang", step):
            self._line(f"injected fault ({KEY}): rank {self.rank} stops making progress before step {step}")
            while True:  # the main thread stays alive and silent; the hang watchdog's thread must notice
                time.sleep(1.0)

    def slow_down(self, seconds: float) -> None:
        """A forward that took ``seconds`` takes ``factor`` times as long (``slow``): the rank computes
        (spins), as a slower device would, rather than sleeps."""
        if self.slow and self.slow > 1:
            clock = time.process_time
            end = clock() + (self.slow - 1.0) * seconds
            while clock() < end:
                pass

    def _line(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)  # every rank: the faulty rank may not be rank 0

