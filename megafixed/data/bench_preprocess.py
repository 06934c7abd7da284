"""Preprocessing throughput (tokens/s, MB/s for 1, 2, ... workers) and dataset index build time.

    megafixed bench preprocess --out bench_preprocess.json
    python tools/bench_preprocess.py --workers 1 2 4 --index-tokens 1e9

Input defaults to the bundled corpus and a 4096-vocab BPE tokenizer trained on it (cached in the
user cache, ``megafixed.paths.cache_dir``). ``--index-tokens N`` also times ``build_datasets`` + the first batches on a
synthetic N-token shard (a sparse .bin, so it costs no disk), which is what a 1e9-token run pays at
startup. Results go to stdout and, with ``--out``, to a JSON file.
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import time

import numpy as np

HELP = "preprocessing throughput per worker count (+ dataset index build time), as JSON"


def add_arguments(p):
    from . import BUNDLED_CORPUS

    p.add_argument("--input", nargs="+", default=[BUNDLED_CORPUS])
    p.add_argument("--tokenizer", default=None, help="default: a 4096 BPE trained on the input (cached)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--workers", type=int, nargs="+", default=None, help="default: 1, 2, 4 ... up to the CPU count")
    p.add_argument("--repeat", type=int, default=1, help="runs per worker count; the best is reported")
    p.add_argument("--index-tokens", type=float, default=0, help="also time index building at this many tokens")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--out", default=None, help="write the JSON here")


def _default_tokenizer(inputs: list[str], json_key: str) -> str:
    from .prepare import _default_cache, _stem
    from .tokenizers import train_tokenizer

    # the user cache, as the main job uses: never next to the input (which may be the install tree)
    path = os.path.join(_default_cache(inputs), f"{_stem(inputs[0])}.tok4096.json")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        train_tokenizer(inputs, path, 4096, json_key=json_key)
    return path


def bench_index(num_tokens: int, seq_len: int, doc_tokens: int = 1000) -> dict:
    """Time build_datasets and the first 64 samples on a synthetic shard of ``num_tokens`` tokens."""
    from types import SimpleNamespace

    from .gpt_dataset import build_datasets
    from .indexed import _write_index, bin_path, idx_path

    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "synthetic")
        n_docs = max(1, num_tokens // doc_tokens)
        lengths = np.full(n_docs, doc_tokens, dtype=np.int32)
        lengths[-1] += num_tokens - n_docs * doc_tokens
        _write_index(idx_path(prefix), np.dtype(np.uint16), lengths, np.arange(n_docs + 1, dtype=np.int64))
        with open(bin_path(prefix), "wb") as fh:
            fh.truncate(int(lengths.sum()) * 2)  # sparse: no disk, reads as zeros
        cfg = SimpleNamespace(prefixes=[prefix, prefix], weights=[0.7, 0.3], split="98,1,1", seq_len=seq_len,
                              cache_dir=None)
        t0 = time.perf_counter()
        ds = build_datasets(cfg, seed=0)
        t_build = time.perf_counter() - t0
        t0 = time.perf_counter()
        ds = build_datasets(cfg, seed=0)
        t_cached = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(64):
            ds["train"][i]
        t_first = time.perf_counter() - t0
        return {"tokens": int(num_tokens), "documents": int(n_docs), "seq_len": seq_len,
                "train_samples_per_epoch": len(ds["train"]), "build_s": round(t_build, 3),
                "build_cached_s": round(t_cached, 3), "first_64_samples_s": round(t_first, 3)}


def run(args) -> int:
    from .preprocess import PreprocessOptions, preprocess

    tokenizer = args.tokenizer or _default_tokenizer(args.input, args.json_key)
    cpus = os.cpu_count() or 1
    workers = args.workers or sorted({1, *[w for w in (2, 4, 8, 16, 32) if w <= cpus], cpus})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in workers:
            best = None
            for r in range(args.repeat):
                rep = preprocess(PreprocessOptions(args.input, os.path.join(tmp, f"w{w}_{r}"), tokenizer,
                                                   [args.json_key], workers=w, progress=False))
                if best is None or rep.seconds < best.seconds:
                    best = rep
            row = {"workers": w, "seconds": round(best.seconds, 3), "documents": best.documents,
                   "tokens": best.tokens, "input_mb": round(best.input_bytes / 1e6, 3),
                   "tokens_per_s": round(best.tokens / best.seconds),
                   "mb_per_s": round(best.input_bytes / 1e6 / best.seconds, 3),
                   "docs_per_s": round(best.documents / best.seconds)}
            rows.append(row)
            print(json.dumps(row))
    result = {"benchmark": "preprocess", "inputs": args.input, "tokenizer": tokenizer, "cpus": cpus,
              "load_average_1m": round(os.getloadavg()[0], 2),  # other work on the machine skews the figures
              "machine": platform.platform(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "results": rows}
    if args.index_tokens:
        result["index"] = bench_index(int(args.index_tokens), args.seq_len)
        print(json.dumps(result["index"]))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.out}")
    return 0
