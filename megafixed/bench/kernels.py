"""``megafixed bench kernels``: the fixed-code input against embedding-table lookups, swept over shapes.

Providers (each a function ``ids -> [N, width]`` activations, built per shape):

* ``megafixed-canonical``, ``megafixed-gf2``: ``megafixed.kernels.token_codes`` (the Triton kernel on
  CUDA, the torch path on CPU), checked bit for bit against ``FixedCode.encode`` before timing;
* ``torch-embedding``: ``F.embedding`` on a ``V x width`` table (V = 49,152 by default);
* ``liger-embedding``: ``liger_kernel``'s ``LigerEmbedding`` when installed (CUDA only);
* ``torch-compile``: ``torch.compile`` of the gf2 ``encode``, also checked bit for bit.

Modes: ``forward``; ``full`` = forward + backward into the table + an AdamW step on the table for
the learned providers, against the fixed code at the same shape (which has no backward and no
optimizer: its full step is its forward). Bytes each provider must move (``bytes_moved``):

* fixed code, forward or full: id bytes + N*d*e written;
* table forward: that + N*d*e of rows read;
* table full: forward + backward (read dY: N*d*e; write the dense V*d gradient: V*d*e) + AdamW
  (read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq: 7*V*d*e).

GB/s = bytes / time. The practical peak is a device-to-device copy (read + write) measured in the
same run; the theoretical one is the data-sheet bandwidth (CUDA only). Timing: on CUDA
``triton.testing.do_bench`` (L2 flushed between calls, warm-up, quantiles 0.5/0.2/0.8); on CPU
``torch.utils.benchmark`` (``blocked_autorange``; quantiles over its blocks).

Output: JSON (every row + the copy peak + bit-identity results), a CSV in Liger-Kernel's benchmark
schema with ``bytes``, ``gbps``, ``pct_copy_peak`` and ``pct_spec_peak`` appended, and an optional
PNG of GB/s against tokens with the roofline drawn in.
"""
from __future__ import annotations

import csv
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .. import exit_codes
from ..codes import make_code

HELP = "fixed-code kernel vs embedding tables: sweep, GB/s, % of peak (JSON, CSV, PNG)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
FIXED = ("megafixed-canonical", "megafixed-gf2")
PROVIDERS = (*FIXED, "torch-embedding", "liger-embedding", "torch-compile")
LEARNED = ("torch-embedding", "liger-embedding")
MODES = ("forward", "full")
# Liger-Kernel's benchmark CSV columns (benchmark/data/all_benchmark_data.csv), then ours.
CSV_COLUMNS = ["kernel_name", "kernel_provider", "kernel_operation_mode", "metric_name", "metric_unit", "x_name",
               "x_label", "x_value", "y_value_50", "y_value_20", "y_value_80", "extra_benchmark_config_str",
               "gpu_name", "timestamp", "liger_version", "bytes", "gbps", "pct_copy_peak", "pct_spec_peak"]
KERNEL_NAME = "token_input"


class BitMismatch(RuntimeError):
    """A fixed-code provider disagrees with ``FixedCode.encode``: its timings would mean nothing."""


def _int_list(text: str, flag: str, example: str = "4k,16k") -> list[int]:
    from ..arglists import parse_sizes

    return parse_sizes(text, flag, example=example)


def add_arguments(p):
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--tokens", "--n-tokens", dest="tokens", default=None,
                   help="comma list of tokens per call (B*T); k/m suffixes = 1024/1024^2. Default: 4k,16k,64k,256k,1m "
                        "on CUDA, 4k,16k on CPU")
    p.add_argument("--width", default=None, help="comma list of widths d (default 1024,2048,4096,8192 on CUDA, "
                                                 "1024,2048 on CPU)")
    p.add_argument("--dtype", default=None, help="comma list of float32, bfloat16, float16 (default: bfloat16 on "
                                                 "CUDA, float32 on CPU)")
    p.add_argument("--mode", default="forward", help="forward, full, or both (comma list)")
    p.add_argument("--providers", default=None,
                   help=f"comma list of {', '.join(PROVIDERS)} (default: all that can run here; torch-compile only "
                        f"on CUDA)")
    p.add_argument("--vocab", type=int, default=49152, help="table rows of the learned baselines")
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up in ms (CUDA)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms (CUDA)")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of timing per row on CPU (blocked_autorange)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for every provider (default 1: on a shared box more threads mostly measure "
                        "contention)")
    p.add_argument("--json", "--out", dest="json", type=Path, default=None, help="write all rows as JSON here")
    p.add_argument("--csv", type=Path, default=None, help="write rows in Liger-Kernel's CSV schema here")
    p.add_argument("--plot", type=Path, default=None, help="PNG: GB/s against tokens with the roofline (matplotlib)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--compile-only", action="store_true",
                   help="no timing: compile every Triton kernel for NVIDIA targets (no GPU needed) and print "
                        "registers, spills, store width and the roofline per token")
    p.add_argument("--arch", default=None, help="with --compile-only: comma list of sm_80, sm_90, sm_100 (default all)")


# ----------------------------------------------------------------------------------- bytes
def bytes_moved(provider: str, mode: str, n_tokens: int, width: int, elem: int, id_bytes: int = 8,
                vocab: int = 49152) -> int:
    """Bytes a provider must move at least, for one call of ``mode`` (see the module docstring)."""
    out = n_tokens * width * elem
    written = n_tokens * id_bytes + out
    if provider not in LEARNED:
        return written  # the code: ids in, activations out; no backward, no optimizer
    fwd = written + out  # plus the table rows read
    if mode == "forward":
        return fwd
    table = vocab * width * elem
    return fwd + (out + table) + 7 * table


# ----------------------------------------------------------------------------------- timing
@dataclass
class Timing:
    ms_50: float
    ms_20: float
    ms_80: float


def _time_cuda(fn: Callable, warmup: int, rep: int) -> Timing:
    import triton.testing

    q = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return Timing(*[float(x) for x in q])


def _time_cpu(fn: Callable, min_time: float, threads: int = 1) -> Timing:
    import torch.utils.benchmark as tb

    m = tb.Timer("fn()", globals={"fn": fn}, num_threads=threads).blocked_autorange(
        min_run_time=min_time)
    times = torch.tensor(m.times, dtype=torch.float64) * 1e3
    q = times.quantile(torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).tolist()
    return Timing(*q)


def copy_peak(device: torch.device, nbytes: int, timer: Callable) -> dict:
    """Practical bandwidth: ``dst.copy_(src)`` of ``nbytes`` (reads + writes counted), same timer."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    moved = 2 * n * 4
    return {"bytes": moved, "ms": t.ms_50, "gbps": moved / (t.ms_50 * 1e-3) / 1e9}


def spec_bandwidth(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    from ..parallel.device_specs import hbm_bandwidth  # by exact device name: PCIe/NVL parts differ

    return hbm_bandwidth(torch.cuda.get_device_name(device))


# ----------------------------------------------------------------------------------- providers
def _liger_embedding():
    try:
        from liger_kernel.transformers.experimental.embedding import LigerEmbedding
    except ImportError:
        return None
    return LigerEmbedding


def available_providers(device: torch.device) -> list[str]:
    out = list(FIXED) + ["torch-embedding"]
    if device.type == "cuda" and _liger_embedding() is not None:
        out.append("liger-embedding")
    if device.type == "cuda":  # inductor on CPU needs a C++ toolchain and minutes on a small box
        out.append("torch-compile")
    return out


class Case:
    """One shape: ids, codes, the learned tables, and a function per (provider, mode)."""

    def __init__(self, device, n_tokens: int, width: int, dtype, vocab: int, bits: int, seed: int):
        self.device, self.n, self.width, self.dtype, self.vocab = device, n_tokens, width, dtype, vocab
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n_tokens,), generator=gen).to(device)
        self.codes = {"megafixed-canonical": make_code("canonical", bits),
                      "megafixed-gf2": make_code("gf2", bits, seed=seed)}
        for c in self.codes.values():
            c.check_vocab(vocab)
        self._compiled = None
        self._tables: dict = {}

    def code_fn(self, provider: str) -> Callable:
        from ..kernels import token_codes

        code = self.codes[provider]
        return lambda: token_codes(self.ids, code, self.width, self.dtype, validate=False)

    def compiled_fn(self) -> Callable:
        code, width, dtype = self.codes["megafixed-gf2"], self.width, self.dtype
        if self._compiled is None:
            self._compiled = torch.compile(lambda ids: code.encode(ids, width, dtype, validate=False), dynamic=True)
        return lambda: self._compiled(self.ids)

    def table(self, provider: str):
        """(module, optimizer): a learned V x d table and AdamW on it, as a model would hold them."""
        if provider not in self._tables:
            if provider == "liger-embedding":
                module = _liger_embedding()(self.vocab, self.width).to(self.device, self.dtype)
            else:
                module = torch.nn.Embedding(self.vocab, self.width, device=self.device, dtype=self.dtype)
            fused = self.device.type == "cuda"
            opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=fused or None)
            self._tables[provider] = (module, opt)
        return self._tables[provider]

    def fn(self, provider: str, mode: str) -> Callable:
        if provider in FIXED:
            return self.code_fn(provider)  # full == forward: nothing to differentiate or update
        if provider == "torch-compile":
            return self.compiled_fn()
        module, opt = self.table(provider)
        if mode == "forward":
            weight = module.weight
            if provider == "torch-embedding":
                return lambda: F.embedding(self.ids, weight)
            return lambda: module(self.ids)
        grad = torch.ones(self.n, self.width, device=self.device, dtype=self.dtype)

        def full():
            out = module(self.ids)
            out.backward(grad)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return full

    def check_bits(self, provider: str) -> dict:
        """Output of a fixed-code provider vs ``encode``, bit for bit (before any timing)."""
        code = self.codes["megafixed-gf2" if provider == "torch-compile" else provider]
        got = self.fn(provider, "forward")()
        want = code.encode(self.ids, self.width, self.dtype)
        same = (got.shape == want.shape and got.dtype == want.dtype
                and torch.equal(got.view(INT_VIEW[self.dtype]), want.view(INT_VIEW[self.dtype])))
        mism = 0 if same else (None if got.shape != want.shape or got.dtype != want.dtype else
                               int((got.view(INT_VIEW[self.dtype]) != want.view(INT_VIEW[self.dtype])).sum()))
        return {"provider": provider, "n_tokens": self.n, "width": self.width, "dtype": str(self.dtype)[6:],
                "bit_identical": bool(same), "mismatches": mism}


# ----------------------------------------------------------------------------------- the sweep
def _resolve(args) -> dict:
    from ..config import ConfigError

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    on_cuda = device.type == "cuda"
    tokens = _int_list(args.tokens, "--tokens") if args.tokens else ([4096, 16384, 65536, 262144, 1048576] if on_cuda
                                                          else [4096, 16384])
    widths = (_int_list(args.width, "--width", "1024,2048") if args.width else
              ([1024, 2048, 4096, 8192] if on_cuda else [1024, 2048]))
    dtypes = [d.strip() for d in (args.dtype or ("bfloat16" if on_cuda else "float32")).split(",") if d.strip()]
    modes = list(MODES) if args.mode in ("both", "all") else [m.strip() for m in args.mode.split(",") if m.strip()]
    avail = available_providers(device)
    providers = [p.strip() for p in args.providers.split(",")] if args.providers else avail
    for name, values, allowed in (("--dtype", dtypes, DTYPES), ("--mode", modes, MODES),
                                  ("--providers", providers, PROVIDERS)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ConfigError(f"{name} {','.join(bad) or '(empty)'}: choose from {', '.join(allowed)}")
    if "liger-embedding" in providers and "liger-embedding" not in avail:
        raise ConfigError("--providers liger-embedding needs CUDA and `pip install liger-kernel`")
    for name, values in (("--tokens", tokens), ("--width", widths)):
        if not values or any(v < 1 for v in values):
            raise ConfigError(f"{name} {values}: give positive integers, e.g. 4k,16k")
    if any(w < args.bits for w in widths):
        raise ConfigError(f"--width {min(widths)} < --bits {args.bits}: a tiled code needs width >= bits")
    if args.vocab > (1 << args.bits):
        raise ConfigError(f"--vocab {args.vocab} needs more than --bits {args.bits} code bits")
    return {"device": device, "tokens": tokens, "widths": widths, "dtypes": dtypes, "modes": modes,
            "providers": providers}


def sweep(device, tokens, widths, dtypes, modes, providers, *, vocab=49152, bits=16, seed=0, warmup=25, rep=100,
          min_time=0.5, threads=1, log=print, on_row=None) -> dict:
    """Check bit-identity, then time every (mode, dtype, width, tokens, provider); return the JSON dict.

    ``on_row(result)`` is called after every row with the result so far (``"complete": false``), so a
    sweep stopped at a time limit still leaves what it measured (``--json`` is rewritten each row)."""
    on_cuda = device.type == "cuda"
    timer = (lambda fn: _time_cuda(fn, warmup, rep)) if on_cuda else (lambda fn: _time_cpu(fn, min_time, threads))
    # The practical peak: a copy as large as the largest output of the sweep, clamped to 64 MiB..1 GiB
    # (well past every cache, without holding GBs through the sweep), timed the same way as the rows.
    largest = max(tokens) * max(widths) * max(torch.empty((), dtype=DTYPES[d]).element_size() for d in dtypes)
    peak = copy_peak(device, min(max(largest, 64 << 20), 1 << 30), timer)
    spec = spec_bandwidth(device)
    rows, checks = [], []
    result = {"bench": "kernels", "kernel_name": KERNEL_NAME, "device": str(device), "device_name": device_name(device),
              "timer": "triton.testing.do_bench" if on_cuda else "torch.utils.benchmark.blocked_autorange",
              "threads": None if on_cuda else threads,
              "copy_peak": peak, "spec_bandwidth_Bps": spec, "bit_identity": checks, "rows": rows,
              "torch": torch.__version__, "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"), "complete": False}
    for dname in dtypes:
        dtype = DTYPES[dname]
        elem = torch.empty((), dtype=dtype).element_size()
        for width in widths:
            for n in tokens:
                case = Case(device, n, width, dtype, vocab, bits, seed)
                for prov in list(providers):  # every fixed-code provider is checked before it is timed
                    if prov not in FIXED and prov != "torch-compile":
                        continue
                    try:
                        checks.append(case.check_bits(prov))
                    except Exception as exc:  # noqa: BLE001 - a compiler failure drops that baseline only
                        if prov != "torch-compile":
                            raise
                        log(f"torch-compile baseline dropped: {type(exc).__name__}: {exc}"[:300])
                        checks.append({"provider": prov, "error": f"{type(exc).__name__}: {exc}"[:1000],
                                       "bit_identical": None})
                        providers = [p for p in providers if p != prov]
                        continue
                    if not checks[-1]["bit_identical"]:
                        raise BitMismatch(f"{prov} differs from FixedCode.encode in {checks[-1]['mismatches']} "
                                          f"elements at {n} tokens x {width} {dname}; not timing a wrong kernel")
                base = {}
                for mode in modes:
                    for prov in providers:
                        if prov == "torch-compile" and mode == "full":
                            continue  # the compiled reference is a second implementation of the forward
                        try:
                            t = timer(case.fn(prov, mode))
                        except Exception as exc:  # noqa: BLE001 - e.g. a recompile failing at a new shape
                            if prov != "torch-compile":
                                raise
                            log(f"torch-compile not timed at {n} x {width}: {type(exc).__name__}: {exc}"[:300])
                            continue
                        nbytes = bytes_moved(prov, mode, n, width, elem, case.ids.element_size(), vocab)
                        gbps = nbytes / (t.ms_50 * 1e-3) / 1e9
                        row = {"provider": prov, "mode": mode, "n_tokens": n, "width": width, "dtype": dname,
                               "vocab": vocab, "bits": bits, **asdict(t), "bytes": nbytes, "gbps": gbps,
                               "pct_copy_peak": 100.0 * gbps / peak["gbps"],
                               "pct_spec_peak": None if spec is None else 100.0 * gbps * 1e9 / spec}
                        if prov == "torch-embedding":
                            base[mode] = t.ms_50
                        rows.append(row)
                        if on_row is not None:
                            on_row(result)
                        log(f"{mode:7s} {dname:8s} d={width:5d} N={n:8d} {prov:20s} {t.ms_50:9.3f} ms "
                            f"{gbps:8.1f} GB/s {row['pct_copy_peak']:5.1f}% of copy")
                for row in rows:
                    if (row["n_tokens"], row["width"], row["dtype"]) == (n, width, dname) and row["mode"] in base:
                        row["speedup_vs_torch_embedding"] = base[row["mode"]] / row["ms_50"]
                del case
                if on_cuda:
                    torch.cuda.empty_cache()
    result["complete"] = True
    return result


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


# ----------------------------------------------------------------------------------- outputs
def csv_rows(result: dict) -> list[dict]:
    """Rows in Liger-Kernel's benchmark CSV schema (one per timed row) plus our bandwidth columns."""
    try:
        from importlib.metadata import version
        liger = version("liger-kernel")
    except Exception:  # noqa: BLE001 - not installed
        liger = ""
    out = []
    for r in result["rows"]:
        extra = {"width": r["width"], "dtype": r["dtype"], "vocab": r["vocab"], "bits": r["bits"]}
        out.append({"kernel_name": KERNEL_NAME, "kernel_provider": r["provider"], "kernel_operation_mode": r["mode"],
                    "metric_name": "speed", "metric_unit": "ms", "x_name": "T", "x_label": "tokens (B*T)",
                    "x_value": r["n_tokens"], "y_value_50": r["ms_50"], "y_value_20": r["ms_20"],
                    "y_value_80": r["ms_80"], "extra_benchmark_config_str": json.dumps(extra, sort_keys=True),
                    "gpu_name": result["device_name"], "timestamp": result["timestamp"], "liger_version": liger,
                    "bytes": r["bytes"], "gbps": r["gbps"], "pct_copy_peak": r["pct_copy_peak"],
                    "pct_spec_peak": "" if r["pct_spec_peak"] is None else r["pct_spec_peak"]})
    return out


def write_csv(result: dict, path: Path) -> None:
    from ..atomic import atomic_path

    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(csv_rows(result))


def plot(result: dict, path: Path) -> None:
    """GB/s against tokens, one panel per (mode, width), the copy peak (and spec) as the roofline."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        from ..config import ConfigError
        raise ConfigError(f"--plot needs matplotlib (pip install 'megafixed[bench]'): {exc}") from exc
    rows = result["rows"]
    panels = sorted({(r["mode"], r["width"]) for r in rows}, key=lambda k: (MODES.index(k[0]), k[1]))
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, (mode, width) in zip(axes.flat, panels):
        for (prov, dtype) in sorted({(r["provider"], r["dtype"]) for r in rows}):
            pts = sorted((r["n_tokens"], r["gbps"]) for r in rows
                         if (r["mode"], r["width"], r["provider"], r["dtype"]) == (mode, width, prov, dtype))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{prov} {dtype}")
        ax.axhline(result["copy_peak"]["gbps"], color="k", ls="--", lw=1, label="copy (measured roofline)")
        if result.get("spec_bandwidth_Bps"):
            ax.axhline(result["spec_bandwidth_Bps"] / 1e9, color="r", ls=":", lw=1, label="data sheet")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}, d={width}", fontsize=9)
        ax.set_xlabel("tokens (B*T)")
        ax.set_ylabel("GB/s")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(f"{KERNEL_NAME} on {result['device_name']}", fontsize=10)
    fig.tight_layout()
    from ..atomic import atomic_path
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def summary(result: dict) -> list[str]:
    """One line per (mode, dtype, width) at the largest token count: the targets in numbers."""
    lines = [f"copy peak {result['copy_peak']['gbps']:.1f} GB/s ({result['timer']})"]
    big = max(r["n_tokens"] for r in result["rows"])
    for r in result["rows"]:
        if r["n_tokens"] == big and r["provider"] in FIXED:
            sp = r.get("speedup_vs_torch_embedding")
            vs = "" if sp is None else f", {sp:.2f}x torch-embedding"
            lines.append(f"{r['mode']} {r['dtype']} d={r['width']} N={big}: {r['provider']} {r['gbps']:.1f} GB/s "
                         f"({r['pct_copy_peak']:.0f}% of copy){vs}")
    return lines


def select_device(device: torch.device) -> None:
    """Make ``cuda:N`` the current device: Triton launches, and ``do_bench`` times, on the current
    device's stream, so without this ``--device cuda:1`` would time device 0's stream."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def run(args) -> int:
    if args.compile_only:
        from .kernels_compile import run as compile_only

        return compile_only(args)
    if args.arch:
        from ..config import ConfigError
        raise ConfigError("--arch goes with --compile-only (timing runs on the device it finds)")
    from ..outputs import claim_output

    spec = _resolve(args)
    outs = [p for p in (args.json, args.csv, args.plot) if p is not None]
    if outs:
        claim_output(outs, overwrite=args.overwrite, what="benchmark output")
        for p in outs:
            p.parent.mkdir(parents=True, exist_ok=True)
    from .. import pause as pauses
    from ..atomic import atomic_write_text

    pause = pauses.armed("bench.row")  # MEGAFIXED_PAUSE: a test stops the sweep at a row of its choosing

    def save_partial(result: dict) -> None:  # every row: a sweep killed at its limit keeps its rows
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
        if pause is not None:
            pause.reached(len(result["rows"]))

    select_device(spec["device"])
    try:
        result = sweep(spec["device"], spec["tokens"], spec["widths"], spec["dtypes"], spec["modes"],
                       spec["providers"], vocab=args.vocab, bits=args.bits, seed=args.seed, warmup=args.warmup,
                       rep=args.rep, min_time=args.min_time, threads=args.threads,
                       on_row=save_partial if args.json else None)
    except BitMismatch as exc:
        print(f"error: {exc}")
        return exit_codes.FAILED

    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    if args.csv:
        write_csv(result, args.csv)
    if args.plot:
        plot(result, args.plot)
    print("\n".join(summary(result)))
    return exit_codes.OK
