"""Charts for docs/benchmarks.md from the committed CSVs under docs/data/ (PNGs under docs/img/).

  python scripts/plot_benchmarks.py [--data docs/data] [--out docs/img]

Each CSV holds the rows a benchmark script wrote with `--csv` (scripts/tables.py), plus the columns
that say which run they came from; a new run is appended to its CSV and the charts are made again.
  e2e_full_depth.csv   scripts/bench_e2e.py --csv rows + run, date, commit
  moe_prefill_mlp.csv  whole expert MLP at prefill (docs/bench_moe.md run 5): shape, mlp, version, us, tflop_s
"""
from __future__ import annotations

import argparse
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Targets of docs/benchmarks.md's summary (H200, full-depth Kimi-Linear-48B-A3B).
E2E_TARGETS = {"prefill 64 x 2048": 40_000, "c16, 1024 in / 1024 out": 1_000, "c64, 1024 in / 256 out": 2_000}


def read_csv(path: str) -> list[dict]:
    """Rows with numbers as floats and empty cells as None."""
    def value(s):
        if s == "":
            return None
        try:
            return float(s)
        except ValueError:
            return s
    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _bars(ax, groups: list[str], series: dict[str, list[float]], colors=None):
    """Grouped bars: one group per x label, one bar per series; each bar labelled with its value."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name, color=colors[i] if colors else None)
        ax.bar_label(bars, fmt="{:,.0f}", fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)


def e2e_full_depth(rows: list[dict]):
    """Prefill prompt tok/s and c16 / c64 output tok/s per full-depth run, with the targets."""
    runs = list(dict.fromkeys(r["run"] for r in rows))
    get = lambda run, workload, key: next(r[key] for r in rows if r["run"] == run and r["workload"] == workload)  # noqa: E731
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), width_ratios=(1, 2))
    panels = ((left, ["prefill 64 x 2048"], "prompt_tok_s", "prompt tok/s"),
              (right, ["c16, 1024 in / 1024 out", "c64, 1024 in / 256 out"], "output_tok_s", "output tok/s"))
    for ax, workloads, key, label in panels:
        _bars(ax, workloads, {run: [get(run, w, key) for w in workloads] for run in runs})
        for g, w in enumerate(workloads):
            ax.hlines(E2E_TARGETS[w], g - 0.45, g + 0.45, colors="k", linestyles="--", linewidth=1)
        ax.set_ylabel(label)
        ax.margins(y=0.15)
    right.plot([], [], "k--", linewidth=1, label="target")
    right.legend(fontsize=8, loc="upper left")
    fig.suptitle("Full-depth Kimi-Linear-48B-A3B end to end, one H200 (scripts/bench_e2e.py)")
    fig.tight_layout()
    return fig


def moe_prefill_mlp(rows: list[dict]):
    """Whole expert MLP TFLOP/s at prefill before / after issue 25, next to the plain gmm yardstick."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    labels = [("plain gmm (yardstick)", None), ("bf16", "before"), ("bf16", "after"), ("MXFP4", "before"),
              ("MXFP4", "after")]
    series = {f"{mlp} {version}" if version else mlp:
              [next(r["tflop_s"] for r in rows if r["shape"] == s and r["mlp"] == mlp and r["version"] == version)
               for s in shapes] for mlp, version in labels}
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, shapes, series, colors=["0.6", "#9ecae1", "#2171b5", "#fdae6b", "#d94801"])   # before light, after dark
    ax.set_ylabel("TFLOP/s")
    ax.margins(y=0.25)
    ax.legend(fontsize=8, ncols=3, loc="upper right")
    fig.suptitle("Expert MLP at prefill, one H200 (scripts/bench_moe.py --prefill)")
    fig.tight_layout()
    return fig


CHARTS = {"e2e_full_depth": e2e_full_depth, "moe_prefill_mlp": moe_prefill_mlp}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "docs", "data"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, draw in CHARTS.items():
        fig = draw(read_csv(os.path.join(args.data, f"{name}.csv")))
        path = os.path.join(args.out, f"{name}.png")
        fig.savefig(path, dpi=100, metadata={"Software": None})     # no version stamp: same data, same bytes
        plt.close(fig)
        print(path)


if __name__ == "__main__":
    main()
