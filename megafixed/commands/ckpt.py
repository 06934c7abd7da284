"""``megafixed ckpt inspect RUN_OR_CHECKPOINT [--json]``: what a checkpoint holds, and whether it is intact.

RUN_OR_CHECKPOINT is a run directory (its ``checkpoints/latest`` is shown), a checkpoints
directory, or one tag directory. Shown: the layout, the step, the samples and tokens seen, the
input interface and its fixed code, the parameter count, each file's size, the git revision that
wrote it, and whether the files match the manifest (the first missing or corrupt file is named;
exit 1 then). Everything comes from ``run.json`` and ``manifest.json``; no tensor is loaded.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..run.save_faults import human_size
from ..trust.flag import add_trust_run_dir, check_source

HELP = "inspect a checkpoint: layout, step, tokens, input code, parameters, file sizes, manifest check"


def add_arguments(p):
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    i = sub.add_parser("inspect", help="layout, step, tokens seen, input code, parameters, files, manifest check")
    i.add_argument("path", help="a run directory, its checkpoints/ directory, or one step_* tag directory")
    i.add_argument("--json", action="store_true", help="print the same as JSON")
    add_trust_run_dir(i)


def resolve(path: str) -> Path:
    """The tag directory ``path`` names (a run dir or checkpoints dir means its ``latest``)."""
    from ..run.run_dir import LATEST, RUN_RECORD, RunDirectory
    from ..train.checkpoint import CheckpointError, read_latest

    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory; pass a run directory, its checkpoints/ or a step_* tag")
    for ckpt_dir in (RunDirectory(root).checkpoints, root):
        if (ckpt_dir / LATEST).exists():
            return ckpt_dir / read_latest(ckpt_dir)
    # a tag of either engine: DeepSpeed's model files, or the torch engine's DCP index (.metadata)
    if (root / RUN_RECORD).exists() or any(root.glob("*model_states.pt")) or (root / ".metadata").is_file():
        return root
    raise CheckpointError(f"{root} holds no checkpoint (no checkpoints/latest, latest, run.json, "
                          f"*model_states.pt or .metadata); pass a run directory, its checkpoints/ or a step_* tag "
                          f"directory")


def inspect(tag_dir: Path) -> dict:
    from ..config import config_from_dict
    from ..model.interfaces import interface_of
    from ..model.params import count_params
    from ..run import manifest
    from ..train.checkpoint import CheckpointError, tag_step
    from ..train.resume import read_run_record

    man = manifest.read(tag_dir)
    record = read_run_record(tag_dir) or {}
    out: dict = {"checkpoint": str(tag_dir), "tag": tag_dir.name}
    if man is not None:
        out.update({k: man[k] for k in ("step", "consumed_samples", "consumed_tokens", "layout", "code",
                                        "parameters", "git_revision") if k in man})
    else:  # a checkpoint from before manifests: what its run record says
        out["step"] = tag_step(tag_dir.name)
        out["layout"] = record.get("layout")
        if record.get("config"):
            cfg = config_from_dict(record["config"])
            m = cfg.model
            out["code"] = interface_of(m).describe(m)  # what a manifest would have recorded
            out["parameters"] = count_params(m).total
    if man is not None:
        out["files"] = {e["name"]: e["size"] for e in man["files"]}
    else:
        out["files"] = {str(p.relative_to(tag_dir)): p.stat().st_size for p in sorted(tag_dir.rglob("*"))
                        if p.is_file() and not str(p.relative_to(tag_dir)).startswith("universal")}
    out["total_bytes"] = sum(out["files"].values())
    out["universal"] = (tag_dir / "universal" / ".complete").exists()
    try:  # the readers' own check: a run record without a manifest is refused here too
        verified = manifest.verify_for_reading(tag_dir, warn=lambda _line: None)
        out["manifest"] = ({"ok": True, "problem": None} if verified is not None else
                           {"ok": None, "problem": "no manifest.json (written before manifests existed)"})
    except CheckpointError as exc:
        out["manifest"] = {"ok": False, "problem": str(exc)}
    return out


def run(args) -> int:
    check_source(args.path, args)
    info = inspect(resolve(args.path))
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        lay = info.get("layout") or {}
        code = info.get("code") or {}
        tokens = info.get("consumed_tokens")
        print(f"checkpoint  {info['checkpoint']}")
        print(f"step        {info.get('step')}")
        print(f"seen        {info.get('consumed_samples', '?')} samples, "
              f"{tokens if tokens is not None else '?'} tokens")
        print("layout      " + (", ".join(f"{k} {v}" for k, v in lay.items()) or "unknown"))
        code_text = ", ".join(f"{k} {v}" for k, v in code.items() if k != "input")
        print(f"input       {code.get('input', '?')}" + (f" ({code_text})" if code_text else ""))
        print(f"parameters  {info.get('parameters', '?'):,}" if isinstance(info.get("parameters"), int)
              else "parameters  ?")
        print(f"git         {info.get('git_revision', 'unknown')}")
        print(f"files       {len(info['files'])}, {human_size(info['total_bytes'])}"
              + ("; universal checkpoint converted" if info["universal"] else ""))
        for name, size in info["files"].items():
            print(f"  {size:>14,}  {name}")
        m = info["manifest"]
        print("manifest    " + ("verified" if m["ok"] else ("NOT verified: " + m["problem"]) if m["ok"] is False
                                else m["problem"]))
    return 0 if info["manifest"]["ok"] is not False else 1
