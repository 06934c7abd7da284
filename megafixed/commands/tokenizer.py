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
    t.add_argument("--overwrite", action="store_true",
                   help="replace an existing tokenizer at --output (shards written with it become undecodable)")
    s = sub.add_parser("show", help="print vocab size, EOD id and the tokens of some text")
    s.add_argument("tokenizer")
    s.add_argument("--text", default="Fixed codes replace the embedding table.")


def run(args) -> int:
    from ..data.tokenizers import load_tokenizer

    if args.action == "train":
        path = _train(args)
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


def _train(args) -> str:
    """Train into --output under the shared overwrite policy; cheap checks first."""
    import os

    from ..data.errors import DataError, check_vocab_fits
    from ..data.readers import expand_inputs
    from ..data.tokenizers import train_tokenizer
    from ..outputs import claim_output, writing

    if args.max_chars < 1:
        raise DataError(f"--max-chars {args.max_chars} must be >= 1")
    if args.code_bits is not None:  # refuse before spending time on training
        if not 1 <= args.code_bits <= 31:
            raise DataError(f"--code-bits {args.code_bits} must be in 1..31")
        check_vocab_fits(args.vocab_size, code_bits=args.code_bits, where="--vocab-size")
    if args.output.endswith(("/", os.sep)) and not os.path.isdir(args.output):
        raise DataError(f"--output {args.output} names a folder that does not exist; give a file such as "
                        f"{args.output}tokenizer.json (HF) or {args.output}tok.model (sentencepiece)")
    inputs = expand_inputs(list(args.input))
    out = os.path.join(args.output, "tokenizer.json") if os.path.isdir(args.output) else args.output
    outputs = [out] + ([out[: -len(".model")] + ".vocab"] if out.endswith(".model") else [])
    claim_output(outputs, overwrite=args.overwrite, inputs=inputs, what="--output")
    with writing(files=outputs):
        return train_tokenizer(inputs, out, args.vocab_size, kind=args.type, json_key=args.json_key,
                               max_chars=args.max_chars, exact_vocab=True)
