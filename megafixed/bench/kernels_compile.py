"""``megafixed bench kernels --compile-only``: every Triton kernel compiled for NVIDIA targets, no GPU needed.

One row per (kernel, shape, arch): registers per thread and spill bytes (the bundled ``ptxas -v``),
the global store width (from the PTX), the bytes each token moves and the roofline time per token
at the arch's data-sheet bandwidth (``parallel/device_specs.ARCH_PART``): the floor a measured run
on that GPU is judged against. See ``megafixed.kernels.compile_only`` for how a case is compiled.
"""
from __future__ import annotations

import json
from dataclasses import asdict

from .. import exit_codes

ARCH_NAMES = {f"sm_{a}": a for a in (80, 90, 100)}


def parse_archs(text) -> list[int]:
    from ..config import ConfigError

    names = [a.strip() for a in (text or ",".join(ARCH_NAMES)).split(",") if a.strip()]
    bad = [a for a in names if a not in ARCH_NAMES]
    if bad or not names:
        raise ConfigError(f"--arch {','.join(bad) or '(empty)'}: choose from {', '.join(ARCH_NAMES)}")
    return [ARCH_NAMES[a] for a in names]


def row(report) -> dict:
    from ..parallel.device_specs import arch_spec

    spec = arch_spec(report.arch)
    bandwidth = None if spec is None else spec.hbm_tbps * 1e12
    out = asdict(report)
    out.update(arch=f"sm_{report.arch}", vectorised=report.vectorised, roofline_part=spec and spec.part,
               roofline_ns_per_token=None if bandwidth is None else report.bytes_per_token / bandwidth * 1e9)
    return out


def table(rows: list[dict]) -> list[str]:
    lines = [f"{'kernel':20s} {'variant':44s} {'arch':6s} {'regs':>4s} {'spill B':>7s} {'store':>6s} "
             f"{'B/token':>7s} {'roofline ns/token':>17s}"]
    for r in rows:
        ns = "-" if r["roofline_ns_per_token"] is None else f"{r['roofline_ns_per_token']:.3f}"
        lines.append(f"{r['kernel']:20s} {r['variant']:44s} {r['arch']:6s} {r['registers']:4d} "
                     f"{r['spill_bytes']:7d} {str(r['store_bits']) + ' b':>6s} {r['bytes_per_token']:7d} {ns:>17s}")
    return lines


def problems(rows: list[dict]) -> list[str]:
    """Spills anywhere, and a launched paper shape whose store stream is not 128-bit vectors."""
    out = [f"{r['kernel']} {r['variant']} {r['arch']}: {r['spill_bytes']} spill bytes"
           for r in rows if r["spill_bytes"]]
    out += [f"{r['kernel']} {r['variant']} {r['arch']}: stores {r['store_bits']}-bit, not 128-bit vectors "
            f"({r['stores']})" for r in rows if r["paper_shape"] and not r["vectorised"]]
    return out


def run(args) -> int:
    from ..kernels import HAVE_TRITON
    from ..outputs import claim_output

    archs = parse_archs(args.arch)
    if not HAVE_TRITON:
        from ..config import ConfigError
        raise ConfigError("--compile-only needs triton (pip install 'megafixed[kernels]')")
    if args.json:
        claim_output([args.json], overwrite=args.overwrite, what="benchmark output")
    from ..kernels import compile_only

    cases = compile_only.paper_cases() + [compile_only.odd_width_case()]
    rows = []
    print(table([])[0], flush=True)
    for case in cases:
        for arch in archs:
            rows.append(row(compile_only.check(case, arch)))
            print(table(rows[-1:])[1], flush=True)  # a row as it compiles: a full sweep takes minutes
    bad = problems(rows)
    if args.json:
        from ..atomic import atomic_write_text

        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps({"rows": rows, "problems": bad}, indent=2) + "\n")
    for line in bad:
        print(f"problem: {line}")
    return exit_codes.FAILED if bad else exit_codes.OK
