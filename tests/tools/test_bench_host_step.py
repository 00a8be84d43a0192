"""bench_host_step's rows on the tiny model: every row measured, the decode and verification steps' tokens valid."""
from benchmarks.bench_host_step import measure


def test_host_step_rows_with_verification():
    r = measure(seqs=2, steps=2, verify=3)
    assert r["sampled_ok"] and r["verify_ok"] and r["verify"] == 3
    assert r["host_arrays"] > 5, "the batch and sampling arrays a step copies to the device"
    for row in ("dispatch", "dispatch host", "put", "launch", "step", "verify launch", "verify step"):
        assert 0 < r[row]["min_ms"] <= r[row]["median_ms"], row
