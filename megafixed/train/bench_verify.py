"""What verifying a checkpoint against its manifest costs, against just reading its bytes.

    python -m megafixed.train.bench_verify [--mb 1024] [--files 4] [--dir /path/on/the/checkpoint/fs]

Writes ``--files`` files of random bytes (``--mb`` in all) with a manifest in a temporary tag
directory under ``--dir``, then times, in the same run and on the same (page-cached) bytes:
reading every file in 8 MiB chunks without hashing (the baseline: what any loader pays at least),
and ``manifest.verify_for_reading`` (streamed sha256, on ``HASH_THREADS`` threads and on one). It
prints JSON with MB/s and what those rates mean for a 1.7B-parameter checkpoint (~24 GB with
ZeRO's fp32 master weights and Adam moments; ~3.4 GB for the bf16 model file alone, all that eval,
export and generate verify). Results: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

FULL_1P7B_GB = 24.0  # bf16 weights (3.4 GB) + fp32 master (6.8 GB) + Adam m, v (13.6 GB)
MODEL_1P7B_GB = 3.4


def _read_only(paths) -> None:
    for p in paths:
        with open(p, "rb") as fh:
            while fh.read(8 << 20):
                pass


def main(argv=None) -> None:
    from ..run import manifest

    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024, help="total megabytes to write and verify")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    ap.add_argument("--rounds", type=int, default=3, help="best of N")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        tag = Path(d) / "step_00000001"
        tag.mkdir()
        per = a.mb * (1 << 20) // a.files
        paths = []
        for i in range(a.files):
            p = tag / f"file_{i}.pt"
            with open(p, "wb") as fh:
                for _ in range(per // (8 << 20)):
                    fh.write(os.urandom(8 << 20))
                fh.write(os.urandom(per % (8 << 20)))
            paths.append(p)
        manifest.write(tag, {"format": manifest.FORMAT}, {p.name: manifest.record_existing(p) for p in paths})
        total = sum(p.stat().st_size for p in paths)

        def best(fn) -> float:
            times = []
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        read_s = best(lambda: _read_only(paths))
        threads = manifest.HASH_THREADS
        verify_s = best(lambda: manifest.verify_for_reading(tag))
        manifest.HASH_THREADS = 1
        try:
            verify1_s = best(lambda: manifest.verify_for_reading(tag))
        finally:
            manifest.HASH_THREADS = threads
    mbs = {k: total / v / 1e6 for k, v in (("read_only", read_s), (f"verify_{threads}_threads", verify_s),
                                             ("verify_1_thread", verify1_s))}
    rate = total / verify_s
    res = {"bytes": total, "files": a.files, "cpus": os.cpu_count(), "seconds": {"read_only": read_s,
           f"verify_{threads}_threads": verify_s, "verify_1_thread": verify1_s}, "MB_per_s": mbs,
           "verify_over_read": verify_s / read_s,
           "extrapolated_s": {"1.7B_full_24GB": FULL_1P7B_GB * 1e9 / rate,
                              "1.7B_model_file_3.4GB": MODEL_1P7B_GB * 1e9 / rate}}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
