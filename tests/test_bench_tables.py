"""scripts/tables.py (benchmark rows as markdown and CSV) and scripts/plot_benchmarks.py (docs charts)."""
import csv
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_table_markdown_and_csv_keep_the_same_rows(tmp_path):
    tables = _script("tables")
    t = tables.Table(("workload", "workload"), ("tok_s", "tok/s", ",.0f"), ("hit", "hit", ".1%"))
    line = t.add(workload="prefill 64 x 2048", tok_s=43373.4)
    assert line == "| prefill 64 x 2048 | 43,373 |  |"            # a missing value is an empty cell
    t.add(workload="c16", hit=0.8125)
    assert t.markdown().splitlines() == ["| workload | tok/s | hit |", "|---|---|---|", line, "| c16 |  | 81.2% |"]
    with pytest.raises(KeyError, match="tok_per_s"):
        t.add(workload="x", tok_per_s=1.0)
    assert len(t.rows) == 2                                        # the refused row was not kept
    path = tmp_path / "t.csv"
    t.write_csv(str(path))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"workload": "prefill 64 x 2048", "tok_s": "43373.4", "hit": ""},
                    {"workload": "c16", "tok_s": "", "hit": "0.8125"}]
