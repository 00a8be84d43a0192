"""benchmarks/bench_compile.py: every warm-up shape of the default engine, traced and compiled with
abstract weights (nothing allocated)."""
import json

import pytest

from benchmarks import bench_compile


@pytest.mark.slow     # CI's time budget; the GPU queue runs the benchmark itself
def test_measures_the_runner_warmup_shapes(capsys):
    bench_compile.main(["--model", "tiny-random", "--max-shapes", "1", "--buckets", "accelerator", "--json"])
    res = json.loads(capsys.readouterr().out)
    # an accelerator's default EngineArgs (64 sequences, 4096 tokens): T in 16, 64, 256, 1024, 4096 x N in 4,
    # 16, 64 (N <= T), plus decode-only variants of (16, 4), (16, 16) and (64, 64)
    assert res["model"] == "tiny-random" and res["buckets"] == "accelerator" and res["shapes_total"] == 17
    (row,) = res["shapes"]
    assert (row["tokens"], row["seqs"], row["decode_only"]) == (16, 4, False)
    assert row["trace_s"] > 0 and row["compile_s"] > 0
    assert res["total_s"] == round(row["trace_s"] + row["compile_s"], 2)
