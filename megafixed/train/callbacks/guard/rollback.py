"""``guard.on_nonfinite=rollback`` / ``guard.on_spike=rollback``: reload the newest verified checkpoint
from before the bad step and go on without a restart, skipping the data from that checkpoint up to
the bad step plus ``guard.rollback_skip`` more (PaLM: restart ~100 steps earlier, skip 200-500 batches).

The window is written into the run directory (``skip.py``) before the run goes on, so a
resume, a requeue or a re-layout resume skips the same batches; a fresh run given the same steps as
``data.skip_steps`` reproduces the rolled-back run exactly (the checkpoint restores weights, Adam
moments, every rank's RNG and the guard's window; a skipped step consumes no RNG).
"""
from __future__ import annotations

from typing import Optional

from ....run.run_dir import tag_step


class BadStepError(RuntimeError):
    """A bad step the run cannot go on from (``stop``, or no rollback left): exit 1, one line."""


def newest_before(checkpointer, step: int) -> Optional[str]:
    """The newest checkpoint tag of this run whose step is below ``step`` (log numbering)."""
    tags = [t for t in checkpointer.run_dir.tags() if tag_step(t) < step]
    return max(tags, key=tag_step) if tags else None


def rollback_count(skips) -> int:
    return sum(1 for w in skips.windows() if w.get("reason", "").startswith("rollback"))


def roll_back(checkpointer, engine, verdict, skips, guard, topo, say) -> dict:
    """Reload the newest verified checkpoint before ``verdict.step`` (a damaged one is moved aside and the
    one before it tried: ``fallback.py``); mark the window skipped; return the checkpoint's client state
    (``guard``: the config's guard section). Raises ``BadStepError`` when ``guard.max_rollbacks`` are used
    up or no checkpoint precedes the bad step."""
    from ...checkpoint import ResumePoint
    from ...fallback import newest_verified, set_aside

    done = rollback_count(skips)
    if done >= guard.max_rollbacks:
        raise BadStepError(f"{verdict.line(guard.spike_sigma, guard.spike_window)}; but this run already "
                           f"rolled back {done} time(s) (guard.max_rollbacks={guard.max_rollbacks}): it stops "
                           f"here, the last checkpoint is intact. Look at the data around the skipped steps "
                           f"({skips.file}), lower optimizer.lr or raise guard.max_rollbacks")
    checkpointer.wait(engine)  # a save in flight completes (and is committed) first
    tag = newest_before(checkpointer, verdict.step)
    if tag is None:
        raise BadStepError(f"{verdict.line(guard.spike_sigma, guard.spike_window)}; but no checkpoint "
                           f"precedes step {verdict.step} to roll back to: the run stops. Set a smaller "
                           f"checkpoint.interval, or {verdict.key()}=skip")
    rd = checkpointer.run_dir
    tag, damaged = newest_verified(rd, tag, rank=topo.rank, world=topo.world_size, strict=checkpointer.strict)
    checkpointer.note(fallbacks=set_aside(rd, damaged, tag, is_main=topo.is_main, world=topo.world_size,
                                          when="rollback", say=say))
    tag_dir = rd.tag_dir(tag)
    client = checkpointer.load(engine, ResumePoint(tag=tag, tag_dir=tag_dir))
    first, last = tag_step(tag) + 1, verdict.step + guard.rollback_skip
    skips.add_window(first, last, reason=f"rollback {done + 1}: {verdict.kind} {verdict.what} at step "
                     f"{verdict.step}", write=topo.is_main)
    say(f"rollback {done + 1}/{guard.max_rollbacks}: reloaded {tag_dir} (verified); steps {first}-{last} are "
        f"skipped (their batches consumed without training), recorded in {skips.file}")
    checkpointer.latest = tag
    return client
