"""benchmarks/bench_long_context.py --tiny on CPU: every row comes out with real values, and the JSON carries
the run's header (date, machine, commit, command)."""
import json

import pytest

pytestmark = pytest.mark.slow      # one tiny engine's compiles and a dozen prompts: ~1-2 min on 2 cores



def test_tiny_mode_rows_and_header(tmp_path):
    from benchmarks import bench_long_context as bench
    out = tmp_path / "rows.json"
    header, rows = bench.main(["--tiny", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["commit"] and doc["machine"] and doc["date"] and "--tiny" in doc["command"]
    assert doc["model"] == "tiny-random" and doc["max_model_len"] == 4096
    by = {r["row"]: r for r in doc["rows"]}
    for n in ("256", "512", "1,024"):
        r = by[f"prefill {n}"]
        assert r["ttft_s"] > 0 and r["tok_s"] > 0 and 0 < r["of_roofline"]
    step = by["mla layer step, 256 tokens after 768"]
    # one window: EXPANDED_MIN_WINDOW_KEYS, capped at the keys the block tables hold (the 1,024-token prompt)
    assert step["ms"] > 0 and step["tflops"] > 0 and "expanded, 1024-key windows" in step["note"]
    assert by["mla attention op, 256 tokens after 768"]["ms"] > 0
    assert by["decode, 1 sequence at 256"]["ms"] > 0 and by["decode, 1 sequence at 1,024"]["note"].startswith("x")
    assert "largest gap" in by["4 streams while a 1,024 prompt prefills"]["note"]
    assert [r["row"] for r in rows] == [r["row"] for r in doc["rows"]]
