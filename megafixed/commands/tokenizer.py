"""``megafixed tokenizer {train,show}``: train a tokenizer on a corpus, or inspect one."""
from __future__ import annotations

import json

HELP = "train a tokenizer (sentencepiece or HF BPE/unigram) or show how one tokenizes text"


def add_arguments(p):
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    t = sub.add_parser("train", help="train a tokenizer; .model output -> sentencepiece, else HF tokenizer.json")
    t.add_argument("--input", nargs="+", required=True, help="corpus files or globs (.jsonl[.gz|.zst], .parquet, .txt)")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--type", choices=["bpe", "unigram"], default="bpe")
    t.add_argument("--output", required=True, help="PATH.model (sentencepiece) or PATH.json (HF tokenizers)")
    t.add_argument("--json-key", default="text")
    t.add_argument("--max-chars", type=int, default=200_000_000, help="train on at most this many characters")
    t.add_argument("--code-bits", type=int, default=None,
                   help="refuse a vocabulary larger than 2**BITS (runs with fixed token codes)")
    s = sub.add_parser("show", help="print vocab size, EOD id and the tokens of some text")
    s.add_argument("tokenizer")
    s.add_argument("--text", default="Fixed codes replace the embedding table.")


def run(args) -> int:
    from ..data.errors import check_vocab_fits
    from ..data.tokenizers import load_tokenizer, train_tokenizer

    if args.action == "train":
        if args.code_bits is not None:  # refuse before spending time on training
            check_vocab_fits(args.vocab_size, code_bits=args.code_bits, where="--vocab-size")
        path = train_tokenizer(args.input, args.output, args.vocab_size, kind=args.type, json_key=args.json_key,
                               max_chars=args.max_chars)
        tok = load_tokenizer(path)
        print(json.dumps({**tok.describe(), "vocab_size": tok.vocab_size, "eod_id": tok.eod_id}))
        return 0
    tok = load_tokenizer(args.tokenizer)
    ids = tok.encode(args.text)
    print(json.dumps({**tok.describe(), "vocab_size": tok.vocab_size, "eod_id": tok.eod_id}))
    print(f"{len(ids)} tokens: {ids}")
    print("pieces:", [tok.decode([i]) for i in ids])
    print("round trip ok:", tok.decode(ids) == args.text)
    return 0
