"""Resume checks: rerunning ``megafixed train`` continues a run only if nothing that shaped its
weights changed -- the model, its fixed code, its data, its layout.

Each checkpoint tag directory holds ``run.json`` (written by rank 0 before ``latest`` moves): the
resolved config, with the GF(2) recoding's rows and shift spelled out, and the layout. On resume
``check_resume`` compares it with the new config *before* anything in the run directory is
touched (``config.yaml``, ``latest``, the checkpoint list, ``metrics.jsonl``), so a refused resume
changes nothing. Safe changes (more steps, other intervals, a new learning rate) are allowed and
reported.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..run.run_dir import RunDirectory
from ..run.run_record import (  # noqa: F401
    RUN_RECORD,
    ResumeError,
    plan_engine,
    read_run_record,
    record_engine,
    record_layout,
    run_record,
    write_run_record,
)
from .config_diff import DERIVED_KEYS, config_diff, resolved_cfg

# Keys whose change makes the checkpoint's weights mean something else. Everything else is safe.
FROZEN_PREFIXES = ("model.",)
FROZEN_KEYS = ("data.tokenizer", "data.prefixes", "data.weights", "data.seq_len", "data.split", "data.source",
               "data.source_json_key", "train.seed", "train.global_batch")


def _frozen(key: str) -> bool:
    return key.startswith(FROZEN_PREFIXES) or key in FROZEN_KEYS


def check_resume(record: dict, cfg, plan, tag_dir: Path) -> list[str]:
    """Raise ``ResumeError`` naming the first incompatible change; return the safe changes. ``plan``:
    this run's ``RunPlan`` (its layout: tp, pp, dp, zero_stage, precision)."""
    from .config_diff import flatten

    diff = config_diff(flatten(record.get("config", {})), resolved_cfg(cfg))
    old, new = {k: a for k, (a, _) in diff.items()}, {k: b for k, (_, b) in diff.items()}
    run_dir = Path(tag_dir).parent.parent
    check_engine(record, plan, tag_dir)
    frozen = [k for k in diff if _frozen(k)]
    # Lead with a key the user can have typed, the interface first (a code_seed matters only under gf2);
    # the rows and shift follow from model.input/code_seed/... and come last.
    frozen.sort(key=lambda k: (k in DERIVED_KEYS, k != "model.input"))
    if frozen:
        k = frozen[0]
        more = f" (and {', '.join(frozen[1:4])}{', ...' if len(frozen) > 4 else ''})" if len(frozen) > 1 else ""
        raise ResumeError(f"cannot resume {run_dir}: {k} changed from {old.get(k)!r} to {new.get(k)!r}{more} since "
                          f"checkpoint {Path(tag_dir).name}, whose weights were trained for the old value. Set it "
                          f"back (the run's {RunDirectory(run_dir).config_file} records every value), or start a "
                          f"new run with another train.run_dir")
    lay = record.get("layout")
    changed = layout_changes(record, plan)
    if changed:
        from ..engine import relayout_refusal

        now = current_layout(plan)
        why = relayout_refusal(lay, now)
        if why:
            raise ResumeError(
                f"cannot resume {run_dir} on a different layout ({'; '.join(changed)}): {why}. Resume with the "
                f"checkpoint's layout (tp={lay.get('tp')}, pp={lay.get('pp')}, dp={lay.get('dp')}, "
                f"{_zero(lay)}{lay.get('precision')}), or move only the weights with "
                f"`megafixed convert {Path(tag_dir).parent} OUT --tp {now['tp']} --pp {now['pp']}` and start a new "
                f"run from them")
    return [f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()] + [f"layout: {c}" for c in changed]


def check_engine(record: dict, plan, tag_dir: Path) -> None:
    """Refuse a checkpoint of the other engine: DeepSpeed's files and the torch engine's DCP files
    are different formats. Only the weights cross over (``train.init_from`` reads either)."""
    old, new = record_engine(record), plan_engine(plan)
    if old == new:
        return
    tag_dir = Path(tag_dir)
    raise ResumeError(f"cannot resume {tag_dir.parent.parent}: checkpoint {tag_dir.name} was written by "
                      f"train.engine={old} and this run has train.engine={new}, whose checkpoint files differ. Set "
                      f"train.engine={old} back to resume it, or start a new run from its weights with "
                      f"train.init_from={tag_dir} and another train.run_dir")


def _zero(lay: dict) -> str:
    return f"zero.stage={lay['zero_stage']}, " if "zero_stage" in lay else ""  # DeepSpeed records only


def current_layout(plan) -> dict:
    """The layout a run record keeps, from a ``RunPlan``."""
    return record_layout(plan)


def layout_changes(record: dict, plan) -> list[str]:
    """What differs between the checkpoint's layout and this run's, as ``key old -> new``; a change
    means a re-layout on load. DeepSpeed: the DP size counts only when a side partitions the
    optimizer (ZeRO >= 1), and a change means a universal resume. The torch engine: FSDP2 shards
    parameters and optimizer state over the DP ranks, so every DP/TP change is one, which DCP's
    resharding does on load; ``zero.*`` is not used by it."""
    lay = record.get("layout")
    if not lay:
        return []
    now = current_layout(plan)
    names = {"tp": "parallel.tp", "pp": "parallel.pp", "zero_stage": "zero.stage", "precision": "train.precision",
             "dp": "the data-parallel size (world size / (tp*pp))", "cp": "parallel.cp"}
    from ..engines import engine_kind

    keys = engine_kind(now["engine"]).layout_change_keys(plan, lay)
    absent = {"cp": 1}  # an axis a record names only when it splits
    old_new = {k: (lay.get(k, absent.get(k)), now.get(k, absent.get(k))) for k in keys}
    return [f"{names.get(k, k)} {a} -> {b}" for k, (a, b) in old_new.items() if a != b]


def check_run_dir_takes(cfg, plan) -> Optional[str]:
    """Run the trainer's resume check now (``megafixed submit``, before a job is queued; here, not in
    ``launch/``, so that launch/ never reaches up into train/): raise its ``ResumeError`` if the run
    directory's latest checkpoint does not fit ``cfg`` on ``plan``'s layout (a ``RunPlan``: it has
    the sizes a Topology's resume check reads). Returns the tag checked (None: a new run)."""
    rd = RunDirectory(cfg.train.run_dir)
    tag = rd.read_latest()
    if tag is None:
        return None
    record = read_run_record(rd.tag_dir(tag))
    if record is not None:
        check_resume(record, cfg, plan, rd.tag_dir(tag))
    return tag


def shrink_note(resume, topo) -> tuple[Optional[str], dict]:
    """A resume on fewer ranks than the checkpoint's (a requeued job back on fewer nodes, ``submit --nodes
    MIN-MAX``): the data-parallel degree is re-laid out and the global batch kept by accumulating more.
    Returns the one line that says so (None: no shrink) and what the run record keeps: ``nodes`` (the job's,
    under Slurm) and ``shrunk_from``."""
    import os

    nodes = os.environ.get("SLURM_JOB_NUM_NODES")
    record: dict = {"nodes": int(nodes)} if nodes else {}
    old = read_run_record(resume.tag_dir) if resume is not None else None
    lay = (old or {}).get("layout") or {}
    world = lay.get("tp", 1) * lay.get("pp", 1) * lay.get("dp", 1)
    if not lay or world <= topo.world_size:
        return None, record
    plan = topo.plan
    was = {"world": world, "dp": lay.get("dp"), "nodes": (old or {}).get("nodes")}
    record["shrunk_from"] = was
    where = f" on {was['nodes']} nodes" if was["nodes"] else ""
    now = f" on {nodes} nodes" if nodes else ""
    return (f"the job shrank: checkpoint {resume.tag} was written by {world} ranks{where} (dp {lay.get('dp')}), "
            f"this run has {topo.world_size}{now} (dp {plan.dp}); the global batch {plan.batch.global_batch} is "
            f"kept by accumulating {plan.batch.accum} micro batches per step"), record
