#!/usr/bin/env python3
"""Plots kvret-eval results: attention-mass recall (and output error) against the budget, one line per retriever,
one column per (source, context). Needs matplotlib (pip install matplotlib).

Usage: python3 tools/eval/plot.py RESULTS.csv [MORE.csv ...] -o docs/benchmarks-eval.png [--title TEXT]
"""
import argparse
import csv
import sys
from collections import defaultdict

STYLE = {  # retriever -> (color, marker)
    "exact": ("#222222", "o"),
    "pq": ("#1f77b4", "s"),
    "page": ("#ff7f0e", "^"),
    "streaming": ("#7f7f7f", "x"),
}


def context_label(n):
    n = int(n)
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--title", default="kvret retrieval quality vs budget")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py needs matplotlib: pip install matplotlib")

    # (source, context) -> retriever -> [(budget, mass, error)]
    panels = defaultdict(lambda: defaultdict(list))
    for path in args.csv:
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                key = (row["source"], int(row["context"]))
                panels[key][row["retriever"]].append(
                    (float(row["budget"]), float(row["mass_recall"]), float(row["output_error"])))
    keys = sorted(panels)
    fig, axes = plt.subplots(2, len(keys), figsize=(4.2 * len(keys), 7.0), squeeze=False, sharex=True)
    for col, key in enumerate(keys):
        for name, points in sorted(panels[key].items(), key=lambda kv: list(STYLE).index(kv[0])
                                   if kv[0] in STYLE else 99):
            points.sort()
            color, marker = STYLE.get(name, (None, "."))
            b = [p[0] for p in points]
            axes[0][col].plot(b, [p[1] for p in points], marker=marker, color=color, label=name)
            axes[1][col].plot(b, [p[2] for p in points], marker=marker, color=color, label=name)
        axes[0][col].set_title(f"{key[0]}, context {context_label(key[1])}")
        for r in range(2):
            ax = axes[r][col]
            ax.set_xscale("log")
            ticks = sorted({p[0] for pts in panels[key].values() for p in pts})
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"1/{round(1 / t)}" if abs(1 / t - round(1 / t)) < 1e-6 else f"{t:g}" for t in ticks])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
        axes[0][col].set_ylim(0, 1.02)
        axes[1][col].set_xlabel("budget (fraction of the context)")
    axes[0][0].set_ylabel("attention-mass recall (higher is better)")
    axes[1][0].set_ylabel("output error (lower is better)")
    axes[0][0].legend(loc="lower right")
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
