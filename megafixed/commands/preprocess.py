"""``megafixed preprocess``: corpora -> Megatron .bin/.idx shards (flags follow Megatron's script)."""
from __future__ import annotations

import argparse
import json

HELP = "tokenize corpora (.jsonl/.gz/.zst, .parquet, .txt) into Megatron .bin/.idx shards"


def add_arguments(p):
    p.add_argument("--input", nargs="+", required=True, help="files or globs")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="fields to tokenize (parquet: columns); several keys -> PREFIX_<key> outputs")
    p.add_argument("--tokenizer", "--tokenizer-model", required=True,
                   help=".model, tokenizer.json, or a GPT-2 vocab.json+merges.txt dir")
    p.add_argument("--output-prefix", required=True,
                   help="writes PREFIX.bin/.idx (+ .meta.json); several keys -> PREFIX_<key>; note Megatron's "
                        "script would name it PREFIX_<key>_document")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="end every document with the EOD token (default on; GPT samples cross documents)")
    p.add_argument("--shard-size-mb", type=float, default=None,
                   help="roll to PREFIX_00000, PREFIX_00001, ... at document boundaries past this size")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of counting it")
    p.add_argument("--text-split", choices=["paragraph", "line", "file"], default="paragraph",
                   help="how plain-text files divide into documents")
    p.add_argument("--code-bits", type=int, default=None,
                   help="refuse a tokenizer with more than 2**BITS ids (runs with fixed token codes)")
    p.add_argument("--batch-size", type=int, default=256, help="records per worker task")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report", default=None, help="also write the report as JSON here")


def run(args) -> int:
    from ..data.preprocess import PreprocessOptions, preprocess

    report = preprocess(PreprocessOptions(
        inputs=args.input, output_prefix=args.output_prefix, tokenizer=args.tokenizer, json_keys=args.json_keys,
        workers=args.workers, append_eod=args.append_eod, shard_size_mb=args.shard_size_mb, strict=args.strict,
        text_split=args.text_split, code_bits=args.code_bits, batch_records=args.batch_size,
        progress=not args.no_progress))
    print(report.summary())
    if args.report:
        with open(args.report, "w") as fh:
            json.dump(report.to_dict(), fh, indent=1)
    return 0
