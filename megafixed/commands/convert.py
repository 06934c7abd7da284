"""``megafixed convert CKPT OUT --tp T --pp P``: re-shard a checkpoint's weights for another layout.

CKPT is a run's ``checkpoints`` directory (its ``latest`` tag is used), a tag directory, or either
with ``--tag``. The weights of any (TP, PP) layout are gathered into a plain GPT state dict, then
written as a module-only DeepSpeed checkpoint for (T, P) under OUT (or, with ``--plain``, as one
``torch.save`` file a plain ``GPT.load_state_dict`` reads). Optimizer state is not converted; see
``megafixed.parallel.convert``.
"""
from __future__ import annotations

import sys

HELP = "gather a checkpoint of any TP/PP layout and re-shard its weights for another layout"


def add_arguments(p):
    p.add_argument("checkpoint", help="checkpoint directory (run_dir/checkpoints or a tag directory)")
    p.add_argument("out", help="output directory (or file with --plain)")
    p.add_argument("--tag", default=None, help="tag to read (default: the 'latest' file)")
    p.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    p.add_argument("--plain", action="store_true", help="write one plain GPT state dict file instead")


def run(args) -> int:
    import torch

    from ..parallel.convert import ConvertError, detect_layout, gather_state_dict, resolve_tag_dir, write_checkpoint

    try:
        tag_dir = resolve_tag_dir(args.checkpoint, args.tag)
        src = detect_layout(tag_dir)
        sd = gather_state_dict(tag_dir)
        if args.plain:
            torch.save(sd, args.out)
            print(f"{tag_dir} (TP {src[0]}, PP {src[1]}) -> plain state dict {args.out} ({len(sd)} tensors)")
            return 0
        out = write_checkpoint(sd, args.out, tp=args.tp, pp=args.pp)
    except (ConvertError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{tag_dir} (TP {src[0]}, PP {src[1]}) -> {out} (TP {args.tp}, PP {args.pp}); load it with "
          f"engine.load_checkpoint('{args.out}', load_module_only=True)")
    return 0
