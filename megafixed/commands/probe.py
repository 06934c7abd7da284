"""``megafixed probe RUN [RUN ...] [--layers all|0,2,4] [--tokens N] [--json OUT] [--plot OUT.png]``."""
from __future__ import annotations

import json
from dataclasses import asdict

from .. import exit_codes
from ..trust.flag import add_trust_run_dir, check_source

HELP = "linear probes: how recoverable each token's code bits stay through the layers, per run"


def add_arguments(p):
    p.add_argument("runs", nargs="+", help="run directories (e.g. the runs of a study)")
    p.add_argument("--layers", default="all", help="'all' or a comma list of layer indices (0 = the input)")
    p.add_argument("--tokens", type=int, default=4096, help="positions to fit and test the probes on")
    p.add_argument("--json", default=None, help="write the accuracies as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of accuracy against depth here (needs matplotlib: "
                                                "pip install 'megafixed[plot]')")
    add_trust_run_dir(p)


def run(args) -> int:
    from ..atomic import atomic_write_text
    from ..config import ConfigError
    from ..study.probe import probe_run
    from ..threads import apply_thread_policy

    for run_dir in args.runs:
        check_source(run_dir, args)
    if args.plot:
        from ..plotting import require_matplotlib

        require_matplotlib(f"--plot {args.plot}")  # before minutes of probing, not after
    if args.tokens < 16:
        raise ConfigError(f"--tokens {args.tokens}: give at least 16 positions (a few thousand are better)")
    layers = None
    if args.layers != "all":
        from ..arglists import parse_list

        layers = parse_list(args.layers, "--layers", int, kind="layer index (or 'all')", example="0,2,4")
    apply_thread_policy(knob="OMP_NUM_THREADS=N")  # after the flags are checked: a bad one stays a single error line
    results = []
    for run_dir in args.runs:
        res = probe_run(run_dir, layers, args.tokens)
        results.append(res)
        print(f"{run_dir} ({res.interface}, {res.tokens} positions; held-out accuracy beside the majority-class "
              f"baseline: each bit's commoner sign, averaged over the bits)")
        print("  layer  own bits  baseline  previous token's bits  baseline")
        for layer, own, prev in zip(res.layers, res.own, res.prev):
            print(f"  {layer:5d}  {own:8.3f}  {res.own_baseline:8.3f}  {prev:21.3f}  {res.prev_baseline:8.3f}")
    if args.json:
        atomic_write_text(args.json, json.dumps([asdict(r) for r in results], indent=1))
    if args.plot:
        _plot(results, args.plot)
    return exit_codes.OK


def _plot(results, path) -> None:
    from ..plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        line, = ax.plot(r.layers, r.own, marker="o", label=f"{r.interface}: own bits")
        ax.plot(r.layers, r.prev, marker="x", ls="--", color=line.get_color(), label=f"{r.interface}: previous")
        for base in (r.own_baseline, r.prev_baseline):  # majority-class baselines, not 0.5
            ax.axhline(base, color=line.get_color(), lw=0.6, ls=":")
    ax.set_xlabel("layer (0 = input)")
    ax.set_ylabel("held-out probe accuracy")
    ax.set_ylim(0.4, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
