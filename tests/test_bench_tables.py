"""scripts/tables.py (benchmark rows as markdown and CSV) and scripts/plot_benchmarks.py (docs charts)."""
import csv
import importlib.util
from pathlib import Path

import pytest
from PIL import Image

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



def test_derived_cells_csv_only_columns_and_tables_sharing_one_csv(tmp_path):
    tables = _script("tables")
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

def test_docs_charts_plot_the_committed_csvs_which_match_the_docs_tables(tmp_path):
    plot = _script("plot_benchmarks")
    docs = (ROOT / "docs" / "benchmarks.md").read_text() + (ROOT / "docs" / "bench_moe.md").read_text()
    data = ROOT / "docs" / "data"
    e2e = plot.read_csv(str(data / "e2e_full_depth.csv"))
    moe = plot.read_csv(str(data / "moe_prefill_mlp.csv"))
    # transcribed from the docs' tables: every figure is there as printed
    for r in e2e:
        cell = (f"{r['prompt_tok_s']:,.0f} prompt tok/s" if r["prompt_tok_s"] is not None
                else f"{r['output_tok_s']:,.1f} output tok/s")
        assert f"| {r['workload']} | " in docs and cell in docs, (r["run"], r["workload"])
    for r in moe:
        assert f"| {r['us']} | {r['tflop_s']:.1f} |" in docs.replace("**", ""), r
    # the charts draw those numbers: bar heights in drawing order
    heights = lambda fig: sorted(round(p.get_height(), 1) for ax in fig.axes for p in ax.patches)  # noqa: E731
    e2e_keys = {"prefill 64 x 2048": "prompt_tok_s", "c16, 1024 in / 1024 out": "output_tok_s",
                "c64, 1024 in / 256 out": "output_tok_s"}
    assert heights(plot.e2e_full_depth(e2e)) == sorted(r[e2e_keys[r["workload"]]] for r in e2e
                                                       if r["workload"] in e2e_keys)
    assert heights(plot.moe_prefill_mlp(moe)) == sorted(r["tflop_s"] for r in moe)
    plot.main(["--out", str(tmp_path)])
    for name in plot.CHARTS:         # the committed charts are this script's (pixels vary with matplotlib's version)
        with Image.open(tmp_path / f"{name}.png") as made, Image.open(ROOT / "docs" / "img" / f"{name}.png") as kept:
            assert made.format == kept.format == "PNG" and made.size == kept.size


def test_bench_kda_table_prints_the_cells_it_printed_before_its_csv():
    kda = _script("bench_kda")
    t, ta, nbytes, bw = 812.4e-6, 905.1e-6, 2 * 64 * 32 * 128 * 128 * 4, 4.1e12
    table = _script("tables").Table(*kda.TABLE.columns)
    # the cells as bench_kda formatted them before it kept raw values (decode with and without FLA, prefill, skipped)
    assert table.add(case="decode N=64 H=32", us=t * 1e6, tb_s=nbytes / t / 1e12, anchor_us=ta * 1e6,
                     anchor_tb_s=nbytes / ta / 1e12, vs_anchor=ta / t, of_copy=nbytes / t / bw) == (
        f"| decode N=64 H=32 | {t*1e6:.0f} us | {nbytes/t/1e12:.2f} TB/s | {ta*1e6:.0f} us ({nbytes/ta/1e12:.2f} TB/s) "
        f"| {ta/t:.2f}x | {nbytes/t/bw:.0%} |")
    assert table.add(case="d", us=t * 1e6, tb_s=1.0, of_copy=0.5) == "| d | 812 us | 1.00 TB/s | n/a | n/a | 50% |"
    tok, io = 32768, 32768 * 32 * 128 * 14
    assert table.add(case="p", mtok_s=tok / t / 1e6, tb_s=io / t / 1e12, anchor_mtok_s=tok / ta / 1e6,
                     vs_anchor=ta / t, of_copy=io / t / bw) == (
        f"| p | {tok/t/1e6:.2f} M tok/s | {io/t/1e12:.2f} TB/s io | {tok/ta/1e6:.2f} M tok/s | {ta/t:.2f}x "
        f"| {io/t/bw:.0%} |")
    assert table.add(case="s", note="skipped (deadline)") == "| s | skipped (deadline) |  |  |  |  |"


def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_disagg_ttft_table_prints_as_before_and_keeps_mean_and_median(tmp_path, capsys):
    disagg = _script("bench_disagg")
    ttfts = {"disaggregated": [0.25, 0.5, 1.5], "local": [0.125, 0.75]}
    disagg.print_ttft_table(ttfts).write_csv(str(tmp_path / "t.csv"))
    assert capsys.readouterr().out.splitlines() == [
        "| path | mean TTFT s | median TTFT s |", "|---|---|---|",
        "| disaggregated | 0.750 | 0.500 |", "| local | 0.438 | 0.438 |"]
    assert [(r["path"], float(r["mean_ttft_s"]), float(r["median_ttft_s"])) for r in _csv_rows(tmp_path / "t.csv")] == [
        ("disaggregated", 0.75, 0.5), ("local", 0.4375, 0.4375)]


def test_check_kernels_gpu_tables_print_as_before_and_share_one_csv(tmp_path):
    check = _script("check_kernels_gpu")
    ops, step = check.op_table(), check.step_table("decode step, 16 seqs x 4k context")
    eo, es = 3.1e-3, 2.7e-4
    assert ops.add(op="kda chunk", rel_err=eo, state_rel_err=es) == f"| kda chunk | {eo:.2e} / state {es:.2e} |"
    assert ops.add(op="mla ragged", rel_err=eo) == f"| mla ragged | {eo:.2e} |"
    assert ops.add(op="moe", error="FAILED ValueError: x") == "| moe | FAILED ValueError: x |"
    assert step.add(model="m first 8 layers", kernels_ms=12.345, reference_ms=20.0) == "| m first 8 layers | 12.35 | 20.00 |"
    check.write_csv(str(tmp_path / "c.csv"), ops, step)
    rows = _csv_rows(tmp_path / "c.csv")
    assert [(r["table"], r["op"] or r["model"]) for r in rows] == [
        ("ops", "kda chunk"), ("ops", "mla ragged"), ("ops", "moe"), ("decode_step", "m first 8 layers")]
    assert float(rows[0]["state_rel_err"]) == es and rows[1]["state_rel_err"] == "" and float(rows[3]["kernels_ms"]) == 12.345


def test_check_tiny_gpu_tables_print_as_before():
    greedy, ppl = _script("check_tiny_gpu").result_tables()
    agree = 1900 / 4096
    assert greedy.add(positions=4096, equal=agree, identical_rows=3, prompts=16, first_divergence_median=92,
                      reference_s=41.26, auto_s=38.04) == f"| 4096 | {100 * agree:.1f}% | 3/16 | 92 | 41.3 | 38.0 |"
    assert ppl.add(experts_ops="mxfp4/auto", perplexity=56.4449) == "| mxfp4/auto | 56.445 |"


def test_bench_moe_tables_print_as_before_and_keep_raw_values_in_the_csv(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    moe = _script("bench_moe")
    monkeypatch.setattr(moe, "ROWS", [("K (8 rows)", "bf16 gmm", 12.345, 100.0, 2.5, 0.2, 0.6, "ok"),
                                      ("K (8 rows)", "ours / anchor speedup", 1.234, None, None, None, None, "x")])
    out, t = moe.table(7e14, 4e12, "H200")
    lines = out.splitlines()
    # the lines the f-strings before tables.py printed for a measured row and a speedup row
    assert lines[-2] == "| K (8 rows) | bf16 gmm | 12.3 | 100.0 | 2.50 | 20% | 60% | ok |"
    assert lines[-1] == "| K (8 rows) | ours / anchor speedup |  | 1.23x |  |  |  | x |"
    t.write_csv(str(tmp_path / "m.csv"))
    rows = list(csv.DictReader(open(tmp_path / "m.csv")))
    assert rows[0]["us"] == "12.345" and rows[0]["of_peak_bw"] == "0.6" and rows[1]["speedup"] == "1.234"
    pre = _script("bench_moe_prefill")
    run = type("Run", (), {"rows": [dict(shape="s", op="mxfp4 MLP", tiling=None, us=1.25, tflops=291.24,
                                         note="n"), dict(shape="s", op="ratio", tiling=None, us=None,
                                                         tflops=None, ratio=0.69, note="a vs b")]})
    out, t = pre.table(run, "# head")
    assert out.splitlines()[-2:] == ["| s | mxfp4 MLP |  | 1.2 | 291.2 |  | n |", "| s | ratio |  |  |  | 0.690 | a vs b |"]
