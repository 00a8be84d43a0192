"""Pallas paged-MLA kernel (interpret mode on CPU) vs the float64 oracle and the reference."""
import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels.mla import mla_paged_decode, ragged_paged_mla
from pallas_kernels.mla.paged import default_tuning, pick_config
from tests.kernels.test_mla_ops import build_case, numpy_attention

pytestmark = pytest.mark.interpret

L, R = 64, 16
SCALE = 0.15
ARGS = ("q_latent", "q_rope", "kv_pages", "block_tables", "cu_seqlens", "kv_lens")


def _args(case, keys=ARGS):
    return [jnp.asarray(case[k]) for k in keys]


@pytest.mark.parametrize("page_size,config", [
    (8, None),                                  # bk=64 spans 8 pages: gathered rows
    (16, (("bk", 8), ("splits", 3), ("transposed", False))),  # bk inside a page, split-K
])
def test_decode_matches_oracle(page_size, config):
    rng = np.random.default_rng(page_size)
    ctx = [0, 6, 2 * page_size - 1, 3 * page_size, 45, 17]  # lengths 1, 7, 2ps, 3ps+1, ...
    case = build_case(rng, ctx, [1] * len(ctx), heads=4, lat=L, rope=R, page_size=page_size)
    got = np.asarray(mla_paged_decode(
        *_args(case, ("q_latent", "q_rope", "kv_pages", "block_tables", "kv_lens")),
        scale=SCALE, interpret=True, config=config))
    assert np.all(np.isfinite(got)), "kernel read a NaN page slot"
    np.testing.assert_allclose(got, numpy_attention(case, SCALE), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size,heads,config", [
    (8, 4, (("bk", 16),)),                       # 4 tokens x 4 heads per tile
    (8, 4, (("bk", 16), ("transposed", True))),  # same, keys-on-M form
    (16, 8, (("max_rows", 4), ("bk", 16), ("splits", 2))),  # head blocks of 4, one token
    (16, 6, (("max_rows", 4), ("transposed", True))),  # head blocks of 3 in 16-row tiles
])
def test_ragged_matches_oracle(page_size, heads, config):
    rng = np.random.default_rng(10 + page_size)
    # resumed prefill chunk, decode, fresh prefill, length-1 sequence, decode on a boundary
    ctx = [13, 20, 0, 0, 2 * page_size - 1]
    new = [7, 1, 5, 1, 1]
    case = build_case(rng, ctx, new, heads=heads, lat=L, rope=R, page_size=page_size,
                      pad_tokens=5)
    got = np.asarray(ragged_paged_mla(*_args(case), scale=SCALE, interpret=True,
                                      config=config))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, numpy_attention(case, SCALE), rtol=1e-5, atol=1e-5)
    assert np.all(got[case["cu_seqlens"][-1]:] == 0), "padding tokens must be zero"


@pytest.mark.parametrize("page_size,config", [
    (16, (("bk", 8), ("splits", 3))),                    # blocks inside pages, split-K
    (8, (("transposed", True),)),                        # blocks gathered over pages, keys-on-M
    (16, (("bk", 16), ("transposed", True))),            # one block per page, keys-on-M
])
def test_decode_block_variants_match_oracle(page_size, config):
    """Split ends and page boundaries fall inside blocks (masked loads): no NaN page may leak."""
    rng = np.random.default_rng(20 + page_size)
    ctx = [0, 6, 2 * page_size - 1, 3 * page_size, 45, 17]
    case = build_case(rng, ctx, [1] * len(ctx), heads=4, lat=L, rope=R, page_size=page_size)
    got = np.asarray(mla_paged_decode(
        *_args(case, ("q_latent", "q_rope", "kv_pages", "block_tables", "kv_lens")),
        scale=SCALE, interpret=True, config=config))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, numpy_attention(case, SCALE), rtol=1e-5, atol=1e-5)


def test_bf16_decode_close_to_reference():
    rng = np.random.default_rng(5)
    case = build_case(rng, [30, 3, 64], [1, 1, 1], heads=4, lat=L, rope=R, page_size=16)
    ks = ("q_latent", "q_rope", "kv_pages", "block_tables", "kv_lens")
    bf = [a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in _args(case, ks)]
    got = mla_paged_decode(*bf, scale=SCALE, interpret=True)
    assert got.dtype == jnp.bfloat16
    for k in ("q_latent", "q_rope"):
        case[k] = np.asarray(jnp.asarray(case[k]).astype(jnp.bfloat16).astype(jnp.float32))
    case["caches"] = [np.asarray(jnp.asarray(c).astype(jnp.bfloat16).astype(jnp.float32))
                      for c in case["caches"]]
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)),
                               numpy_attention(case, SCALE), rtol=3e-2, atol=3e-2)


def test_pick_config_shapes():
    c = pick_config(32, 64, 128, 64, slots=132)
    assert (c["rows"], c["bh"], c["bq"], c["bk"]) == (32, 32, 1, 64)
    from pallas_kernels.mla.splits import split_range
    bounds = [tuple(int(x) for x in split_range(s, c["splits"], 128 * 64, c["bk"])) for s in range(c["splits"])]
    assert bounds[0][0] == 0 and bounds[-1][1] == 128 * 64 and all(lo % 64 == 0 for lo, _ in bounds)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))      # the table's keys, each in one split
    c = pick_config(96, 64, 2048, 16, slots=132)
    assert c["bh"] == 32 and 96 % c["bh"] == 0 and c["splits"] > 1
    c = pick_config(4, 8, 4, 7, slots=132)  # small H: several tokens per tile, rows >= 16
    assert c["bh"] == 4 and c["bq"] == 8 and c["rows"] == 32


def test_default_tuning_h96_decode_depends_on_table_width_and_pages():
    from pallas_kernels.mla.paged import tuning_for
    one_group = {"max_rows": 64, "num_warps": 8, "transposed": False}
    thin = {"max_rows": 32, "num_warps": 4, "transposed": False}
    groups = dict(default_tuning(96, True, 8192, 64)["head_groups"])   # 8k, pages of 64: 64 + 32
    assert sorted(groups) == [32, 64]
    assert dict(groups[64]) == one_group and dict(groups[32]) == {"num_warps": 4, "transposed": True}
    assert default_tuning(96, True, 131072, 64) == thin                 # 128k: 32-head tiles
    assert default_tuning(96, True, 8192, 16) == one_group              # pages of 16: the other way
    assert "head_groups" in default_tuning(96, True, 131072, 16)
    assert default_tuning(96, False, 131072, 16)["max_rows"] == 64     # prefill unchanged
    assert default_tuning(32, True, 131072, 16)["transposed"] is True
    # an FP8 cache at H <= 32: row form, 8 warps, codes dequantized before the MMAs; prefill and H=96 as bf16
    assert default_tuning(32, True, 8192, 16, fp8=True) == {"num_warps": 8, "transposed": False, "fp8_scale": "codes"}
    assert default_tuning(32, False, 8192, 16, fp8=True) == default_tuning(32, False, 8192, 16)
    assert default_tuning(96, True, 8192, 64, fp8=True) == default_tuning(96, True, 8192, 64)
    assert "head_groups" not in default_tuning(48, True, 8192, 64)     # H=96 under tensor=2
    # a config that names knobs is one group (a benchmark variant runs as it says)
    assert tuning_for(96, True, 8192, 64, (("num_warps", 16),)) == {"num_warps": 16}


def test_tiles_fit_shared_memory_for_the_dtype():
    """fp32 needs twice bf16's shared memory: the tiles shrink until the estimate fits the block,
    the bf16 defaults (measured on the H200) stay as they are."""
    from pallas_kernels.mla.paged import fit_shared_memory, smem_estimate, tuning_for
    h200 = 227 * 1024
    # the tiling Triton refused at fp32 (asked 425,984 bytes): the estimate must not be below it
    assert 425984 <= smem_estimate(64, 64, 2, 512, 64, 4, False)
    for heads, keys in [(96, 131072), (64, 8192), (32, 8192), (32, 131072), (12, 8192)]:
        tune = tuning_for(heads, True, keys, 64, None)
        bf16 = fit_shared_memory(tune, heads, keys, 512, 64, 2, True, h200)
        assert {k: bf16[k] for k in tune} == tune and (bf16["bk"], bf16["num_stages"]) == (64, 2)
        fp32 = fit_shared_memory(tune, heads, keys, 512, 64, 4, True, h200)
        rows = pick_config(heads, 1, keys, 1, max_rows=fp32["max_rows"], splits=1, slots=1,
                           decode=True)["rows"]
        assert smem_estimate(rows, fp32["bk"], fp32["num_stages"], 512, 64, 4,
                             fp32["transposed"]) <= h200
        assert 16 <= fp32["bk"] < 64 and fp32["num_warps"] == tune["num_warps"]
    small = fit_shared_memory({"max_rows": 64}, 64, 8192, 512, 64, 2, True, 99 * 1024)  # sm_89
    assert small["max_rows"] < 64 or small["num_stages"] == 1
    assert fit_shared_memory({}, 4, 20, 64, 16, 4, True, h200)["bk"] == 32  # short table: bk <= keys
    with pytest.raises(ValueError, match="shared memory"):
        fit_shared_memory({}, 32, 8192, 4096, 64, 4, True, h200)


@pytest.mark.parametrize("heads,config", [
    (4, None),                                            # decode tuning: keys-on-M, one tile per sequence
    (6, (("head_groups", (4, 2)), ("bk", 16))),           # heads in two groups, each its own tiles
    (6, (("head_groups", ((4, (("transposed", True),)), (2, (("bk", 16), ("transposed", False))))),)),
    (96, tuple(default_tuning(96, True, 8192, 64).items())),  # K3's split: 64 row form + 32 keys-on-M
])
def test_ragged_decode_only_matches_oracle(heads, config):
    """The engine's decode-only step: one token per real sequence, a padding sequence (no token)
    and bucket-padding tokens, through the decode schedule."""
    rng = np.random.default_rng(30 + heads)
    case = build_case(rng, [13, 0, 31, 0, 40], [1, 1, 1, 0, 1], heads=heads, lat=L, rope=R,
                      page_size=16, pad_tokens=3)
    got = np.asarray(ragged_paged_mla(*_args(case), scale=SCALE, interpret=True, config=config,
                                      decode_only=True))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, numpy_attention(case, SCALE), rtol=1e-5, atol=1e-5)
    assert np.all(got[case["cu_seqlens"][-1]:] == 0), "padding tokens must be zero"


def test_head_groups_must_cover_the_heads():
    case = build_case(np.random.default_rng(1), [5], [1], heads=4, lat=L, rope=R, page_size=16)
    with pytest.raises(ValueError, match="head_groups"):
        mla_paged_decode(*_args(case, ("q_latent", "q_rope", "kv_pages", "block_tables", "kv_lens")),
                         scale=SCALE, interpret=True, config=(("head_groups", (2, 1)),))


@pytest.mark.parametrize("config", [
    None,
    (("bk", 16), ("slots", 12), ("transposed", False)),  # the 4 sequences' step: 3 splits; 11 token tiles: 1
])
def test_token_rows_are_decode_rows(config):
    """token_rows (a speculative verification step): a 5-token chunk, a decode row, a sequence left out (kv_len
    0: zeros) and bucket padding. Each token equals the oracle, and has the bits of a decode-only step of the
    same 4 sequences that feeds that token alone at its position (so the same key splits)."""
    rng = np.random.default_rng(7)
    case = build_case(rng, [85, 20, 9, 0], [5, 1, 3, 0], heads=4, lat=L, rope=R, page_size=8, pad_tokens=2,
                      max_pages=12)
    ref = numpy_attention(case, SCALE)
    q, qr, kv, bt, cu, kl = _args(case)
    given = kl.at[2].set(0)                                   # sequence 2 runs another form
    got = np.asarray(ragged_paged_mla(q, qr, kv, bt, cu, given, scale=SCALE, interpret=True, config=config,
                                      token_rows=True))
    ok = np.r_[0:6]
    np.testing.assert_allclose(got[ok], ref[ok], rtol=1e-5, atol=1e-5)
    assert np.all(got[6:] == 0), "tokens of a kv_len-0 sequence and padding tokens get zeros"
    for t, (seq, pos) in enumerate([(0, 85), (0, 86), (0, 87), (0, 88), (0, 89), (1, 20)]):
        # the decode step of the same sequences (0, 1, 2 feed a token; live_splits counts them): the token's
        # sequence first, the others at their first position
        one = jnp.zeros_like(q).at[0].set(q[t])
        one_r = jnp.zeros_like(qr).at[0].set(qr[t])
        order = [seq] + [n for n in range(4) if n != seq]
        lens = jnp.asarray([pos + 1 if n == seq else int(kl[n] > 0) for n in order], kl.dtype)
        fed = jnp.asarray([0, 1, 2, 3, 3], jnp.int32)
        dec = ragged_paged_mla(one, one_r, kv, bt[jnp.asarray(order)], fed, lens,
                               scale=SCALE, interpret=True, config=config, decode_only=True)
        assert np.array_equal(np.asarray(dec[0]), got[t]), f"token {t}"



def _one_row_tile(seed, **kw):
    """(case, mla_tiles_call's partials) of one decode token at position 99 (4 heads, 16-key blocks, 16-token
    pages), the kernel run alone over its split grid (kw: splits, live_splits)."""
    from pallas_kernels.mla.triton_kernel import mla_tiles_call
    case = build_case(np.random.default_rng(seed), [99], [1], heads=4, lat=L, rope=R, page_size=16, max_pages=64)
    q, qr, kv, bt, cu, kl = _args(case)
    rows = 16
    pad = lambda x: jnp.concatenate([x.reshape(-1, x.shape[-1]), jnp.zeros((rows, x.shape[-1]), x.dtype)])  # noqa: E731
    meta = jnp.asarray([[0, 0, 1, 99]], jnp.int32)
    return case, mla_tiles_call(meta, bt, pad(q), pad(qr), kv, scale=SCALE, rows=rows, bh=4, bq=1, bk=16,
                                transposed=False, interpret=True, **kw)

def test_key_splits_divide_the_context_not_the_table():
    """A short context in a wide block table (max_model_len far above it) spreads over every key split: split s
    of S takes keys [s * per, (s + 1) * per) of the row's own context, in whole blocks, and together they cover
    it once. The kernel's per-split partials show it: each of the 4 splits holds a share of a 100-key context in
    a 1,024-key table (fixed shares of the table would leave all of it to the first), and they combine to the
    oracle."""
    from pallas_kernels.mla.splits import split_range
    from pallas_kernels.mla.triton_kernel import combine_splits
    for end in (0, 1, 63, 64, 65, 100, 2048, 2049):
        bounds = [tuple(int(x) for x in split_range(s, 4, end, 16)) for s in range(4)]
        keys = [k for lo, hi in bounds for k in range(lo, hi)]
        assert keys == list(range(end)), (end, bounds)
        assert all(lo % 16 == 0 for lo, _ in bounds)
    assert [hi - lo for lo, hi in (split_range(s, 8, 2048, 64) for s in range(8))] == [256] * 8
    case, (o, m, l) = _one_row_tile(3, splits=4)
    assert np.all(np.asarray(l)[:, :4] > 0), "every split holds keys of the row"
    got = combine_splits(o, m, l, jnp.arange(o.shape[1]) < 4)[:4]
    np.testing.assert_allclose(np.asarray(got), numpy_attention(case, SCALE).reshape(4, -1), rtol=1e-5, atol=1e-5)


def test_decode_splits_fill_the_slots_for_the_live_sequences():
    """A decode step's grid holds the key splits of a quarter of its bucket's sequences (a lone sequence: a split
    an SM); each step uses the splits its live sequences (those with a token) share the slots by. One sequence
    in the 4-sequence bucket over a 128k table reads its keys on ~all 132 SMs, not on 33."""
    from pallas_kernels.mla.splits import live_seqs, live_splits
    grid = pick_config(32, 16, 140000 // 16, 4, slots=132, decode=True)["splits"]
    assert grid >= 128
    cu = lambda lens: jnp.asarray(np.r_[0, np.cumsum(lens)], jnp.int32)      # noqa: E731
    live = lambda lens, splits=grid: int(live_splits(live_seqs(cu(lens)), splits, 1, 132)[0])      # noqa: E731
    assert live([1, 0, 0, 0]) == grid
    assert live([1, 1, 1, 1]) == 33
    assert live([5, 0, 1, 0]) == 66     # tokens a sequence do not count
    assert live([0, 0, 0, 0]) == grid
    assert live([1] * 64, 8) == 2
    full = pick_config(32, 16, 140000 // 16, 64, slots=132, decode=True)["splits"]
    assert full <= 16, "a full 64-sequence bucket keeps a few splits (the combine reads each one's partials)"


def test_splits_past_the_live_ones_hold_nothing():
    """mla_tiles_call with live_splits 3 of a 6-split grid: the live splits hold the row's keys, the others are
    never written (the interpreter leaves them NaN), and combine_splits with `live` ignores them."""
    from pallas_kernels.mla.triton_kernel import combine_splits
    case, (o, m, l) = _one_row_tile(4, splits=6, live_splits=jnp.asarray([3], jnp.int32))
    assert np.all(np.asarray(l)[:3, :4] > 0), "every live split holds keys of the row"
    assert np.all(np.isnan(np.asarray(l)[3:, :4])), "splits past the live ones are not written"
    got = combine_splits(o, m, l, jnp.arange(o.shape[1]) < 4, jnp.asarray([3], jnp.int32))[:4]
    np.testing.assert_allclose(np.asarray(got), numpy_attention(case, SCALE).reshape(4, -1), rtol=1e-5, atol=1e-5)
