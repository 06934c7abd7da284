"""``megafixed import hf HF_DIR OUT``: a transformers Llama/Arcee as a megafixed learned-interface checkpoint.

(The module is ``import_`` because ``import`` is a Python keyword; the verb is ``import``.)
OUT is shaped like a run directory: ``config.yaml`` plus ``checkpoints/imported`` (a module-only
DeepSpeed checkpoint), with the model's tokenizer files and ``generation_config.json`` (where
generation stops). ``megafixed generate OUT`` and ``megafixed export hf OUT`` read it, and
``megafixed train CONFIG train.init_from=OUT`` starts a new run from its weights.
"""
from __future__ import annotations

HELP = "import a Hugging Face Llama or Arcee model (safetensors + config.json) as a megafixed checkpoint"


def add_arguments(p):
    sub = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    hf = sub.add_parser("hf", help="a transformers LlamaForCausalLM or ArceeForCausalLM folder (GQA, tied or "
                                   "untied embeddings), e.g. megafixed's own export of an RMSNorm model",
                        description="Convert exactly, or refuse naming the option megafixed cannot represent "
                                    "(RoPE scaling, partial biases, sliding windows, head_dim != hidden/heads, ...).")
    hf.add_argument("source", metavar="HF_DIR", help="folder with config.json and model.safetensors")
    hf.add_argument("out", metavar="OUT_CHECKPOINT", help="folder to write (config.yaml + checkpoints/)")
    hf.add_argument("--overwrite", action="store_true", help="replace an existing OUT_CHECKPOINT")


def run(args) -> int:
    from ..interop.hf import import_hf

    import_hf(args.source, args.out, overwrite=args.overwrite)
    return 0
