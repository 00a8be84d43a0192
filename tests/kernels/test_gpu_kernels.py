"""The gpu tier: the kernels against their references on a GPU, op by op at model shapes (ragged KDA
chunks with initial states, ragged paged MLA, the expert MLP in bf16 and MXFP4) and the routed-experts
layer at K3 and Kimi-Linear-48B sizes in both expert layouts. Skipped without a GPU; CI deselects the
tier (`-m 'not gpu'`). On a GPU machine (the conftest defaults JAX to the CPU):

  JAX_PLATFORMS=cuda python -m pytest -m gpu -n 0 tests/kernels/test_gpu_kernels.py tests/model/test_gpu_tiny.py

Errors are max |kernel - reference| / max |reference|. Bounds: fp32 KDA at 1e-4 (the H200 measured
~1e-6), bf16 outputs at 2e-2 (bf16 rounding of inputs and outputs: 3e-3 to 7e-3 measured).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.gpu_marks import GPU_ONLY

from benchmarks.harness import rel_err


pytestmark = GPU_ONLY

BF16_TOL = 2e-2


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, BF16_TOL)])
@pytest.mark.parametrize("H,K,lens", [(4, 32, (30, 7, 1, 90)), (32, 128, (1000, 1, 300, 64)), (32, 128, (1,) * 16)])
def test_kda_chunk_matches_the_recurrence(dtype, tol, H, K, lens):
    from pallas_kernels import kda
    r = np.random.RandomState(0)
    T = sum(lens)
    l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q = jnp.asarray(l2(r.randn(1, T, H, K)), dtype)
    k = jnp.asarray(l2(r.randn(1, T, H, K)), dtype)
    v = jnp.asarray(r.randn(1, T, H, K), dtype)
    g = jnp.asarray(-5 * (1 / (1 + np.exp(-r.randn(1, T, H, K)))), jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-r.randn(1, T, H))), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    s0 = jnp.asarray(r.randn(len(lens), H, K, K) * 0.1, jnp.float32)
    o1, s1 = kda.chunk_kda(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    o2, s2 = kda.recurrent_kda_reference(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    assert rel_err(o1, o2) < tol and rel_err(s1, s2) < tol


@pytest.mark.parametrize("H,L,R,ps,lens,ctx", [(4, 64, 16, 16, (30, 7, 1), (0, 16, 40)),
                                                (32, 512, 64, 64, (1,) * 16, (4000,) * 16),
                                                (32, 512, 64, 64, (512, 1), (0, 900))])
def test_mla_ragged_paged_matches_the_reference(H, L, R, ps, lens, ctx):
    from pallas_kernels import mla
    r = np.random.RandomState(1)
    N, T = len(lens), sum(lens)
    kv_lens = np.asarray(ctx) + np.asarray(lens)
    maxp = int(-(-kv_lens.max() // ps))
    pages = jnp.asarray(r.randn(N * maxp + 1, ps, L + R), jnp.bfloat16)
    bt = jnp.asarray(1 + r.permutation(N * maxp).reshape(N, maxp), jnp.int32)
    ql = jnp.asarray(r.randn(T, H, L) * 0.05, jnp.bfloat16)
    qr = jnp.asarray(r.randn(T, H, R) * 0.05, jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    args = (ql, qr, pages, bt, cu, jnp.asarray(kv_lens, jnp.int32))
    assert rel_err(mla.ragged_paged_mla(*args, scale=0.07), mla.ragged_paged_mla_reference(*args, scale=0.07)) < BF16_TOL


@pytest.mark.parametrize("fmt,T,D,I,E,k", [("mxfp4", 512, 3584, 3072, 112, 16), ("mxfp4", 16, 64, 64, 16, 4),
                                           ("bf16", 16, 2304, 1024, 256, 8), ("bf16", 2048, 2304, 1024, 256, 8)])
def test_expert_mlp_matches_the_routed_reference(fmt, T, D, I, E, k):
    from k3jax.layers.moe import routed_experts_reference
    from k3jax.presets import preset_config
    from pallas_kernels import moe
    r = np.random.RandomState(2)
    x = jnp.asarray(r.randn(T, D), jnp.bfloat16)
    ids = jnp.asarray(np.stack([r.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
    w = jnp.asarray(r.rand(T, k), jnp.float32)
    # the reference routes over config.num_experts experts: it must be E (fewer would drop ids >= it)
    if fmt == "bf16":
        c = dataclasses.replace(preset_config("kimi-linear-48b-a3b"), num_experts=E)
        ws = [jnp.asarray(r.randn(E, a, b) / np.sqrt(a), jnp.bfloat16) for a, b in ((D, I), (D, I), (I, D))]
        out = moe.expert_mlp(x, ids, w, *ws, activation="silu")
        ref = routed_experts_reference({"w1": ws[0], "w3": ws[1], "w2": ws[2]}, x, w, ids, c, mxfp4=False)
    else:
        c = dataclasses.replace(preset_config("tiny-random"), num_experts=E)
        packs = [moe.quantize_mxfp4(jnp.asarray(r.randn(E, b, a) / np.sqrt(a), jnp.float32))
                 for a, b in ((D, I), (D, I), (I, D))]
        out = moe.expert_mlp_mxfp4(x, ids, w, *packs, activation="situ")
        pe = {f"{n}_packed": p[0] for n, p in zip(("w1", "w3", "w2"), packs)}
        pe.update({f"{n}_scale": p[1] for n, p in zip(("w1", "w3", "w2"), packs)})
        ref = routed_experts_reference(pe, x, w, ids, c, mxfp4=True)
    assert rel_err(out, ref) < BF16_TOL


def _experts(c, key):
    """Random experts in the checkpoint layout (MXFP4: quantized from normal weights)."""
    from pallas_kernels import moe
    E, D, I = c.num_experts, c.expert_hidden, c.moe_intermediate_size
    w = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) / np.sqrt(shape[-1])  # noqa: E731
    if c.expert_format != "mxfp4":
        return {n: w(i, s).astype(jnp.bfloat16) for i, (n, s) in
                enumerate((("w1", (E, D, I)), ("w3", (E, D, I)), ("w2", (E, I, D))))}
    out = {}
    for i, (n, shape) in enumerate((("w1", (E, I, D)), ("w3", (E, I, D)), ("w2", (E, D, I)))):
        out[f"{n}_packed"], out[f"{n}_scale"] = moe.quantize_mxfp4(w(i, shape))
    return out


@pytest.mark.parametrize("preset,num_experts", [("kimi-k3", 112), ("kimi-linear-48b-a3b", 256)])
@pytest.mark.parametrize("tokens,layout", [(8192, "merged"), (8192, "checkpoint"), (64, "merged")])
def test_routed_experts_layer_matches_the_dense_reference(preset, num_experts, tokens, layout):
    """RoutedExperts through the kernels (the Backend the runner builds) at the model's expert sizes
    (K3: one of 8 expert-parallel devices' experts), merged gate/up (as loaded) or the checkpoint's
    separate w1 / w3 (the expert-parallel path), against every expert computed densely."""
    from benchmarks.kernels_moe import REF_TOKENS, case_config, dense_reference
    from k3jax.expert_layout import merge_experts
    from k3jax.layers.moe import RoutedExperts
    from k3jax.params import experts_spec
    from pallas_kernels.backend import detect
    c = case_config(preset, num_experts, False, hidden_act="situ")
    key = jax.random.key(0)
    pe = _experts(c, key)
    z = jax.random.normal(jax.random.fold_in(key, 10), (tokens, c.expert_hidden), jnp.bfloat16)
    w, ids = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(key, 11), (tokens, c.num_experts)),
                           c.num_experts_per_token)
    ref = jax.jit(lambda pe, z, w, ids: dense_reference(pe, z, w, ids, c))(pe, z, w, ids)
    values = merge_experts(pe) if layout == "merged" else pe
    spec = experts_spec(c, merged=layout == "merged")
    kernels = detect("pallas")
    out = jax.jit(lambda v, z, w, ids: RoutedExperts(spec, v, c)(z, w, ids, c, backend=kernels))(values, z, w, ids)
    assert rel_err(out[:REF_TOKENS], ref) < BF16_TOL


@pytest.mark.parametrize("fp8_scale", ["scores", "codes"])
@pytest.mark.parametrize("H,ps,lens,ctx", [(32, 16, (1,) * 8, (3000,) * 8),       # decode, gathered 64-key blocks
                                            (96, 64, (1,) * 8, (3000,) * 8),       # decode, blocks inside a page
                                            (32, 64, (512, 1), (0, 900))])         # ragged prefill + decode
def test_mla_ragged_paged_on_fp8_pages_matches_the_reference(H, ps, lens, ctx, fp8_scale):
    """The Triton kernel on packed FP8 rows (four scale tiles, bf16 rope) against the jnp reference on the
    same pages, in both scale placements."""
    from pallas_kernels import mla
    from pallas_kernels.mla import fp8_cache
    L, R = 512, 64
    r = np.random.RandomState(2)
    N, T = len(lens), sum(lens)
    kv_lens = np.asarray(ctx) + np.asarray(lens)
    maxp = int(-(-kv_lens.max() // ps))
    rows = r.randn(N * maxp + 1, ps, L + R) * np.logspace(-2, 1, L + R)[r.permutation(L + R)]   # tiles' scales differ
    pages = fp8_cache.quantize(jnp.asarray(rows, jnp.float32), L)
    bt = jnp.asarray(1 + r.permutation(N * maxp).reshape(N, maxp), jnp.int32)
    ql = jnp.asarray(r.randn(T, H, L) * 0.05, jnp.bfloat16)
    qr = jnp.asarray(r.randn(T, H, R) * 0.05, jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    args = (ql, qr, pages, bt, cu, jnp.asarray(kv_lens, jnp.int32))
    config = None if fp8_scale == "scores" else (("fp8_scale", fp8_scale),)   # None: the engine's tuning
    got = mla.ragged_paged_mla(*args, scale=0.07, decode_only=max(lens) == 1, config=config)
    assert rel_err(got, mla.ragged_paged_mla_reference(*args, scale=0.07)) < BF16_TOL


@pytest.mark.parametrize("rows", [1, 4, 16, 64])
def test_stacked_products_in_one_launch_match_each_alone(rows):
    """A KDA layer's projections of one input at Kimi-Linear-48B's widths (q, k, v 4096 wide, f_a 128, b 32,
    g_a 128 from D 2304) and the shared expert's GLU, read in place in their stacks: the one-launch kernel
    gives each product's bits as its own launch does, and the GLU kernel act(x @ gate, x @ up) within bf16."""
    from pallas_kernels import stacked
    from pallas_kernels.moe.kernel import glu_activation
    r = np.random.RandomState(3)
    D, L = 2304, 4
    ws = [jnp.asarray(r.randn(L, D, n) * 0.02, jnp.bfloat16) for n in (4096, 4096, 4096, 128, 32, 128)]
    x = jnp.asarray(r.randn(rows, D), jnp.bfloat16)
    i = jnp.int32(2)
    many = jax.jit(lambda x, ws, i: stacked.stacked_matmuls([(x, w) for w in ws], i, kernel=True))(x, ws, i)
    for got, w in zip(many, ws):
        alone = jax.jit(lambda x, w, i: stacked.stacked_matmul(x, w, i, kernel=True))(x, w, i)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(alone))
        assert rel_err(got, np.asarray(x, np.float32) @ np.asarray(w[2], np.float32)) < BF16_TOL
    act = lambda g, u: glu_activation(g, u, "silu").astype(jnp.bfloat16)   # noqa: E731
    g = jax.jit(lambda x, a, b, i: stacked.stacked_glu(x, a, b, i, act, kernel=True))(x, ws[0][:, :, :1024],
                                                                                         ws[1][:, :, :1024], i)
    ref = act(np.asarray(x, np.float32) @ np.asarray(ws[0][2, :, :1024], np.float32),
              np.asarray(x, np.float32) @ np.asarray(ws[1][2, :, :1024], np.float32))
    assert rel_err(g, ref) < BF16_TOL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kda_positions_kernel_is_the_decode_kernel_bit_for_bit(dtype):
    """Kimi-Linear's KDA widths (32 heads of 128), four sequences of a verification step with K = 4 drafts: the
    one-launch positions kernel against the decode kernel launched once per position on the state array.
    Outputs, every kept state and the last states are the same bits: a verified token rounds as decoding it."""
    from pallas_kernels.kda import fused_recurrent_kda, fused_recurrent_kda_positions
    N, W, H, K, slots = 4, 5, 32, 128, 40
    r = np.random.default_rng(3)
    nrm = lambda x: x / np.sqrt((x ** 2).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = (jnp.asarray(nrm(r.standard_normal((N, W, H, K))), dtype) for _ in range(2))
    v = jnp.asarray(r.standard_normal((N, W, H, K)), dtype)
    g = jnp.asarray(-5.0 / (1 + np.exp(-2 * r.standard_normal((N, W, H, K)))), jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-r.standard_normal((N, W, H)))), dtype)
    s0 = jnp.asarray(r.standard_normal((N, H, K, K)) * 0.3, jnp.float32)
    pool = jnp.zeros((slots, H, K, K), jnp.float32)
    run = np.zeros((N, W), bool)
    run[0], run[1, :1], run[2, :3] = True, True, True
    dst = np.full((N, W), -1, np.int32)
    dst[0], dst[1, 0], dst[2, :3] = [3, 4, 5, 6, 7], 9, [11, 12, 13]
    o, last, P = jax.jit(fused_recurrent_kda_positions)(q, k, v, g, beta, pool, s0, jnp.asarray(run),
                                                          jnp.asarray(dst))
    step = jax.jit(fused_recurrent_kda)
    rows = jnp.arange(N, dtype=jnp.int32)
    states = s0
    for t in range(W):
        o_t, states = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], states, jnp.where(run[:, t], rows, -1))
        np.testing.assert_array_equal(np.asarray(o[:, t], np.float32), np.asarray(o_t, np.float32))
        for n in np.nonzero(run[:, t])[0]:
            np.testing.assert_array_equal(np.asarray(P[dst[n, t]]), np.asarray(states[n]))
    np.testing.assert_array_equal(np.asarray(last), np.asarray(states))


@pytest.mark.parametrize("H,kernel", [(32, "triton"), (96, "mosaic")])
def test_mla_decode_short_contexts_in_a_wide_table(H, kernel):
    """Decode rows whose contexts are far shorter than the block table (max_model_len's width: 65,536 keys here):
    the key splits divide each row's own context (splits.split_range), on the Triton kernel and, at K3's 96 heads,
    the Mosaic GPU kernel (skipped off Hopper)."""
    from pallas_kernels import mla
    from pallas_kernels.backend import _hopper
    if kernel == "mosaic" and not _hopper():
        pytest.skip("the Mosaic GPU MLA kernel needs Hopper")
    r = np.random.RandomState(2)
    L, R, ps, width = 512, 64, 16, 4096
    kv_lens = np.asarray([100, 2000, 1, 5000], np.int32)
    N = len(kv_lens)
    pages = jnp.asarray(r.randn(N * width + 1, ps, L + R), jnp.bfloat16)
    bt = jnp.asarray(1 + r.permutation(N * width).reshape(N, width), jnp.int32)
    ql = jnp.asarray(r.randn(N, H, L) * 0.05, jnp.bfloat16)
    qr = jnp.asarray(r.randn(N, H, R) * 0.05, jnp.bfloat16)
    cu = jnp.arange(N + 1, dtype=jnp.int32)
    args = (ql, qr, pages, bt, cu, jnp.asarray(kv_lens))
    got = mla.ragged_paged_mla(*args, scale=0.07, decode_only=True, decode_kernel=kernel)
    assert rel_err(got, mla.ragged_paged_mla_reference(*args, scale=0.07)) < BF16_TOL
