#!/usr/bin/env python3
"""Plot kvret-session-sim's --csv output of a --sweep: DRAM hit rate (solid) and DRAM + disk hit rate (dashed)
against the DRAM capacity, one colour per policy. Needs matplotlib (optional: without it the script says so and
exits 1).

    build/bin/kvret-session-sim --sweep 8,16,32,64,128 --csv > sim.csv
    python3 tools/sessions/plot_sim.py sim.csv sim.png
"""
import csv
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_sim.py: matplotlib is not installed; the CSV is the result")
        return 1
    rows = list(csv.DictReader(open(sys.argv[1])))
    if not rows:
        print("plot_sim.py: no rows")
        return 1
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, policy in enumerate(policies):
        pts = sorted((float(r["dram_gib"]), float(r["dram_hit_pct"]), float(r["disk_hit_pct"]))
                     for r in rows if r["policy"] == policy)
        x = [p[0] for p in pts]
        colour = f"C{i}"
        ax.plot(x, [p[1] for p in pts], "o-", color=colour, label=f"{policy}: DRAM")
        ax.plot(x, [p[1] + p[2] for p in pts], "s--", color=colour, alpha=0.6, label=f"{policy}: DRAM + disk")
    disks = sorted({r["disk_gib"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DRAM capacity (GiB)")
    ax.set_ylabel("hit rate of returning turns (%)")
    ax.set_ylim(0, 101)
    ax.set_title(f"session placement, disk {', '.join(disks)} GiB")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    print(f"wrote {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
