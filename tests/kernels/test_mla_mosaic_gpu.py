"""The Mosaic GPU paged MLA decode kernel (pallas_kernels/mla/mosaic_gpu.py) on CPU: Mosaic GPU's interpret
mode (warpgroups as threads, TMA copies, barriers) against mla_decode_reference, the GPU lowering
(Pallas -> Mosaic GPU MLIR, no GPU needed), and the backend choice mla_decode="mosaic" routing
decode-only steps there.

Pools are NaN wherever the kernel must not read (page 0, slots of pages past a sequence's end) and
finite garbage in the slots of the last copied unit past kv_len (read, masked: mosaic_gpu's docstring).
Shapes are shared between tests so the interpreter compiles each thread program once (~3 s a shape)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import mosaic_gpu
from pallas_kernels.mla.reference import mla_decode_reference
from pallas_kernels.mosaic_gpu_interpret import reuse_compiled_threads

# jax's interpreter can deadlock on a 2-core CPU (rarely: pallas_kernels/mosaic_gpu_interpret.py): fail fast
pytestmark = [pytest.mark.interpret, pytest.mark.timeout(120)]
LAT, ROPE = 128, 64          # the kernel at a small latent width (L = 512 is checked by the lowering test)
SCALE = 0.1


@pytest.fixture(scope="module", autouse=True)
def _fast_interpreter():
    with reuse_compiled_threads():
        yield


def _case(heads, page_size, lens, max_pages, seed=0, lat=LAT):
    """bf16 queries, a pool (NaN where unreadable) and block tables for sequences of kv_lens `lens`."""
    rng = np.random.default_rng(seed)
    n, width, unit = len(lens), lat + ROPE, min(mosaic_gpu.DEFAULTS["bk"], page_size)
    n_pages = 1 + n * max_pages
    pool = np.full((n_pages, page_size, width), np.nan, np.float32)
    bt = np.zeros((n, max_pages), np.int32)                     # padding entries: page 0 (NaN)
    pages = 1 + rng.permutation(n_pages - 1)
    for s, kv_len in enumerate(lens):
        used = -(-kv_len // page_size)
        bt[s, :used] = pages[s * max_pages:s * max_pages + used]
        for pos in range(-(-kv_len // unit) * unit):           # written rows, then the last unit's tail
            pool[bt[s, pos // page_size], pos % page_size] = rng.standard_normal(width) * (1 if pos < kv_len else 30)
    ql = jnp.asarray(rng.standard_normal((n, heads, lat)), jnp.bfloat16)
    qr = jnp.asarray(rng.standard_normal((n, heads, ROPE)), jnp.bfloat16)
    return ql, qr, jnp.asarray(pool, jnp.bfloat16), jnp.asarray(bt), jnp.asarray(lens, jnp.int32)


def _check(got, args):
    want = np.asarray(mla_decode_reference(*args, scale=SCALE), np.float32)
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got)), "a NaN page slot leaked"
    err = np.abs(got - want).max()
    assert err <= 0.02 * np.abs(want).max(), err               # bf16 output: ~2 ulp at the peak
    return err


SPLIT2 = (("splits", 2),)    # every kernel run here: 2 key splits (combined), one compile a shape


# The two tests that run the kernel in jax's Mosaic GPU interpreter are `slow` (not in CI's default run): the
# kernel is opt-in and has never run on a GPU, and the interpreter can deadlock on a 2-core machine (its
# warpgroups wait on barriers inside XLA:CPU's thread pool; seen in bench runs, not yet in this file).
@pytest.mark.slow
@pytest.mark.parametrize("heads,page_size,lens", [
    (96, 16, (37, 1, 0, 64)),      # two head tiles (the second half padding: H=32 runs the same way), 2 pages a block
    (64, 64, (250, 1, 0)),         # half a page a block, 4 blocks a split through a 3-stage ring
])
def test_decode_matches_reference(heads, page_size, lens):
    args = _case(heads, page_size, lens, max_pages=8 if page_size == 16 else 4)
    got = mosaic_gpu.mla_paged_decode_mosaic(*args, scale=SCALE, interpret=True, config=SPLIT2)
    assert got.shape == args[0].shape and got.dtype == jnp.bfloat16
    _check(got, args)
    assert not np.any(np.asarray(got[list(lens).index(0)], np.float32))  # padding sequence: zeros


@pytest.mark.slow
def test_ragged_decode_only_scatters_tokens_back():
    """ragged_paged_mla's decode-only layout: sequences without a token this step (kv_len counts
    only for tokens) and bucket-padded token rows past cu_seqlens[N] get zeros."""
    ql, qr, pool, bt, lens = _case(96, 16, (37, 1, 0, 64), max_pages=8)
    cu = jnp.asarray([0, 1, 2, 2, 3], jnp.int32)               # sequence 2 has no token
    tok_l = jnp.concatenate([ql[jnp.array([0, 1, 3])], ql[:1]])  # 4 token rows, the last is padding
    tok_r = jnp.concatenate([qr[jnp.array([0, 1, 3])], qr[:1]])
    got = mosaic_gpu.ragged_decode_mosaic(tok_l, tok_r, pool, bt, cu, lens, scale=SCALE, interpret=True,
                                          config=SPLIT2)
    want = mla_decode_reference(ql, qr, pool, bt, lens, scale=SCALE)
    np.testing.assert_allclose(np.asarray(got[:3], np.float32), np.asarray(want[jnp.array([0, 1, 3])], np.float32),
                               atol=0.02 * float(jnp.abs(want.astype(jnp.float32)).max()))
    assert not np.any(np.asarray(got[3], np.float32))


def test_plan_fills_the_slots_for_the_live_sequences():
    """The grid holds a lone sequence's key splits (its 2 head tiles at 96 heads: a split per 2 SMs), the step
    uses those its live sequences' head tiles share the SMs by: one sequence decoding at 140k in the 4-sequence
    bucket reads its keys on all 132 SMs (planned for the full bucket: 16 splits, 32 SMs); a full 64-sequence
    bucket keeps few splits (the combine reads each one's partials). A tiling's own splits are all live."""
    T = mosaic_gpu.MosaicTiling
    heads_padded, grid = mosaic_gpu.plan(96, 140000, 4, 32, slots=132)
    assert heads_padded == 128 and grid >= 64
    live = lambda n, grid=grid, t=T(slots=132): int(mosaic_gpu.plan_live(jnp.int32(n), 128, grid, t)[0])  # noqa: E731
    assert live(1) == 66 and live(2) == 33 and live(4) == 16
    assert live(0) == grid                                      # a step of padding only: clipped to the grid
    full = mosaic_gpu.plan(96, 140000, 64, 32, slots=132)[1]
    assert full <= 8 and live(64, full) == 1
    assert mosaic_gpu.plan(96, 140000, 4, 32, splits=8)[1] == 8
    assert mosaic_gpu.plan_live(jnp.int32(1), 128, 8, T(splits=8)) is None


def test_splits_past_the_live_ones_are_not_written():
    """mla_tiles_mosaic with live_splits 2 of a 4-split grid: each row's keys are divided over the 2 live
    splits, whose partials combine to the reference; the CTAs of splits 2 and 3 write nothing (the interpreter
    leaves their partials NaN) and combine_splits' `live` masks them. A live split without keys (the 5-key
    sequence's second) still writes the neutral l = 0."""
    from pallas_kernels.mla.triton_kernel import combine_splits
    ql, qr, pool, bt, lens = _case(64, 16, (99, 5), max_pages=8, seed=2)
    q = jnp.concatenate([ql, qr], axis=-1).reshape(2 * 64, LAT + ROPE)
    live = jnp.asarray([2], jnp.int32)
    o, m, l = mosaic_gpu.mla_tiles_mosaic(q, pool, bt, lens, lat=LAT, scale=SCALE, heads_padded=64, splits=4,
                                          bk=32, stages=3, interpret=True, live_splits=live)
    l = np.asarray(l)
    assert np.all(l[:2, :64] > 0), "both live splits hold keys of the 99-key sequence"
    assert np.all(l[0, 64:] > 0) and np.all(l[1, 64:] == 0), "the 5-key sequence: all in split 0, split 1 empty"
    for part in (o, m, l):
        assert np.all(np.isnan(np.asarray(part, np.float32)[2:])), "splits past the live ones are not written"
    got = combine_splits(o, m, jnp.asarray(l), jnp.ones((2 * 64,), bool), live).reshape(2, 64, LAT)
    _check(got, (ql, qr, pool, bt, lens))


def test_token_rows_are_decode_rows():
    """token_rows_mosaic (a speculative verification step) with 2 of the bucket's 4 sequences live: a 2-token
    chunk, a decode row, a sequence with keys but no token, one without either, and a padding row. At 8 slots
    the grid holds 4 splits (a lone sequence's 2 head tiles x 4) and this step uses 2 (2 live sequences x 2
    tiles): its rows count the live sequences as the decode step does, not their 3 valid token rows (1 split).
    Each token equals the reference and has the bits of a decode step of the same 4 sequences that feeds it at
    its position, through either decode entry point (mla_paged_decode_mosaic: live = kv_lens > 0;
    ragged_decode_mosaic: live = a token in cu_seqlens)."""
    config = (("slots", 8),)
    assert mosaic_gpu.plan(96, 8 * 16, 4, 32, slots=8)[1] == 4
    _, _, pool, bt, lens = _case(96, 16, (40, 20, 9, 0), max_pages=8, seed=5)
    rng = np.random.default_rng(6)
    tok_l = jnp.asarray(rng.standard_normal((4, 96, LAT)), jnp.bfloat16)
    tok_r = jnp.asarray(rng.standard_normal((4, 96, ROPE)), jnp.bfloat16)
    cu = jnp.asarray([0, 2, 3, 3, 3], jnp.int32)                # the 4th token row is padding
    got = mosaic_gpu.token_rows_mosaic(tok_l, tok_r, pool, bt, cu, lens, scale=SCALE, interpret=True,
                                       config=config)
    _check(got[:3], (tok_l[:3], tok_r[:3], pool, bt[jnp.asarray([0, 0, 1])], jnp.asarray([39, 40, 20])))
    assert not np.any(np.asarray(got[3], np.float32)), "a padding row gets zeros"
    for t in (0, 1):    # sequence 0 at the chunk token's position, sequence 1 at its decode row's
        q_l, q_r = tok_l.at[1].set(tok_l[2]).at[0].set(tok_l[t]), tok_r.at[1].set(tok_r[2]).at[0].set(tok_r[t])
        dec_lens = jnp.asarray([39 + t, 20, 0, 0], jnp.int32)
        if t == 0:
            dec = mosaic_gpu.mla_paged_decode_mosaic(q_l, q_r, pool, bt, dec_lens, scale=SCALE, interpret=True,
                                                     config=config)
        else:   # sequence 2 keeps its 9 keys but feeds no token: not live
            dec = mosaic_gpu.ragged_decode_mosaic(q_l, q_r, pool, bt, jnp.asarray([0, 1, 2, 2, 2], jnp.int32),
                                                  lens, scale=SCALE, interpret=True, config=config)
        assert np.array_equal(np.asarray(dec[0]), np.asarray(got[t])), f"token {t}"
        assert np.array_equal(np.asarray(dec[1]), np.asarray(got[2])), "the decode row"


def test_switch_routes_decode_only_steps(monkeypatch):
    """mla_decode="mosaic" (chosen when the backend is built, not at trace time) sends ops.mla_ragged_paged's
    decode-only steps with >= 64 heads to the Mosaic kernel; the default, prefill steps and 32-head
    steps stay on the Triton path."""
    from pallas_kernels import ops
    from pallas_kernels.backend import detect
    calls = []
    real = mosaic_gpu.ragged_decode_mosaic
    monkeypatch.setattr(mosaic_gpu, "ragged_decode_mosaic",  # (2 splits: the compiled kernel of the tests above)
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k, config=SPLIT2))
    mosaic = detect("pallas", mla_decode="mosaic")
    assert mosaic.mla_decode == "mosaic" and detect("pallas").mla_decode == "triton"      # auto, off Hopper
    ql, qr, pool, bt, lens = _case(96, 16, (37, 1, 0, 64), max_pages=8)
    cu = jnp.asarray([0, 1, 2, 3, 4], jnp.int32)
    call = functools.partial(ops.mla_ragged_paged, ql, qr, pool, bt, cu, lens, scale=SCALE)
    got = call(decode_only=True, backend=mosaic)
    assert calls == [ql.shape]
    _check(got, (ql, qr, pool, bt, lens))
    triton = lambda q_latent, *a, **k: jnp.full(q_latent.shape, 7, q_latent.dtype)  # noqa: E731
    monkeypatch.setattr("pallas_kernels.mla.paged._kernel_path", triton)
    marked = lambda out: bool(np.all(np.asarray(out, np.float32) == 7))  # noqa: E731
    assert marked(call(decode_only=False, backend=mosaic))
    assert marked(call(decode_only=True, backend=detect("pallas")))
    assert marked(ops.mla_ragged_paged(ql[:, :32], qr[:, :32], pool, bt, cu, lens, scale=SCALE,
                                       decode_only=True, backend=mosaic))
    assert calls == [ql.shape]
    with pytest.raises(ValueError, match="mla_decode 'wgmma'"):
        detect(mla_decode="wgmma")


@pytest.mark.parametrize("capability,chosen", [("9.0", "mosaic"), ("8.0", "triton"), ("10.0", "triton")])
def test_auto_picks_mosaic_on_hopper_only(monkeypatch, capability, chosen):
    """mla_decode "auto" (the default): the Mosaic kernel (wgmma, TMA) on compute capability 9.x GPUs, the
    Triton kernel elsewhere; an explicit choice wins."""
    import types
    from pallas_kernels import backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(compute_capability=capability)])
    assert backend.detect().mla_decode == chosen
    assert backend.detect(mla_decode="triton").mla_decode == "triton"
    assert backend.detect(mla_decode="mosaic").mla_decode == "mosaic"


@pytest.mark.parametrize("heads,page_size,config", [
    (96, 16, None), (96, 64, None), (64, 64, None),
    (96, 16, mosaic_gpu.MosaicTiling(bk=16, stages=6)),     # the bench sweep's other tilings
    (96, 16, mosaic_gpu.MosaicTiling(bk=32, stages=2)),
])
def test_lowers_for_the_gpu(heads, page_size, config):
    """At K3's shapes (L = 512) the kernel lowers to a Mosaic GPU custom call (wgmma operand shapes,
    swizzles, TMA slices and register layouts are checked here; PTX and SASS only on a GPU)."""
    sd = jax.ShapeDtypeStruct
    n, max_pages = 4, 8192 // page_size
    args = (sd((n, heads, 512), jnp.bfloat16), sd((n, heads, ROPE), jnp.bfloat16),
            sd((n * max_pages + 1, page_size, 512 + ROPE), jnp.bfloat16), sd((n, max_pages), jnp.int32),
            sd((n,), jnp.int32))
    f = jax.jit(functools.partial(mosaic_gpu.mla_paged_decode_mosaic, scale=SCALE, config=config))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_bad_shapes_are_rejected():
    assert mosaic_gpu.smem_bytes(576, 32, 3) <= mosaic_gpu.SMEM_LIMIT
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_gpu.check_shapes(512, 64, 32, 4, 16)
    with pytest.raises(ValueError, match="page size"):
        mosaic_gpu.check_shapes(512, 64, 32, 3, 4)
    assert not mosaic_gpu.supports(32, 512, 64, 16, jnp.bfloat16)       # Triton's keys-on-M form wins
    assert not mosaic_gpu.supports(96, 512, 64, 16, jnp.float32)        # wgmma bf16 / f16 only
    assert mosaic_gpu.supports(96, 512, 64, 64, jnp.bfloat16)
    ql, qr, pool, bt, lens = _case(64, 16, (5,), max_pages=1)
    with pytest.raises(ValueError, match="16-bit"):
        mosaic_gpu.mla_paged_decode_mosaic(ql, qr, pool.astype(jnp.float32), bt, lens, scale=SCALE, interpret=True)


def test_tiling_config_and_tuned_table(monkeypatch):
    """config as a MosaicTiling or (key, value) pairs; without one a TUNED entry for the step's (padded
    heads, page size, long context) applies where it fits the shapes, DEFAULT_TILING elsewhere."""
    T = mosaic_gpu.MosaicTiling
    assert mosaic_gpu.as_tiling(SPLIT2) == T(splits=2) and mosaic_gpu.as_tiling(None) is None
    assert mosaic_gpu.as_tiling({"bk": 16, "stages": 6}) == T(16, 6)
    assert T(16, 6, splits=4).label() == "bk16 st6 splits 4"
    monkeypatch.setitem(mosaic_gpu.TUNED, (128, 16, False), T(16, 6))
    monkeypatch.setitem(mosaic_gpu.TUNED, (128, 64, True), T(32, 4))              # does not fit: ignored
    assert mosaic_gpu.tiling_for(96, 16, 8192, 512, 64) == T(16, 6)
    assert mosaic_gpu.tiling_for(96, 16, 131072, 512, 64) == mosaic_gpu.DEFAULT_TILING   # long: no entry
    assert mosaic_gpu.tiling_for(64, 16, 8192, 512, 64) == mosaic_gpu.DEFAULT_TILING     # 64 heads: no entry
    assert mosaic_gpu.tiling_for(96, 64, 131072, 512, 64) == mosaic_gpu.DEFAULT_TILING
