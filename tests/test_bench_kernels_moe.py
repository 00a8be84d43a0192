"""benchmarks/bench_kernels.py --only moe at toy sizes on CPU (kernels interpreted): for both models the
isolated kernel, the layer's routed-experts part and the whole MoE layer each make a row, checked against
the jnp references, with the FLOPs counted from the config's shapes."""
import jax
import pytest

from benchmarks import bench_kernels, kernels_moe as moe_rows


def test_moe_section_rows_are_checked_and_count_the_layer_flops(monkeypatch):
    monkeypatch.setattr(moe_rows, "steps", lambda tiny: [("prefill", 16)])   # one step
    # one interpreted call a row, not time_jax's 6: the row's FLOPs are checked, not its time
    def one_call(fn, *args, reps):
        jax.block_until_ready(fn(*args))
        return 1e-3
    monkeypatch.setattr(moe_rows, "time_jax", one_call)
    rows = [r for r in bench_kernels.main(["--tiny", "--only", "moe", "--no-fla", "--budget", "1e9"]) if r["kernel"].startswith("MoE")]
    assert [(r["case"].split()[0], r["call"], r["variant"].split()[0]) for r in rows] == [
        (m, call, v) for m, name in (("K3", "K3"), ("Kimi-Linear", "Kimi-Linear"))
        for call, v in (("isolated", "ops.expert_mlp,"), (f"as model: {name}", "routed"), (f"as model: {name}", "MoE"))]
    for r in rows:
        err = float(r["target"].removeprefix("rel err "))
        assert 0 < err < 3e-2, r
    # toy configs (kernels_moe.case_config): K3 hidden 256, latent 128, 2 shared experts of 64;
    # Kimi-Linear hidden 128, 1 shared expert of 64; 8 experts of intermediate 64, top-2, T = 16
    T, k, E, inter = 16, 2, 8, 64
    routed = {"K3": 6 * T * k * 128 * inter, "Kimi-Linear": 6 * T * k * 128 * inter}
    other = {"K3": 2 * T * (256 * E + 2 * 256 * 128 + 3 * 256 * 2 * inter),
             "Kimi-Linear": 2 * T * (128 * E + 3 * 128 * inter)}
    for r in rows:
        m = r["case"].split()[0]
        want = routed[m] + (other[m] if r["variant"].startswith("MoE layer") else 0)
        assert r["tflop_s"] * 1e12 * r["us"] * 1e-6 == pytest.approx(want, rel=1e-9)
        assert (r["vs_anchor"] is None) == (r["call"] == "isolated")
