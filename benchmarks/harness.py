"""The one benchmark harness: timers, the peak anchors measured in the same run (device copy bandwidth,
bf16 matmul), relative error, tables (markdown with a command / date / machine / commit header, CSV,
JSON) and bar charts.

Every benchmark of this package builds its rows with `Table` and prints `header(...)` first, so a
pasted table says what ran where. Nothing here imports jax or torch at module level: host-only
benchmarks (served path, start-up) stay light.
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Callable, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.time()


# ---- timers -------------------------------------------------------------------------------------

def log(*a) -> None:
    """A progress line stamped with the seconds since the benchmark started (flushed: a run cut short
    keeps what it printed)."""
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


class CompileCount:
    """XLA compilations (count, seconds) since `start()`: a timed run that compiles is measuring the
    compiler, so benchmarks print this next to each row."""

    def __init__(self):
        import jax.monitoring
        self.n, self.secs = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, secs: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.n, self.secs = self.n + 1, self.secs + secs

    def start(self) -> None:
        self.n, self.secs = 0, 0.0

    def __str__(self) -> str:
        return f"{self.n} compiles, {self.secs:.1f} s"


def time_jax(fn, *args, reps: int = 10, samples: int = 5) -> float:
    """Median seconds per call of a jitted function: one warm-up call, then `samples` samples, each
    timing `reps` back-to-back calls (dispatch overlaps the previous call, as in a serving loop)."""
    import jax
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / reps)
    return statistics.median(ts)


def time_torch(torch, fn, reps: int = 10, samples: int = 5) -> float:
    """`time_jax` for a torch CUDA callable, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(ts)


def time_host(fn, *args, samples: int = 5) -> float:
    """Median wall seconds of `fn(*args)` (host work, or a call that blocks on its own result)."""
    ts = []
    for _ in range(samples):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


# ---- anchors ------------------------------------------------------------------------------------

def torch_and_fla():
    """(torch, (fla chunk_kda, fused_recurrent_kda), None) when torch has CUDA and flash-linear-attention
    imports, else (None, None, why): the FLA anchor is optional."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None, None, "torch without CUDA"
        from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_rec
        return torch, (fla_chunk, fla_rec), None
    except Exception as e:  # noqa: BLE001 - anchor is optional
        return None, None, f"{type(e).__name__}: {e}"[:120]


def copy_bandwidth(gib: float = 4.0, torch=None) -> tuple[float, float | None]:
    """Bytes read + written per second of a `gib` GiB fp32 device copy: (JAX `x + 1`, torch `copy_` or
    None without torch). torch's copy is the ceiling to quote on a GPU (XLA's elementwise loop is
    slower); the roofs use it when it is there."""
    import jax
    import jax.numpy as jnp
    n = int(gib * (1 << 28))
    x = jnp.ones((n,), jnp.float32)
    bw_jax = 2 * 4 * n / time_jax(jax.jit(lambda a: a + 1), x, reps=5)
    del x
    bw_torch = None
    if torch is not None:
        a = torch.empty(n, dtype=torch.float32, device="cuda")
        b = torch.empty_like(a)
        bw_torch = 2 * 4 * n / time_torch(torch, lambda: b.copy_(a), reps=5)
        del a, b
        torch.cuda.empty_cache()
    return bw_jax, bw_torch


def matmul_peak(n: int = 8192, reps: int = 10) -> float:
    """bf16 FLOP/s of one n^3 `jnp` matmul (the compute roof, measured in the same run)."""
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    return 2 * n ** 3 / time_jax(jax.jit(lambda x, y: x @ y), a, b, reps=reps)


# ---- errors -------------------------------------------------------------------------------------

def rel_err(out, ref, norm: str = "max") -> float:
    """Relative error of `out` against `ref` in float64: "max" = max |out - ref| / max |ref| (the
    kernels' checks), "rms" = RMS(out - ref) / RMS(ref) (recurrences whose outputs vary in scale)."""
    import numpy as np
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if norm == "rms":
        return float(np.sqrt(np.mean((out - ref) ** 2)) / (np.sqrt(np.mean(ref ** 2)) + 1e-30))
    if norm != "max":
        raise ValueError(f"norm is 'max' or 'rms', not {norm!r}")
    return float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30))


# ---- run header ---------------------------------------------------------------------------------

def commit() -> str:
    """The checkout's short commit, '+dirty' when tracked files differ from it ('unknown' off git)."""
    try:
        sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def machine(devices: bool = True) -> str:
    """The accelerator (device kind and count, jax version) or, without jax / devices=False, the host."""
    host = f"{platform.node()} ({os.cpu_count()} CPUs)"
    if not devices:
        return host
    try:
        import jax
        d = jax.devices()
        return f"{len(d)} x {d[0].device_kind}, jax {jax.__version__}, host {host}"
    except Exception:  # noqa: BLE001 - the header never fails a run
        return host


def command() -> str:
    """The command line as it would be typed from the repository root."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    prog = f"python -m {spec.name.removesuffix('.__main__')}" if spec is not None and spec.name else f"python {shlex.quote(sys.argv[0])}"
    return " ".join([prog, *map(shlex.quote, sys.argv[1:])])


def run_info(devices: bool = True) -> dict:
    return {"command": command(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(devices), "commit": commit()}


def header(title: str, devices: bool = True, **extra) -> str:
    """'# title' and one '# key: value' line each for command, date, machine, commit and `extra`
    (anchors, settings): printed above every table."""
    info = {**run_info(devices), **extra}
    return "\n".join([f"# {title}"] + [f"# {k}: {v}" for k, v in info.items()])


# ---- tables -------------------------------------------------------------------------------------

class Column(NamedTuple):
    key: str            # the CSV column name and the row's dict key
    title: str | None   # the markdown header; None: a CSV-only column
    # format spec of the markdown cell, e.g. ",.0f", ".2f", ".1%"; or row -> cell text, a markdown-only
    # column made from the row's CSV values (a cell whose unit depends on the row, two figures in one cell)
    fmt: str | Callable[[dict], str] = ""


class Table:
    """Rows added one at a time (a long run cut short keeps what it printed); None is an empty cell.
    `name` labels this table's rows when several tables share one CSV file (write_csv)."""

    def __init__(self, *columns: Column | tuple, name: str = ""):
        self.columns = [Column(*c) for c in columns]
        self.name = name
        self.rows: list[dict] = []

    @property
    def csv_keys(self) -> list[str]:
        return [c.key for c in self.columns if not callable(c.fmt)]

    def _shown(self) -> list[Column]:
        return [c for c in self.columns if c.title is not None]

    def header(self) -> str:
        shown = self._shown()
        return "| " + " | ".join(c.title for c in shown) + " |\n" + "|" + "---|" * len(shown)

    def add(self, **values) -> str:
        """Appends a row (every key must be a CSV column) and returns its markdown line."""
        unknown = set(values) - set(self.csv_keys)
        if unknown:
            raise KeyError(f"not columns of this table: {sorted(unknown)}")
        self.rows.append(values)
        return self._line(values)

    def _line(self, row: dict) -> str:
        def cell(c):
            text = c.fmt(row) if callable(c.fmt) else None if row.get(c.key) is None else format(row[c.key], c.fmt)
            return "" if text is None else text
        return "| " + " | ".join(cell(c) for c in self._shown()) + " |"

    def markdown(self) -> str:
        return "\n".join([self.header()] + [self._line(r) for r in self.rows])

    def write_csv(self, path: str) -> None:
        write_csv(path, self)


def write_csv(path: str, *tables: Table) -> None:
    """The tables' rows in one CSV file. Several tables: a first column `table` (each table's name), then
    every table's columns in order (a row leaves the other tables' columns empty)."""
    keys = [] if len(tables) == 1 else ["table"]
    for t in tables:
        keys += [k for k in t.csv_keys if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, restval="")
        w.writeheader()
        for t in tables:
            w.writerows(r if len(tables) == 1 else {"table": t.name, **r} for r in t.rows)


def read_csv(path: str) -> list[dict]:
    """Rows of a CSV written by `write_csv`, numbers as floats and empty cells as None."""
    def value(s):
        if s == "":
            return None
        try:
            return float(s)
        except ValueError:
            return s
    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_json(path: str, result, devices: bool = True) -> None:
    """`result` (rows, a dict of figures) under "run" (command, date, machine, commit) in one JSON file."""
    with open(path, "w") as f:
        json.dump({"run": run_info(devices), "result": result}, f, indent=1, default=str)


def add_csv_argument(ap) -> None:
    ap.add_argument("--csv", default=None, metavar="PATH", help="also write the table's rows to this CSV file")


# ---- charts -------------------------------------------------------------------------------------

def bar_chart(groups: list[str], series: dict[str, list[float]], path: str | None = None, *, title: str = "",
              ylabel: str = "", targets: dict[str, float] | None = None):
    """Grouped bars (one group per x label, one bar per series, each labelled with its value) and a dashed
    line per group with a target; saved as PNG at `path` when given (no version stamp: same data, same
    bytes). Returns the figure. Needs matplotlib (the `test` extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(groups) * max(1, len(series)) ** 0.5), 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, [0 if v is None else v for v in values], width, label=name)
        ax.bar_label(bars, fmt="{:,.0f}", fontsize=7, padding=2)
    for g, group in enumerate(groups):
        if targets and group in targets:
            ax.hlines(targets[group], g - 0.45, g + 0.45, colors="k", linestyles="--", linewidth=1)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)
    if len(series) > 1 or targets:
        if targets:
            ax.plot([], [], "k--", linewidth=1, label="target")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100, metadata={"Software": None})
        plt.close(fig)
    return fig
