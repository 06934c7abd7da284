"""``megafixed data {inspect,merge}``: look into token shards, or concatenate them."""
from __future__ import annotations

import json

import numpy as np

from ..data.errors import DataError

HELP = "inspect token shards (counts, dtype, first documents) or merge shards into one"


def add_arguments(p):
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    i = sub.add_parser("inspect", help="document / sequence / token counts, dtype, first documents")
    i.add_argument("prefix", help="shard prefix (or the prefix of a sharded set)")
    i.add_argument("--tokenizer", default=None, help="decode documents (default: the one recorded at preprocessing)")
    i.add_argument("--docs", type=int, default=3, help="how many documents to show")
    i.add_argument("--chars", type=int, default=300, help="characters shown per document")
    i.add_argument("--json", action="store_true", help="print the statistics as JSON")
    m = sub.add_parser("merge", help="concatenate shards (documents keep their order)")
    m.add_argument("--inputs", nargs="+", required=True, help="shard prefixes (sharded sets expand)")
    m.add_argument("--output-prefix", required=True)
    m.add_argument("--overwrite", action="store_true",
                   help="replace existing shards at --output-prefix (never one of the inputs)")


def run(args) -> int:
    from ..data.indexed import IndexedShard
    from ..data.prefixes import resolve_prefix

    if args.action == "merge":
        return _merge(args)
    for flag, value in (("--docs", args.docs), ("--chars", args.chars)):
        if value < 0:
            raise DataError(f"{flag} {value} must be >= 0")
    shards = [IndexedShard(p) for p in resolve_prefix(args.prefix)]
    lengths = np.concatenate([np.asarray(s.lengths) for s in shards]) if shards else np.zeros(0)
    meta = shards[0].meta()
    stats = {"prefix": args.prefix, "shards": len(shards), "dtype": str(shards[0].dtype),
             "documents": sum(s.num_documents for s in shards), "sequences": sum(s.num_sequences for s in shards),
             "tokens": sum(s.num_tokens for s in shards),
             "tokens_per_doc": {"mean": float(lengths.mean()) if lengths.size else 0.0,
                                "min": int(lengths.min()) if lengths.size else 0,
                                "max": int(lengths.max()) if lengths.size else 0},
             "tokenizer": meta.get("tokenizer"), "append_eod": meta.get("append_eod")}
    if args.json:
        print(json.dumps(stats, indent=1))
    else:
        for k, v in stats.items():
            if k == "tokens_per_doc":  # a mean length to 1 decimal; --json keeps the full float
                v = f"mean {v['mean']:,.1f}, min {v['min']:,}, max {v['max']:,}"
            print(f"{k:>15}: {v}")
    tok_spec = args.tokenizer or meta.get("tokenizer")
    if not shards[0].num_documents:
        print("(no documents)")
    elif args.docs and tok_spec:
        from ..data.tokenizers import load_tokenizer

        tok = load_tokenizer(tok_spec)
        _check_same_tokenizer(tok, meta, args)
        for d in range(min(args.docs, shards[0].num_documents)):
            ids = shards[0].document(d)
            text = tok.decode(ids)
            more = "..." if len(text) > args.chars else ""
            print(f"--- document {d} ({len(ids)} tokens)\n{text[: args.chars]}{more}")
    elif args.docs:
        print(f"(pass --tokenizer to decode; first ids of document 0: {shards[0].document(0)[:20].tolist()})")
    return 0


def _merge(args) -> int:
    from ..data.indexed import merge_shards, prefix_files
    from ..data.prefixes import resolve_prefix
    from ..outputs import check_prefix, claim_output, writing
    from .preprocess import output_files

    check_prefix(args.output_prefix)
    prefixes = [s for p in args.inputs for s in resolve_prefix(p)]
    outputs = output_files(args.output_prefix, ["text"])
    claim_output(outputs, overwrite=args.overwrite, inputs=[f for p in prefixes for f in prefix_files(p)],
                 what="--output-prefix")
    with writing(files=outputs):
        print(json.dumps(merge_shards(prefixes, args.output_prefix)))
    return 0


def _check_same_tokenizer(tok, meta: dict, args) -> None:
    """Decoding ids with another tokenizer prints fluent-looking garbage; refuse it instead."""
    from ..data.tokenizers import tokenizer_sha256

    recorded = meta.get("tokenizer")
    sha = meta.get("tokenizer_sha256")
    if sha and tokenizer_sha256(tok) != sha:
        if args.tokenizer:
            raise DataError(f"--tokenizer {args.tokenizer} is not the tokenizer {args.prefix} was written with "
                            f"({(recorded or {}).get('path')}); decoding would show garbage: drop --tokenizer")
        raise DataError(f"tokenizer {tok.path} changed since {args.prefix} was written (its contents differ); "
                        f"restore the original, or re-run `megafixed preprocess` with the new one")
    vocab = meta.get("vocab_size")
    if vocab is not None and int(vocab) != tok.vocab_size:
        raise DataError(f"{args.prefix} was written with a {vocab}-token tokenizer but {tok.path} has "
                        f"{tok.vocab_size}; pass the tokenizer the shards were written with")
