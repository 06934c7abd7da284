"""``megafixed export hf RUN_OR_CHECKPOINT OUT_DIR``: a trained run as a standard transformers model.

The folder loads with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
and no custom code; the architecture mapping and its refusals are in ``megafixed.interop.hf``.
"""
from __future__ import annotations

from ..trust.flag import add_trust_run_dir, check_source

HELP = "export a trained run as a Hugging Face transformers model folder (safetensors, config, tokenizer)"


def add_arguments(p):
    sub = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    hf = sub.add_parser("hf", help="transformers: Llama / Arcee / Starcoder2 / StableLM, whichever is exact",
                        description="Write OUT_DIR with model.safetensors, config.json, generation_config.json, "
                                    "the tokenizer and a README.md model card. Works from any TP/PP/ZeRO layout.")
    hf.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                    help="run directory, its checkpoints folder, or a tag directory under it")
    hf.add_argument("out", metavar="OUT_DIR", help="folder to write (refused if it exists, unless --overwrite)")
    hf.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="weight dtype (default fp32: exact; bf16 halves the size)")
    hf.add_argument("--tag", default=None, help="checkpoint tag (default: the run's latest)")
    hf.add_argument("--tokenizer", default=None,
                    help="tokenizer to export (default: the run's data.tokenizer, or the one its shards record)")
    hf.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    add_trust_run_dir(hf)


def run(args) -> int:
    from ..interop.hf import export_hf

    check_source(args.source, args)
    export_hf(args.source, args.out, dtype=args.dtype, tag=args.tag, tokenizer=args.tokenizer,
              overwrite=args.overwrite)
    return 0
