"""Benchmark tables: rows of raw values, printed as markdown and written as CSV (`--csv PATH`).

The markdown rows are for reading and pasting into docs/; the CSV keeps the unformatted numbers under
machine-friendly column names, for scripts/plot_benchmarks.py and spreadsheets.
"""
from __future__ import annotations

import csv
from typing import Callable, NamedTuple


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


def add_csv_argument(ap) -> None:
    ap.add_argument("--csv", default=None, metavar="PATH", help="also write the table's rows to this CSV file")
