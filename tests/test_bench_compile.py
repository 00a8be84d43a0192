"""scripts/bench_compile.py: every warm-up shape of the default engine, traced and compiled with
abstract weights (nothing allocated)."""
import json

from scripts_module import load_script


def _script():
    return load_script("bench_compile")


def test_measures_the_runner_warmup_shapes(capsys):
    bench = _script()
    bench.main(["--model", "tiny-random", "--max-shapes", "1", "--buckets", "accelerator", "--json"])
    res = json.loads(capsys.readouterr().out)
    # default EngineArgs (16 sequences, 512 tokens) on an accelerator: T in 16, 64, 256, 512 x N in 4, 16,
    # plus decode-only variants of (16, 4) and (16, 16)
    assert res["model"] == "tiny-random" and res["buckets"] == "accelerator" and res["shapes_total"] == 10
    (row,) = res["shapes"]
    assert (row["tokens"], row["seqs"], row["decode_only"]) == (16, 4, False)
    assert row["trace_s"] > 0 and row["compile_s"] > 0
    assert res["total_s"] == round(row["trace_s"] + row["compile_s"], 2)
