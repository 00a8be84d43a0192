"""benchmarks/bench_kernels.py --only moe at toy sizes on CPU (kernels interpreted): for both models the
isolated kernel, the layer's routed-experts part and the whole MoE layer each make a row, checked against
the jnp references, with the FLOPs counted from the config's shapes."""
import jax
import pytest

from benchmarks import bench_kernels, kernels_moe as moe_rows

pytestmark = pytest.mark.interpret


@pytest.mark.slow
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


@pytest.mark.slow
def test_moe_decode_rows_sweep_tiles_and_stacks(monkeypatch):
    """At a decode step K3's MXFP4 experts also get the tile sweep's isolated rows (explicit up / down
    tilings) and the routed experts over a one-layer stack, each checked against the dense reference."""
    monkeypatch.setattr(moe_rows, "steps", lambda tiny: [("decode", 2)])
    monkeypatch.setattr(moe_rows, "CASES", moe_rows.CASES[:1])                       # K3
    monkeypatch.setattr(moe_rows, "DECODE_TILE_SWEEP", moe_rows.DECODE_TILE_SWEEP[1:2])

    def one_call(fn, *args, reps):
        jax.block_until_ready(fn(*args))
        return 1e-3
    monkeypatch.setattr(moe_rows, "time_jax", one_call)
    rows = [r for r in bench_kernels.main(["--tiny", "--only", "moe", "--no-fla", "--budget", "1e9"])
            if r["kernel"].startswith("MoE")]
    up, down = moe_rows.DECODE_TILE_SWEEP[0]
    assert [r["variant"] for r in rows] == [
        "ops.expert_mlp, random top-k",
        f"tiles up {moe_rows.tiles_label(up)} / down {moe_rows.tiles_label(down)}",
        "routed experts only (moe_experts)", "routed experts, a one-layer stack (32-bit offsets)",
        "MoE layer (route + experts + shared)"]
    for r in rows:
        assert 0 < float(r["target"].removeprefix("rel err ")) < 3e-2, r


def test_stack_depth_keeps_every_stacked_array_out_of_the_copying_window():
    """Full-size stacks (shapes only): K3's down projection over 4 layers holds 2.47e9 one-byte elements,
    which the kernels would copy a slice of; the benchmark stacks K3 over 7 layers (every packed array
    past 2**32 bytes, as the model's 23 repeats) and Kimi-Linear's bf16 experts over 4."""
    from k3jax.params import moe_spec, random_values
    from pallas_kernels.moe.grouped import overflows_i32_offsets
    for label, preset, experts in moe_rows.CASES:
        c = moe_rows.case_config(preset, experts, False)
        spec = moe_spec(c, merged_experts=True)["experts"]
        depth = moe_rows.stack_depth(spec, tiny=False)
        assert depth == {"kimi-k3": 7, "kimi-linear-48b-a3b": 4}[preset]
        leaves = jax.tree_util.tree_leaves(jax.eval_shape(lambda: random_values(spec, jax.random.key(0))))
        flat = lambda d, a: (d * a.shape[0],) + a.shape[1:]  # noqa: E731
        assert not any(overflows_i32_offsets(flat(depth, a), a.dtype) for a in leaves)
        assert any(overflows_i32_offsets(flat(moe_rows.STACK_WINDOW, a), a.dtype) for a in leaves) == \
            (preset == "kimi-k3")
    assert moe_rows.stack_depth(spec, tiny=True) == moe_rows.STACK_MIN
