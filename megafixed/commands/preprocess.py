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
    p.add_argument("--batch-size", type=int, default=None,
                   help="records per batch (default 256 on the reference backend, 16384 on gigatoken)")
    p.add_argument("--chunk-mb", type=float, default=4.0,
                   help="at most this many MB of raw input per batch: memory stays flat on any corpus size")
    p.add_argument("--backend", choices=["auto", "gigatoken", "reference"], default="auto",
                   help="auto: gigatoken where a start-up check on the input shows the reference tokenizer's ids, "
                        "else HF tokenizers/sentencepiece (one line says why); gigatoken: refuse if not exact")
    p.add_argument("--verify-chars", type=int, default=65536,
                   help="characters of input the start-up check compares gigatoken and the reference on")
    p.add_argument("--max-record-bytes", type=int, default=None, metavar="BYTES",
                   help="a longer record (JSONL line, text line, paragraph or file) is a bad record, counted and "
                        "named, read through without holding it (default 64 MiB)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report", default=None, help="also write the report as JSON here")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing shards at --output-prefix (default: refuse to touch them)")
    from .preprocess_submit import add_arguments as add_submit_arguments

    add_submit_arguments(p)


def _check_numbers(args) -> None:
    from ..data.errors import DataError

    for flag, value, low in (("--workers", args.workers, 1), ("--batch-size", args.batch_size, 1),
                             ("--verify-chars", args.verify_chars, 0),
                             ("--max-record-bytes", args.max_record_bytes, 1)):
        if value is not None and value < low:
            raise DataError(f"{flag} {value} must be >= {low}")
    if not args.chunk_mb > 0:
        raise DataError(f"--chunk-mb {args.chunk_mb} must be > 0")
    if args.code_bits is not None and not 1 <= args.code_bits <= 31:
        raise DataError(f"--code-bits {args.code_bits} must be in 1..31")


def max_record_bytes(args) -> int:
    from ..data.readers import DEFAULT_MAX_RECORD_BYTES

    return args.max_record_bytes or DEFAULT_MAX_RECORD_BYTES


def output_files(prefix: str, json_keys: list) -> list:
    """Every file this run may write (or replace): per key PREFIX[_key].bin/.idx/.meta.json, plus
    the files of any sharded set already there (a re-run replaces those too)."""
    from ..data.indexed import bin_path, idx_path, meta_path, prefix_files

    prefixes = [prefix] if len(json_keys) == 1 else [f"{prefix}_{k}" for k in json_keys]
    return [f for p in prefixes for f in dict.fromkeys([bin_path(p), idx_path(p), meta_path(p), *prefix_files(p)])]


def run(args) -> int:
    from ..atomic import atomic_write_text
    from ..data.preprocess import PreprocessOptions, preprocess
    from ..data.readers import expand_inputs
    from ..outputs import check_prefix, claim_output, ensure_parent, writing

    _check_numbers(args)
    check_prefix(args.output_prefix)
    inputs = expand_inputs(list(args.input))
    if args.submit or args.dry_run:
        from ..data.tokenizers import load_tokenizer
        from .preprocess_submit import submit

        load_tokenizer(args.tokenizer)  # a bad tokenizer fails here, not in every array task
        return submit(args, inputs)
    outputs = output_files(args.output_prefix, args.json_keys) + ([args.report] if args.report else [])
    claim_output(outputs, overwrite=args.overwrite, inputs=[*inputs, args.tokenizer], what="output")
    with writing(files=outputs):  # ShardWriter makes the folder when the first document is written
        report = preprocess(PreprocessOptions(
            inputs=inputs, output_prefix=args.output_prefix, tokenizer=args.tokenizer, json_keys=args.json_keys,
            workers=args.workers, append_eod=args.append_eod, shard_size_mb=args.shard_size_mb, strict=args.strict,
            text_split=args.text_split, code_bits=args.code_bits, batch_records=args.batch_size,
            chunk_mb=args.chunk_mb, backend=args.backend, verify_chars=args.verify_chars,
            max_record_bytes=max_record_bytes(args), progress=not args.no_progress))
        if args.report:
            ensure_parent(args.report)
            atomic_write_text(args.report, json.dumps(report.to_dict(), indent=1))
    print(report.summary())
    return 0
