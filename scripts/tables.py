"""Benchmark tables: rows of raw values, printed as markdown and written as CSV (`--csv PATH`).

The markdown rows are for reading and pasting into docs/; the CSV keeps the unformatted numbers under
machine-friendly column names, for scripts/plot_benchmarks.py and spreadsheets.
"""
from __future__ import annotations

import csv
from typing import NamedTuple


class Column(NamedTuple):
    key: str            # the CSV column name and the row's dict key
    title: str          # the markdown header
    fmt: str = ""       # format spec of the markdown cell, e.g. ",.0f", ".2f", ".1%"


class Table:
    """Rows added one at a time (a long run cut short keeps what it printed); None is an empty cell."""

    def __init__(self, *columns: Column | tuple):
        self.columns = [Column(*c) for c in columns]
        self.rows: list[dict] = []

    def header(self) -> str:
        return ("| " + " | ".join(c.title for c in self.columns) + " |\n"
                + "|" + "---|" * len(self.columns))

    def add(self, **values) -> str:
        """Appends a row (every key must be a column) and returns its markdown line."""
        unknown = set(values) - {c.key for c in self.columns}
        if unknown:
            raise KeyError(f"not columns of this table: {sorted(unknown)}")
        self.rows.append(values)
        return self._line(values)

    def _line(self, row: dict) -> str:
        cells = ("" if row.get(c.key) is None else format(row[c.key], c.fmt) for c in self.columns)
        return "| " + " | ".join(cells) + " |"

    def markdown(self) -> str:
        return "\n".join([self.header()] + [self._line(r) for r in self.rows])

    def write_csv(self, path: str) -> None:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[c.key for c in self.columns], restval="")
            w.writeheader()
            w.writerows(self.rows)


def add_csv_argument(ap) -> None:
    ap.add_argument("--csv", default=None, metavar="PATH", help="also write the table's rows to this CSV file")
