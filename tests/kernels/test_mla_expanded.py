"""Expanded-form MLA prefill (pallas_kernels/mla/expanded.py) vs the absorbed reference.

The two forms are the same attention: scores q_nope.(ckv W_uk) = (q_nope W_uk^T).ckv and output
P (ckv W_uv) = (P ckv) W_uv. Cases: resumed chunks over paged context, a fresh prompt, decode
rows, empty sequences and padding tokens, on a pool whose unused slots are NaN.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import detect
from pallas_kernels.mla.expanded import expanded_attention, gather_latents
from pallas_kernels.mla.reference import ragged_paged_mla_reference
from tests.kernels.test_mla_ops import build_case
from tests.support.tiers import slow_case

pytestmark = pytest.mark.interpret

H, L, R, DN, DV = 4, 32, 16, 16, 8
SCALE = (DN + R) ** -0.5


@functools.lru_cache(maxsize=None)
def _case(page_size):
    rng = np.random.default_rng(30 + page_size)
    # resumed prefill chunk, decode row, fresh prompt longer than a tile, empty sequence, chunk on a boundary
    ctx, new = [13, 20, 0, 0, 2 * page_size], [7, 1, 70, 0, 5]
    case = build_case(rng, ctx, new, heads=H, lat=L, rope=R, page_size=page_size, pad_tokens=6)
    t = case["q_latent"].shape[0]
    w_uk = rng.standard_normal((L, H, DN)).astype(np.float32) / np.sqrt(L)
    w_uv = rng.standard_normal((L, H, DV)).astype(np.float32) / np.sqrt(L)
    q_nope = rng.standard_normal((t, H, DN)).astype(np.float32)
    return case, jnp.asarray(w_uk), jnp.asarray(w_uv), jnp.asarray(q_nope)


def _absorbed(case, w_uk, w_uv, q_nope):
    q_lat = jnp.einsum("thd,lhd->thl", q_nope, w_uk)
    o_lat = ragged_paged_mla_reference(q_lat, *(jnp.asarray(case[k]) for k in (
        "q_rope", "kv_pages", "block_tables", "cu_seqlens", "kv_lens")), scale=SCALE)
    return np.asarray(jnp.einsum("thl,lhd->thd", o_lat, w_uv))


def _expanded(case, w_uk, w_uv, q_nope, num_keys, **kw):
    kv_lens = jnp.asarray(case["kv_lens"])
    rows, starts = gather_latents(jnp.asarray(case["kv_pages"]), jnp.asarray(case["block_tables"]),
                                  kv_lens, num_keys)
    kv = jnp.einsum("kl,lhd->khd", rows[:, :L], jnp.concatenate([w_uk, w_uv], axis=-1))
    q = jnp.concatenate([q_nope, jnp.asarray(case["q_rope"])], axis=-1)
    return np.asarray(expanded_attention(q, kv, rows, jnp.asarray(case["cu_seqlens"]), kv_lens, starts,
                                         nope_dim=DN, scale=SCALE, **kw))


@pytest.mark.parametrize("page_size,config", [
    (16, (("bq", 16), ("bk", 16))),  # tiles inside a prompt
    slow_case(8, (("bq", 32), ("bk", 16))),   # a tile spans the sequence end
])
def test_kernel_equals_absorbed(page_size, config):
    """The Triton kernel (interpret mode); the jnp path is checked in the whole-model test below."""
    case, w_uk, w_uv, q_nope = _case(page_size)
    want = _absorbed(case, w_uk, w_uv, q_nope)
    num_keys = int(case["kv_lens"].sum()) + 9  # slack rows past the last key stay unused
    got = _expanded(case, w_uk, w_uv, q_nope, num_keys, interpret=True, config=config)
    assert np.all(np.isfinite(got)), "a NaN page slot leaked"
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.all(got[case["cu_seqlens"][-1]:] == 0), "padding tokens must be zero"


def test_gather_latents_lays_sequences_flat():
    case, *_ = _case(8)
    kv_lens = case["kv_lens"]
    rows, starts = gather_latents(jnp.asarray(case["kv_pages"]), jnp.asarray(case["block_tables"]),
                                  jnp.asarray(kv_lens), int(kv_lens.sum()) + 3)
    want = np.concatenate([c for c in case["caches"]] + [np.zeros((3, L + R), np.float32)])
    np.testing.assert_array_equal(np.asarray(rows), want)
    np.testing.assert_array_equal(np.asarray(starts), np.cumsum(kv_lens) - kv_lens)


@pytest.mark.slow     # CI's time budget (the model's steps in both forms); the op-level equality runs by default
def test_tiny_model_steps_equal_between_forms(monkeypatch):
    """The engine step's logits and caches (scanned layout, stacked pools) with the MLA layers' backend
    absorbed vs expanded: a fresh
    prefill of two prompts, then resumed chunks over paged context with a decode row and padding.
    A key window of one row per step token (64) makes the second step's 66 keys two windows."""
    from k3jax.cache import SeqChunk, make_pools, make_step_batch
    from k3jax.layer_stack import stack_layers
    from k3jax.layers import mla
    from k3jax.nnx_model import make_step
    from k3jax.params import init_params_numpy
    from k3jax.presets import preset_config

    monkeypatch.setattr(mla, "EXPANDED_KEYS_PER_TOKEN", 1)
    monkeypatch.setattr(mla, "EXPANDED_MIN_WINDOW_KEYS", 0)
    c = preset_config("tiny-random")
    params = stack_layers(init_params_numpy(c, 5, jnp.float32), c)      # the runner's (scanned) layout
    rng = np.random.RandomState(1)
    toks = [rng.randint(0, c.vocab_size, n).astype(np.int32) for n in (37, 20, 9)]
    tables = [np.arange(1, 9), np.arange(9, 17), np.arange(17, 25)]
    steps = [[SeqChunk(toks[0][:30], 0, tables[0], -1, 1), SeqChunk(toks[1][:19], 0, tables[1], -1, 2)],
             [SeqChunk(toks[0][30:], 30, tables[0], 1, 1), SeqChunk(toks[1][19:], 19, tables[1], 2, 2),
              SeqChunk(toks[2], 0, tables[2], -1, 3)]]
    out = {}
    for form in ("absorbed", "expanded"):
        backend = detect("reference", mla_prefill=form)
        step = jax.jit(make_step(c, backend))
        pools = make_pools(c, 26, 8, 5, jnp.float32)
        logits = []
        for chunks in steps:
            batch = make_step_batch(chunks, 8, num_tokens=64, num_seqs=4, max_pages=8)
            lg, pools = step(params, pools, batch)
            logits.append(np.asarray(lg)[:len(chunks)])
        out[form] = logits, list(np.asarray(pools.mla_kv))
    for a, b in zip(out["absorbed"][0], out["expanded"][0]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
    for a, b in zip(out["absorbed"][1], out["expanded"][1]):  # later layers' rows see rounding
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_prefill_form_setting_rejects_unknown():
    from k3jax.layers import mla
    from serving.engine_args import EngineArgs
    with pytest.raises(ValueError, match="mla_prefill 'dense'"):
        detect(mla_prefill="dense")
    with pytest.raises(ValueError, match="mla_prefill 'dense'"):
        EngineArgs(mla_prefill="dense")
    absorbed = detect(mla_prefill="absorbed")
    expanded = detect(mla_prefill="expanded")
    assert mla.expanded_key_budget(4096, (16, 512), 16, False, absorbed) == 0   # read when the backend was built
    assert mla.expanded_key_budget(4096, (16, 512), 16, False, expanded) == mla.EXPANDED_KEYS_PER_TOKEN * 4096
    assert mla.expanded_key_budget(512, (16, 512), 16, False, expanded) == mla.EXPANDED_MIN_WINDOW_KEYS  # short chunks
    assert mla.expanded_key_budget(64, (2, 8), 4, False, expanded) == 2 * 8 * 4  # capped by the block tables
    assert mla.expanded_key_budget(4096, (16, 512), 16, True, expanded) == 0     # decode-only steps stay absorbed


@pytest.mark.parametrize("nope,kernel", [(16, True), (48, False)])
def test_gpu_lowering_takes_the_kernel_only_where_its_blocks_fit(traced_as_gpu, nope, kernel):
    """Lowered for CUDA (no GPU needed): Kimi-Linear-like power-of-two head widths take the Triton kernel; the
    trained tiny's 48-wide nope (which the Triton lowering refused: "an array of shape (128, 48)") takes the
    jnp reference."""
    t, heads, rope, dv, lat = 64, 2, 16, 32, 64
    f = functools.partial(expanded_attention, nope_dim=nope, scale=0.1)
    args = (jax.ShapeDtypeStruct((t, heads, nope + rope), jnp.bfloat16),
            jax.ShapeDtypeStruct((t, heads, nope + dv), jnp.bfloat16),
            jax.ShapeDtypeStruct((t, lat + rope), jnp.bfloat16),
            jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert ("triton" in text) == kernel
