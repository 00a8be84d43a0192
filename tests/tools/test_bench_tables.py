"""benchmarks/harness.py: tables as markdown and CSV, the run header, JSON, relative error, charts."""
import csv
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks import bench_disagg, harness

ROOT = Path(__file__).resolve().parents[2]


def test_table_markdown_and_csv_keep_the_same_rows(tmp_path):
    tables = harness
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



def test_derived_cells_csv_only_columns_and_tables_sharing_one_csv(tmp_path):
    tables = harness
    t = tables.Table(("case", "case"), ("us", None), ("tb_s", None),
                     ("ours", "ours", lambda r: f"{r['us']:.0f} us ({r['tb_s']:.2f} TB/s)"), name="decode")
    assert t.header() == "| case | ours |\n|---|---|"                 # CSV-only columns are not shown
    assert t.add(case="N=64", us=812.4, tb_s=2.0651) == "| N=64 | 812 us (2.07 TB/s) |"
    with pytest.raises(KeyError, match="ours"):                     # a derived cell is no CSV column
        t.add(case="N=1", us=1.0, tb_s=1.0, ours="1 us")
    s = tables.Table(("path", "path"), ("mean_s", "mean s", ".3f"), name="ttft")
    s.add(path="one server", mean_s=0.25)
    path = tmp_path / "two.csv"
    tables.write_csv(str(path), t, s)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"table": "decode", "case": "N=64", "us": "812.4", "tb_s": "2.0651", "path": "", "mean_s": ""},
                    {"table": "ttft", "case": "", "us": "", "tb_s": "", "path": "one server", "mean_s": "0.25"}]

def test_header_names_command_date_machine_and_commit():
    lines = harness.header("e2e", devices=False, anchors="copy 4.26 TB/s").splitlines()
    assert lines[0] == "# e2e"
    keys = [line.split(":")[0] for line in lines[1:]]
    assert keys == ["# command", "# date", "# machine", "# commit", "# anchors"]
    assert lines[-1] == "# anchors: copy 4.26 TB/s"
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    assert lines[4].removeprefix("# commit: ").removesuffix("+dirty") == (sha or "unknown")
    assert lines[1].startswith("# command: python ")


def test_rel_err_max_and_rms():
    ref = np.array([1.0, -2.0, 4.0])
    out = ref + np.array([0.0, 0.5, -1.0])
    assert harness.rel_err(out, ref) == 0.25                                   # max |diff| / max |ref|
    assert harness.rel_err(out, ref, norm="rms") == pytest.approx(np.sqrt(1.25 / 3) / np.sqrt(21 / 3))
    assert harness.rel_err(ref, ref) == 0.0
    with pytest.raises(ValueError, match="norm"):
        harness.rel_err(out, ref, norm="l1")


def test_json_keeps_the_run_and_csv_reads_back(tmp_path):
    t = harness.Table(("workload", "workload"), ("tok_s", "tok/s", ",.0f"))
    t.add(workload="c16", tok_s=1109.4)
    t.add(workload="c64")
    harness.write_json(str(tmp_path / "r.json"), {"rows": t.rows}, devices=False)
    got = json.loads((tmp_path / "r.json").read_text())
    assert set(got["run"]) == {"command", "date", "machine", "commit"} and got["result"]["rows"] == t.rows
    t.write_csv(str(tmp_path / "r.csv"))
    assert harness.read_csv(str(tmp_path / "r.csv")) == [{"workload": "c16", "tok_s": 1109.4},
                                                         {"workload": "c64", "tok_s": None}]


def test_bar_chart_draws_every_value(tmp_path):
    groups, series = ["prefill", "c16"], {"before": [100.0, 7.0], "after": [300.0, 9.5]}
    fig = harness.bar_chart(groups, series, title="t", targets={"c16": 10})
    heights = sorted(round(p.get_height(), 1) for ax in fig.axes for p in ax.patches)
    assert heights == [7.0, 9.5, 100.0, 300.0]
    harness.bar_chart(groups, series, str(tmp_path / "c.png"))
    with Image.open(tmp_path / "c.png") as img:
        assert img.format == "PNG"


def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_disagg_ttft_table_prints_as_before_and_keeps_mean_and_median(tmp_path, capsys):
    disagg = bench_disagg
    ttfts = {"disaggregated": [0.25, 0.5, 1.5], "local": [0.125, 0.75]}
    disagg.print_ttft_table(ttfts).write_csv(str(tmp_path / "t.csv"))
    assert capsys.readouterr().out.splitlines() == [
        "| path | mean TTFT s | median TTFT s |", "|---|---|---|",
        "| disaggregated | 0.750 | 0.500 |", "| local | 0.438 | 0.438 |"]
    assert [(r["path"], float(r["mean_ttft_s"]), float(r["median_ttft_s"])) for r in _csv_rows(tmp_path / "t.csv")] == [
        ("disaggregated", 0.75, 0.5), ("local", 0.4375, 0.4375)]
