"""``megafixed bench kernels``: the token-code kernel against an embedding-table lookup.

Both sides produce the same ``(N, width)`` activations from the same ids. Traffic model:
fixed code = id bytes + N*width*elem written; table = that + N*width*elem of rows read. On CUDA the
timings come from ``triton.testing.do_bench`` (median and 20/80 % quantiles); on CPU a plain
timing loop over the torch reference is reported instead and labelled ``cpu-timing-loop``.
The result is JSON, printed and written to ``--out``.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megafixed.codes import make_code

HELP = "token-code kernel vs F.embedding (GB/s, JSON)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def add_arguments(p):
    p.add_argument("--n-tokens", type=int, default=None,
                   help="tokens per call (default 262144 on CUDA = 32 x 8192, 4096 on CPU)")
    p.add_argument("--width", type=int, default=2048, help="model width d")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--code", choices=["canonical", "gf2"], default="gf2")
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304, help="table rows for the F.embedding baseline")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms) / CPU warmup iterations")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) / CPU timed iterations")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_kernels.json"), help="JSON result path")


def _time_cpu(fn, warmup: int, rep: int) -> list[float]:
    """Median / 20 % / 80 % of per-call milliseconds, the same quantiles do_bench reports."""
    for _ in range(max(1, warmup)):
        fn()
    times = []
    for _ in range(max(1, rep)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    q = torch.tensor(times, dtype=torch.float64).quantile(torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
    return q.tolist()


def run(args) -> int:
    from megafixed.kernels.token_codes import HAVE_TRITON, token_codes

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    on_cuda = device.type == "cuda"
    n = args.n_tokens or (262144 if on_cuda else 4096)
    dtype = DTYPES[args.dtype]
    code = make_code(args.code, args.bits, seed=args.seed)
    code.check_vocab(args.vocab)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (n,), generator=gen).to(device)
    table = torch.randn(args.vocab, args.width, generator=gen).to(device=device, dtype=dtype)

    def fixed():
        return token_codes(ids, code, args.width, dtype, validate=False)

    def lookup():
        return F.embedding(ids, table)

    # A benchmark of a wrong kernel is worthless: check bit-identity with encode() first.
    same = torch.equal(fixed().view(_INT_VIEW[dtype]), code.encode(ids, args.width, dtype).view(_INT_VIEW[dtype]))
    if on_cuda and HAVE_TRITON:
        import triton.testing
        timer, fixed_path = "triton.testing.do_bench", "triton"
        t_fixed = triton.testing.do_bench(fixed, warmup=args.warmup, rep=args.rep, quantiles=[0.5, 0.2, 0.8])
        t_table = triton.testing.do_bench(lookup, warmup=args.warmup, rep=args.rep, quantiles=[0.5, 0.2, 0.8])
    else:
        timer, fixed_path = "cpu-timing-loop", "torch-reference"
        t_fixed = _time_cpu(fixed, args.warmup, args.rep)
        t_table = _time_cpu(lookup, args.warmup, args.rep)

    elem = torch.empty((), dtype=dtype).element_size()
    out_bytes = n * args.width * elem
    fixed_bytes = n * ids.element_size() + out_bytes
    table_bytes = fixed_bytes + out_bytes  # every output element is also a table element read

    def gbps(nbytes: int, ms: float) -> float:
        return nbytes / (ms * 1e-3) / 1e9

    result = {
        "bench": "kernels.token_codes", "timer": timer, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu",
        "fixed_path": fixed_path, "bit_identical_to_encode": bool(same),
        "n_tokens": n, "width": args.width, "dtype": args.dtype, "code": args.code, "bits": args.bits,
        "vocab": args.vocab, "id_dtype": str(ids.dtype),
        "fixed_ms_p50_p20_p80": t_fixed, "table_ms_p50_p20_p80": t_table,
        "fixed_bytes": fixed_bytes, "table_bytes": table_bytes,
        "fixed_gbps": gbps(fixed_bytes, t_fixed[0]), "table_gbps": gbps(table_bytes, t_table[0]),
        "speedup_fixed_over_table": t_table[0] / t_fixed[0],
        "torch": torch.__version__,
    }
    text = json.dumps(result, indent=2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)
    return 0 if same else 1
