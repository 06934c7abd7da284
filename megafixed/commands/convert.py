"""``megafixed convert CKPT OUT --tp T --pp P``: re-shard a checkpoint's weights for another layout.

CKPT is a run's ``checkpoints`` directory (its ``latest`` tag is used), a tag directory, or either
with ``--tag``. The weights of any (TP, PP) layout are gathered into a plain GPT state dict, then
written as a module-only DeepSpeed checkpoint for (T, P) under OUT (or, with ``--plain``, as one
``torch.save`` file a plain ``GPT.load_state_dict`` reads). Optimizer state is not converted; see
``megafixed.parallel.convert``.
"""
from __future__ import annotations

HELP = "gather a checkpoint of any TP/PP layout and re-shard its weights for another layout"


def add_arguments(p):
    p.add_argument("checkpoint", help="checkpoint directory (run_dir/checkpoints or a tag directory)")
    p.add_argument("out", help="output directory (or file with --plain); never the run's own checkpoints/")
    p.add_argument("--tag", default=None, help="tag to read (default: the 'latest' file)")
    p.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    p.add_argument("--plain", action="store_true", help="write one plain GPT state dict file instead")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (never the input)")


def run(args) -> int:
    import torch

    from ..atomic import atomic_path
    from ..outputs import claim_output, ensure_parent, writing
    from ..parallel.convert import (
        check_target_layout,
        detect_layout,
        gather_state_dict,
        recorded_model_config,
        resolve_tag_dir,
        write_checkpoint,
    )

    if args.tp < 1 or args.pp < 1:  # cheap checks before reading gigabytes
        from ..parallel.convert import ConvertError
        raise ConvertError(f"--tp {args.tp} and --pp {args.pp} must both be >= 1")
    tag_dir = resolve_tag_dir(args.checkpoint, args.tag)
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
    with writing(dirs=[args.out]):
        out = write_checkpoint(sd, args.out, tp=args.tp, pp=args.pp)
    print(f"{tag_dir} (TP {src[0]}, PP {src[1]}) -> {out} (TP {args.tp}, PP {args.pp}); load it with "
          f"engine.load_checkpoint('{args.out}', load_module_only=True)")
    return 0
