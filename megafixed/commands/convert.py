"""``megafixed convert CKPT OUT --tp T --pp P``: re-shard a checkpoint's weights for another layout.

CKPT is a run's ``checkpoints`` directory (its ``latest`` tag is used), a tag directory, or either
with ``--tag``. The weights of any (TP, PP) layout, of either engine (a torch-engine DCP checkpoint of
any DP/FSDP/TP layout too), are gathered into a plain GPT state dict, then
written as a module-only DeepSpeed checkpoint for (T, P) under OUT (or, with ``--plain``, as one
``torch.save`` file a plain ``GPT.load_state_dict`` reads). Optimizer state is not converted; see
``megafixed.engine.weights``.
"""
from __future__ import annotations

from ..trust.flag import add_trust_run_dir, check_source

HELP = "gather a checkpoint of any TP/PP layout and re-shard its weights for another layout"


def add_arguments(p):
    p.add_argument("checkpoint", help="checkpoint directory (run_dir/checkpoints or a tag directory)")
    p.add_argument("out", nargs="?", default=None,
                   help="output directory (or file with --plain); never the run's own checkpoints/. With "
                        "--universal it may be left out: the universal checkpoint then goes to <tag>/universal, "
                        "where `megafixed train` on another layout finds and reuses it")
    p.add_argument("--tag", default=None, help="tag to read (default: the 'latest' file)")
    p.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    p.add_argument("--plain", action="store_true", help="write one plain GPT state dict file instead")
    p.add_argument("--universal", action="store_true",
                   help="write DeepSpeed's universal checkpoint instead: weights AND optimizer state (ZeRO 1/2), "
                        "loadable on any TP/PP/DP layout (DeepSpeed config checkpoint.load_universal)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (never the input)")
    add_trust_run_dir(p)


def run(args) -> int:
    import torch

    from ..atomic import atomic_path
    from ..engine.weights import (
        ConvertError,
        check_target_layout,
        detect_layout,
        gather_state_dict,
        recorded_model_config,
        resolve_tag_dir,
        write_checkpoint,
    )
    from ..outputs import claim_output, ensure_parent, writing

    if args.tp < 1 or args.pp < 1:  # cheap checks before reading gigabytes
        raise ConvertError(f"--tp {args.tp} and --pp {args.pp} must both be >= 1")
    check_source(args.checkpoint, args)
    tag_dir = resolve_tag_dir(args.checkpoint, args.tag)
    if args.universal:
        return _universal(args, tag_dir)
    if args.out is None:
        raise ConvertError("give an output directory (OUT); only --universal may leave it out")
    inputs = [str(tag_dir), *(str(p) for p in tag_dir.iterdir())]
    claim_output([args.out], overwrite=args.overwrite, inputs=inputs, what="output")
    src = detect_layout(tag_dir)
    sd = gather_state_dict(tag_dir)
    if args.plain:
        with writing(files=[args.out]):
            ensure_parent(args.out)
            with atomic_path(args.out) as tmp:
                torch.save(sd, tmp)
        print(f"{tag_dir} (TP {src[0]}, PP {src[1]}) -> plain state dict {args.out} ({len(sd)} tensors)")
        return 0
    check_target_layout(sd, args.tp, args.pp, recorded_model_config(tag_dir))
    from ..run.manifest import derived
    from ..train.resume import read_run_record

    precision = ((read_run_record(tag_dir) or {}).get("layout") or {}).get("precision")
    layout = {"tp": args.tp, "pp": args.pp, "dp": 1, "zero_stage": 0, **({"precision": precision} if precision else {})}
    meta, record = derived(tag_dir, layout, converted_from=str(tag_dir.resolve()))
    with writing(dirs=[args.out]):
        out = write_checkpoint(sd, args.out, tp=args.tp, pp=args.pp, run_record=record, meta=meta)
    print(f"{tag_dir} (TP {src[0]}, PP {src[1]}) -> {out} (TP {args.tp}, PP {args.pp}); load it with "
          f"engine.load_checkpoint('{args.out}', load_module_only=True)")
    return 0


def _universal(args, tag_dir) -> int:
    """ZeRO-1/2 checkpoint -> DeepSpeed universal checkpoint (``megafixed.engine.deepspeed.universal``)."""
    from pathlib import Path

    from ..config import config_from_dict
    from ..engine.weights import ConvertError
    from ..outputs import claim_output, writing
    from ..train.resume import read_run_record

    record = read_run_record(tag_dir)
    if not record or "config" not in record:
        raise ConvertError(f"{tag_dir} has no run.json (written by `megafixed train`), so the model it belongs to "
                           f"is unknown; --universal converts checkpoints of megafixed runs only")
    from ..engine import prepare_runtime_env
    from ..engine.weights import to_relayout_format as to_universal

    prepare_runtime_env()
    model_cfg = config_from_dict(record["config"]).model
    if args.out is None:  # beside the checkpoint, where the trainer looks for it: ours to write
        out = to_universal(tag_dir, model_cfg, log=lambda *_: None)
    else:
        inputs = [str(tag_dir), *(str(p) for p in tag_dir.iterdir())]
        claim_output([args.out], overwrite=args.overwrite, inputs=inputs, what="output")
        with writing(dirs=[args.out]):
            out = to_universal(tag_dir, model_cfg, out=Path(args.out), log=lambda *_: None)
    lay = record.get("layout") or {}
    print(f"{tag_dir} (TP {lay.get('tp')}, PP {lay.get('pp')}, DP {lay.get('dp')}, ZeRO {lay.get('zero_stage')}) -> "
          f"universal checkpoint {out} (weights and optimizer state; loads on any layout with DeepSpeed's "
          f"checkpoint.load_universal" + ("; `megafixed train` on a new layout reuses it)" if args.out is None
                                          else f": engine.load_checkpoint('{out.parent}', tag='{out.name}'))"))
    return 0
