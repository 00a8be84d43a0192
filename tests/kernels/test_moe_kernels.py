"""MoE kernels (pallas_kernels.moe): Pallas kernels in interpret mode on CPU against
independent references (jax.lax.ragged_dot, a float64 numpy loop over tokens and their experts).
The MXFP4 format itself (dequantize, quantize, the ptx8 decoder's recipe): test_mxfp4_format.py."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import moe
from pallas_kernels.moe import grouped as gm
from pallas_kernels.moe import kernel as kn
from pallas_kernels.moe import schedule as sch
from pallas_kernels.moe.schedule import Tiling
from tests.support.tiers import slow_case

pytestmark = pytest.mark.interpret


def _rng(seed):
  return np.random.default_rng(seed)


def _bf16(a):
  return jnp.asarray(a, jnp.bfloat16)


def _close(out, ref, rel=1e-2):
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  scale = max(np.abs(ref).max(), 1e-6)
  err = np.abs(out - ref).max() / scale
  assert err < rel, f"max rel err {err:.3g}"


# --------------------------------------------------------------------- gmm (bf16)

GMM_CASES = [
    # M, K, N, group sizes, tiling (None = heuristic)
    (100, 64, 48, [30, 0, 17, 40, 3], Tiling(16, 32, 16)),     # many tiles/group, tail
    (100, 64, 48, [30, 0, 17, 40, 3], None),
    (77, 128, 64, [0, 0, 77, 0], Tiling(32, 64, 32)),            # one group, M % bm != 0
    (5, 40, 24, [2, 0, 1], None),                                 # M < bm, K and N padded
    (64, 32, 32, [0, 0, 0, 0], Tiling(16, 16, 16)),               # all empty: all zeros
    # decode: one row in each of 19 of 40 groups and a one-row tail take all 20 row tiles the grid has
    (20, 32, 32, [1, 0] * 19 + [0, 0], Tiling(16, 16, 16)),
]


@pytest.mark.parametrize("m,k,n,sizes,tiling", GMM_CASES)
def test_gmm_matches_ragged_dot(m, k, n, sizes, tiling):
  r = _rng(m + k + n)
  x = _bf16(r.standard_normal((m, k)))
  w = _bf16(r.standard_normal((len(sizes), k, n)))
  gs = jnp.asarray(sizes, jnp.int32)
  out = moe.gmm(x, w, gs, interpret=True, tiling=tiling)
  ref = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
  assert out.shape == (m, n) and out.dtype == jnp.bfloat16
  _close(out, ref)
  tail = int(sum(sizes))
  assert np.all(np.asarray(out[tail:], np.float32) == 0.0)


def _tile_schedule_cases():
  r = _rng(7)
  for g, bm, m in ((256, 16, 16), (256, 16, 20), (64, 16, 100), (1, 16, 16), (3, 32, 70), (8, 128, 300),
                   (256, 128, 1000), (40, 16, 40)):
    yield g, bm, m, np.bincount(r.integers(0, g, int(r.integers(0, m + 1))), minlength=g)   # random rows
    yield g, bm, m, np.bincount(r.choice(g, min(g, m), replace=False), minlength=g)         # a row per group
    yield g, bm, m, np.bincount(np.full(m, g - 1), minlength=g)                             # all in one group
  yield 8, 16, 64, np.zeros(8, np.int64)                                                      # all in the tail


def test_tile_schedule_covers_every_row_once():
  """The grid's row tiles (schedule.num_tiles, a bound on the busy tiles) cover each group's rows and the
  tail exactly once, one group per tile, at group sizes from all rows in one group to one row per group."""
  for g, bm, m, sizes in _tile_schedule_cases():
    tg, ts, te = (np.asarray(a) for a in sch.tile_schedule(jnp.asarray(sizes, jnp.int32), m, bm))
    assert len(tg) == sch.num_tiles(m, g, bm) <= m // bm + g + 2
    owner = np.full(m, -1)
    for gid, a, b in zip(tg, ts, te):
      assert b - a <= bm and np.all(owner[a:b] == -1)
      owner[a:b] = gid
    want = np.concatenate([np.repeat(np.arange(g), sizes), np.full(m - sizes.sum(), g)])
    assert np.array_equal(owner, want), (g, bm, m, sizes)


def test_gmm_random_group_sizes():
  r = _rng(1)
  m, k, n, g = 96, 64, 32, 9
  cuts = np.sort(r.integers(0, 90, g - 1))  # sum 90 < m, several empty groups likely
  sizes = np.diff(np.concatenate([[0], cuts, [90]])).astype(np.int32)
  sizes[[1, 4]] = 0
  sizes[-1] += 90 - sizes.sum()
  x = _bf16(r.standard_normal((m, k)))
  w = _bf16(r.standard_normal((g, k, n)))
  gs = jnp.asarray(sizes)
  out = moe.gmm(x, w, gs, interpret=True, tiling=Tiling(16, 32, 32))
  _close(out, moe.gmm_reference(x, w, gs))
  assert np.all(np.asarray(out[90:], np.float32) == 0.0)


def test_gmm_cpu_default_is_reference():
  r = _rng(2)
  x = _bf16(r.standard_normal((8, 16)))
  w = _bf16(r.standard_normal((2, 16, 16)))
  gs = jnp.asarray([3, 5], jnp.int32)
  np.testing.assert_array_equal(np.asarray(moe.gmm(x, w, gs), np.float32),
                                np.asarray(moe.gmm_reference(x, w, gs), np.float32))


def _mxfp4_case(seed, m, k, n, sizes, scale_range):
  """Random bf16 rows, MXFP4 weights (any byte, E8M0 scales in scale_range) and group sizes."""
  r = _rng(seed)
  x = _bf16(r.standard_normal((m, k)))
  packed = jnp.asarray(r.integers(0, 256, (len(sizes), n, k // 2), dtype=np.uint8))
  scales = jnp.asarray(r.integers(*scale_range, (len(sizes), n, k // 32), dtype=np.uint8))
  return x, packed, scales, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("tiling,mode", [(Tiling(16, 64, 16), "kernel"), (None, None),
                                         (Tiling(16, 32, 16), "predequant")])
def test_gmm_mxfp4_matches_dequantized_gmm(tiling, mode):
  x, packed, scales, gs = _mxfp4_case(5, 70, 128, 48, [20, 0, 33, 9], (118, 130))
  out = moe.gmm_mxfp4(x, packed, scales, gs, interpret=True, tiling=tiling, mode=mode)
  w = moe.dequantize_mxfp4(packed, scales, jnp.bfloat16)
  ref = jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), gs, preferred_element_type=jnp.float32)
  _close(out, ref)
  assert np.all(np.asarray(out[62:], np.float32) == 0.0)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4-kernel", "mxfp4-predequant"])
def test_fused_glu_epilogue(fmt):
  """Two weights sharing the lhs tile + SiTU epilogue == act(gmm(x, w_a), gmm(x, w_b))."""
  r = _rng(10)
  m, k, n, sizes = 40, 64, 32, [9, 0, 25]
  x = _bf16(r.standard_normal((m, k)))
  wa = _bf16(r.standard_normal((3, k, n)) / 8)
  wb = _bf16(r.standard_normal((3, k, n)) / 8)
  gs = jnp.asarray(sizes, jnp.int32)
  act = lambda a, b: kn.glu_activation(a, b, "situ")
  if fmt == "bf16":
    out = gm.run_bf16(x, (wa, wb), gs, tiling=Tiling(16, 32, 16), act=act, interpret=True)
  else:
    qa, qb = (moe.quantize_mxfp4(jnp.swapaxes(w.astype(jnp.float32), 1, 2)) for w in (wa, wb))
    deq = lambda q: jnp.swapaxes(moe.dequantize_mxfp4(*q, jnp.bfloat16), 1, 2)
    wa, wb = deq(qa), deq(qb)
    out = gm.run_mxfp4(x, (*qa, *qb), gs, tiling=Tiling(16, 32, 16), act=act, interpret=True,
                       mode=fmt.split("-")[1])
  ref = act(moe.gmm_reference(x, wa, gs).astype(jnp.float32),
            moe.gmm_reference(x, wb, gs).astype(jnp.float32))
  _close(out[:34], ref[:34])
  assert np.all(np.asarray(out[34:], np.float32) == 0.0)


# ----------------------------------------------------------------------- routing

def test_sort_by_expert_and_combine_round_trip():
  r = _rng(6)
  t, k, e, d = 13, 3, 6, 8
  ids = np.stack([r.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
  tok, gs, inv = moe.sort_by_expert(jnp.asarray(ids), e)
  np.testing.assert_array_equal(np.asarray(gs), np.bincount(ids.ravel(), minlength=e))
  flat = ids.ravel()
  sorted_ids = flat[np.asarray(inv).argsort()]
  assert np.all(np.diff(sorted_ids) >= 0)
  # row p of the sorted order is assignment (tok[p], expert sorted_ids[p])
  for p in range(t * k):
    assert int(np.asarray(inv)[int(tok[p]) * k + list(ids[int(tok[p])]).index(sorted_ids[p])]) == p
  x = r.standard_normal((t, d)).astype(np.float32)
  xs = jnp.asarray(x)[tok]
  wts = r.random((t, k)).astype(np.float32)
  out = moe.combine(xs, jnp.asarray(wts), inv)
  np.testing.assert_allclose(np.asarray(out), x * wts.sum(1, keepdims=True), rtol=1e-5)


def test_sort_by_expert_foreign_ids_sort_last():
  ids = jnp.asarray([[2, -1], [7, 0], [1, 2]], jnp.int32)  # -1 and 7 not local (E=4)
  tok, gs, inv = moe.sort_by_expert(ids, 4)
  np.testing.assert_array_equal(np.asarray(gs), [1, 1, 2, 0])
  np.testing.assert_array_equal(np.asarray(tok)[4:], [0, 1])  # foreign rows last


# -------------------------------------------------------------------- expert MLP

def _np_act(g, u, activation, beta=4.0, lbeta=25.0):
  sig = 1.0 / (1.0 + np.exp(-g))
  if activation == "silu":
    return g * sig * u
  uu = u if lbeta is None else lbeta * np.tanh(u / lbeta)
  return beta * np.tanh(g / beta) * sig * uu


def _np_moe(x, ids, wts, w1, w3, w2, activation, lbeta=25.0):
  """float64 loop over tokens and their k experts. w1, w3 [E, D, I]; w2 [E, I, D]."""
  x, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, w1, w3, w2))
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j in range(ids.shape[1]):
      e = ids[t, j]
      h = _np_act(x[t] @ w1[e], x[t] @ w3[e], activation, lbeta=lbeta)
      out[t] += wts[t, j] * (h @ w2[e])
  return out


def _moe_inputs(seed, t=11, d=64, i=32, e=6, k=2):
  r = _rng(seed)
  x = _bf16(r.standard_normal((t, d)))
  ids = np.stack([r.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
  ids[0] = [0, 1]  # keep expert 5 possibly empty but experts 0/1 used
  wts = r.random((t, k)).astype(np.float32)
  w1 = _bf16(r.standard_normal((e, d, i)) / np.sqrt(d))
  w3 = _bf16(r.standard_normal((e, d, i)) / np.sqrt(d))
  w2 = _bf16(r.standard_normal((e, i, d)) / np.sqrt(i))
  return x, ids, wts, w1, w3, w2


@pytest.mark.parametrize("activation,lbeta", [("silu", 25.0), ("situ", 25.0), ("situ", None)])
def test_expert_mlp_bf16_matches_numpy(activation, lbeta):
  x, ids, wts, w1, w3, w2 = _moe_inputs(7)
  out = moe.expert_mlp(x, jnp.asarray(ids), jnp.asarray(wts), w1, w3, w2,
                       activation=activation, situ_linear_beta=lbeta, interpret=True)
  ref = _np_moe(x, ids, wts, w1, w3, w2, activation, lbeta)
  assert out.shape == x.shape and out.dtype == x.dtype
  _close(out, ref, rel=2e-2)
  # the CPU reference path (no kernel) agrees too
  out_ref = moe.expert_mlp(x, jnp.asarray(ids), jnp.asarray(wts), w1, w3, w2,
                           activation=activation, situ_linear_beta=lbeta)
  _close(out_ref, ref, rel=2e-2)


@pytest.mark.parametrize("activation", ["silu"])  # situ: test_expert_mlp_equals_model_...
def test_expert_mlp_mxfp4_matches_numpy(activation):
  x, ids, wts, w1, w3, w2 = _moe_inputs(8)
  q = lambda w: moe.quantize_mxfp4(jnp.swapaxes(w.astype(jnp.float32), 1, 2))  # HF [E,out,in]
  q1, q3, q2 = q(w1), q(w3), q(w2)
  deq = lambda p: np.swapaxes(np.asarray(moe.dequantize_mxfp4(*p, jnp.float32)), 1, 2)
  ref = _np_moe(x, ids, wts, deq(q1), deq(q3), deq(q2), activation)
  out = moe.expert_mlp_mxfp4(x, jnp.asarray(ids), jnp.asarray(wts), q1, q3, q2,
                             activation=activation, interpret=True)
  _close(out, ref, rel=2e-2)


# ------------------------------------------------- Triton lowering smoke (no GPU)

@pytest.mark.parametrize("fmt,fused,decoder,swap", [
    ("bf16", False, "jnp", False), ("bf16", True, "jnp", False), ("mxfp4", False, "jnp", False),
    ("mxfp4", True, "jnp", False), ("mxfp4", True, "ptx4", False), ("mxfp4", False, "ptx8", False),
    ("mxfp4", True, "ptx8", True), ("bf16", "merged", "jnp", False), ("mxfp4", "merged", "ptx8", True),
    ("mxfp4", "joined", "ptx8", True)])
def test_kernels_lower_to_triton(fmt, fused, decoder, swap):
  """The kernels (MXFP4: with each decoder, weights as either MMA operand; merged gate/up with
  half-height tail tiles, joined halves) lower through Pallas' Triton backend for CUDA on CPU;
  compiling the Triton IR needs the GPU (the gpu tier: tests/kernels/test_gpu_kernels.py)."""
  m, k, n, g = 256, 256, 128, 8
  act = (lambda a, b: kn.glu_activation(a, b, "situ")) if fused else None
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  gs = jax.ShapeDtypeStruct((g,), jnp.int32)
  merged, joined = fused in ("merged", "joined"), fused == "joined"
  if fmt == "bf16":
    w = jax.ShapeDtypeStruct((g, k, 2 * n if merged else n), jnp.bfloat16)
    t = Tiling(64, 64, 64, 4, 3, half_tail=True) if merged else None
    f = lambda x, w, gs: gm.run_bf16(x, (w, w) if fused is True else (w,), gs, tiling=t, act=act)
    args = (x, w, gs)
  else:
    p = jax.ShapeDtypeStruct((g, 2 * n if merged else n, k // 2), jnp.uint8)
    s = jax.ShapeDtypeStruct((g, 2 * n if merged else n, k // 32), jnp.uint8)
    t = Tiling(64 if merged else 16, 128, 64, 2, 3, swap_ab=swap, half_tail=merged, joined=joined)
    f = lambda x, p, s, gs: gm.run_mxfp4(x, (p, s, p, s) if fused is True else (p, s), gs,
                                         tiling=t, act=act, mode="kernel", decoder=decoder)
    args = (x, p, s, gs)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text
  # the PTX decoders are in the Triton IR iff chosen (the IR is bytecode: look for the bytes)
  assert ("0x7E807E80" in text) == (decoder == "ptx4")
  assert ("mul.lo.u32" in text) == (decoder == "ptx8")


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_stacked_gather_mlp_lowers_to_triton(fmt):
  """The scanned decoder's MoE call (a layer of stacked experts read in place) with the in-kernel
  row gather (MXFP4: halves order between the kernels) lowers for CUDA: one Triton call per kernel."""
  t, d, i, e, n_layers = 256, 256, 512, 8, 3
  sds = jax.ShapeDtypeStruct
  if fmt == "bf16":
    ws = (sds((n_layers, e, d, i), jnp.bfloat16),) * 2 + (sds((n_layers, e, i, d), jnp.bfloat16),)
    fn, kw = moe.expert_mlp, {}
  else:
    up = (sds((n_layers, e, i, d // 2), jnp.uint8), sds((n_layers, e, i, d // 32), jnp.uint8))
    ws = (up, up, (sds((n_layers, e, d, i // 2), jnp.uint8), sds((n_layers, e, d, i // 32), jnp.uint8)))
    fn, kw = moe.expert_mlp_mxfp4, dict(decoder="ptx8")
  f = lambda x, ids, wts, r, *ws: fn(x, ids, wts, *ws, activation="silu", interpret=False, layer=r,
                                     gather=True, platform="gpu", **kw)
  text = jax.jit(f).trace(sds((t, d), jnp.bfloat16), sds((t, 2), jnp.int32), sds((t, 2), jnp.float32),
                          sds((), jnp.int32), *ws).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 2


# ----------------------- MXFP4 kernel variants in interpret mode (x shift, swapped operands)

@pytest.mark.parametrize("decoder,swap", [("jnp", False), slow_case("ptx8", False), slow_case("jnp", True),
                                          ("ptx8", True)])   # x shift 0 / 64 (interpret: jnp decode)
def test_gmm_mxfp4_shift_and_swapped_operands(decoder, swap):
  x, packed, scales, gs = _mxfp4_case(12, 50, 128, 64, [7, 0, 30, 5], (110, 135))
  t = Tiling(16, 64, 32, 2, 3, swap_ab=swap)
  out = moe.gmm_mxfp4(x, packed, scales, gs, interpret=True, tiling=t, mode="kernel", decoder=decoder)
  ref = moe.gmm_mxfp4_reference(x, packed, scales, gs)
  _close(out, ref)
  assert np.all(np.asarray(out[42:], np.float32) == 0.0)
  act = lambda a, b: kn.glu_activation(a, b, "situ")
  out2 = gm.run_mxfp4(x, (packed, scales, packed[::-1], scales[::-1]), gs, tiling=t, act=act,
                      interpret=True, mode="kernel", decoder=decoder)
  ref2 = act(ref.astype(jnp.float32),
             moe.gmm_mxfp4_reference(x, packed[::-1], scales[::-1], gs).astype(jnp.float32))
  _close(out2[:42], ref2[:42])


# ------------------------------------- expert parallelism: tiles from the local row count

def test_choose_tiling_avg_rows_hint():
  from pallas_kernels.moe import schedule as sch
  # K3-EP8 decode, 256 tokens: 4096 rows, 112 local experts, ~4.6 rows per local expert
  assert sch.choose_tiling(4096, 3584, 6144, 112, mxfp4=True, fused=True).bm == 64
  ep = dict(mxfp4=True, fused=True, avg_rows=4096 / 896)
  assert sch.choose_tiling(4096, 3584, 6144, 112, **ep, decoder="ptx4") == Tiling(16, 256, 64, 4, 4)
  # the ptx8 decoder brings its own decode tiles
  assert sch.choose_tiling(4096, 3584, 6144, 112, **ep, decoder="ptx8") == sch.DECODE_MXFP4
  assert sch.choose_tiling(4096, 2304, 2048, 112, **ep, decoder="ptx8").swap_ab  # K, N keep bk / bn
  assert sch.choose_tiling(4096, 3584, 6144, 112, avg_rows=4096 / 896).bm == 16  # bf16 too


def test_decode_tiles_by_shape(monkeypatch):
  """A DECODE_MXFP4_BY_SHAPE entry replaces the default decode tiles for its (fused, K, N) only."""
  from pallas_kernels.moe import schedule as sch
  ep = dict(mxfp4=True, avg_rows=256 / 896, decoder="ptx8")
  best = Tiling(16, 128, 128, 2, 4, swap_ab=True)
  monkeypatch.setitem(sch.DECODE_MXFP4_BY_SHAPE, (False, 3072, 3584), best)
  assert sch.choose_tiling(256, 3072, 3584, 112, **ep) == best
  assert sch.choose_tiling(256, 3584, 3072, 112, fused="merged", **ep) == sch.DECODE_MXFP4_MERGED
  assert sch.choose_tiling(256, 3072, 2304, 112, **ep) == sch.DECODE_MXFP4  # another N: the default


def _ep_case(seed, t, d, i, e_loc, e_tot, k, activation):
  """Expert-parallel MLP inputs: ids over e_tot experts (those >= e_loc -> -1, another device's),
  MXFP4 experts (q1, q3, q2), and the float64 loop over the local experts on their dequantized
  values."""
  r = _rng(seed)
  ids = np.stack([r.choice(e_tot, k, replace=False) for _ in range(t)]).astype(np.int32)
  ids[0, 0] = 1
  x = _bf16(r.standard_normal((t, d)))
  wts = r.random((t, k)).astype(np.float32)
  qs = [moe.quantize_mxfp4(jnp.asarray(r.standard_normal(sh) / np.sqrt(sh[-1]), jnp.float32))
        for sh in ((e_loc, i, d), (e_loc, i, d), (e_loc, d, i))]
  local = np.where(ids < e_loc, ids, -1)
  ref = _np_moe(x, np.maximum(local, 0), np.where(local >= 0, wts, 0.0),
                *(_deq_in_out(q) for q in qs), activation)
  return x, local, wts, qs, ref


def _deq_in_out(q):
  """MXFP4 (packed, scales) in HF [E, out, in] -> float32 numpy [E, in, out]."""
  return np.swapaxes(np.asarray(moe.dequantize_mxfp4(*q, jnp.float32)), 1, 2)


def test_expert_mlp_mxfp4_expert_parallel_tiles(monkeypatch):
  """Under expert parallelism most rows belong to other devices' experts: num_experts_total
  sizes the tiles from the local rows (bm 16 here, bm 64 without it); same result either way
  (the float64 loop over the local experts)."""
  seen = []
  orig = kn.grouped_matmul
  monkeypatch.setattr(gm.kn, "grouped_matmul",
                      lambda *a, **kw: seen.append(kw["tiling"]) or orig(*a, **kw))
  e_tot = 32
  x, local, wts, (q1, q3, q2), ref = _ep_case(13, 32, 64, 32, 4, e_tot, 8, "silu")
  for total, bm in ((None, 64), (e_tot, 16)):
    seen.clear()
    out = moe.expert_mlp_mxfp4(x, jnp.asarray(local), jnp.asarray(wts), q1, q3, q2,
                               activation="silu", interpret=True, num_experts_total=total)
    assert [tl.bm for tl in seen] == [bm, bm]
    _close(out, ref, rel=2e-2)
  with pytest.raises(ValueError, match="num_experts_total"):
    moe.expert_mlp_mxfp4(x, jnp.asarray(local), jnp.asarray(wts), q1, q3, q2,
                         activation="silu", interpret=True, num_experts_total=2)


# ------------------------------------------- equality with the model's MoE layer

@pytest.mark.parametrize("fmt,activation", [("bf16", "situ"), ("bf16", "silu"), ("mxfp4", "situ")])
def test_expert_mlp_equals_model_reference_layer(fmt, activation):
  """expert_mlp (kernel, interpret) == the model's RoutedExperts module (ragged_dot reference)."""
  layer = pytest.importorskip("k3jax.layers.moe")
  from k3jax.config import ModelConfig
  x, ids, wts, w1, w3, w2 = _moe_inputs(9)
  e, d, i = w1.shape
  c = ModelConfig(vocab_size=32, hidden_size=d, num_layers=1, layer_types=("kda",),
                  mlp_types=("moe",), num_experts=e, num_experts_per_token=ids.shape[1],
                  moe_intermediate_size=i, hidden_act=activation, expert_format=fmt)
  if fmt == "bf16":
    pe = {"w1": w1, "w3": w3, "w2": w2}
    out = moe.expert_mlp(x, jnp.asarray(ids), jnp.asarray(wts), w1, w3, w2, activation=activation,
                         situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta, interpret=True)
  else:
    q = {n: moe.quantize_mxfp4(jnp.swapaxes(w.astype(jnp.float32), 1, 2))
         for n, w in (("w1", w1), ("w3", w3), ("w2", w2))}
    pe = {f"{n}_{s}": q[n][j] for n in q for j, s in enumerate(("packed", "scale"))}
    out = moe.expert_mlp_mxfp4(x, jnp.asarray(ids), jnp.asarray(wts), q["w1"], q["w3"], q["w2"],
                               activation=activation, situ_beta=c.situ_beta,
                               situ_linear_beta=c.situ_linear_beta, interpret=True)
  ref = layer.RoutedExperts.of(c, pe)(x, jnp.asarray(wts), jnp.asarray(ids), c)
  assert out.shape == ref.shape and out.dtype == ref.dtype
  # both round h and the expert outputs to bf16 (at slightly different points): a few
  # bf16 ulps apart; each is within ~0.6% of the float64 loop (the tests above)
  _close(out, ref, rel=1.5e-2)


@pytest.mark.parametrize("fmt,gather", [slow_case("bf16", False), ("mxfp4", False), ("bf16", True),
                                        slow_case("mxfp4", True)])
def test_expert_mlp_reads_one_layer_of_a_stack_in_place(fmt, gather):
  """layer=r over weights stacked [L, E, ...] (the scanned decoder's layout; the kernels offset the
  group ids instead of slicing) == the same call on layer r's own weights, in the kernel (interpret)
  and in the reference path. Other layers hold different weights, so a wrong offset shows. gather:
  the up kernel reads token rows in place (row_index; MXFP4: halves order between the kernels)."""
  x, ids, wts, *_ = _moe_inputs(10)
  layers = [_moe_inputs(20 + r)[3:] for r in range(3)]
  stack = [jnp.stack(ws) for ws in zip(*layers)]
  if fmt == "mxfp4":
    q = lambda w: moe.quantize_mxfp4(jnp.swapaxes(w.astype(jnp.float32), -1, -2))
    layers = [tuple(q(w) for w in ws) for ws in layers]
    stack = [q(w) for w in stack]
  fn = moe.expert_mlp if fmt == "bf16" else moe.expert_mlp_mxfp4
  for interpret in (True, None):
    run = jax.jit(lambda r, *ws: fn(x, jnp.asarray(ids), jnp.asarray(wts), *ws, activation="silu",
                                    interpret=interpret, layer=r, gather=gather))
    own = fn(x, jnp.asarray(ids), jnp.asarray(wts), *layers[1], activation="silu", interpret=interpret,
             gather=gather)
    np.testing.assert_array_equal(np.asarray(run(jnp.int32(1), *stack), np.float32), np.asarray(own, np.float32))


# ------------------------------------- regression: "expert_mlp_mxfp4 wrong at K3 shapes"

def test_gmm_rejects_group_count_mismatch():
  """ragged_dot semantics: one group size per weight group. Before, the kernels silently used
  only the first len(group_sizes) experts (this made check_kernels_gpu.py's reference wrong)."""
  x = _bf16(np.ones((8, 64)))
  w = _bf16(np.ones((5, 64, 32)))
  gs = jnp.asarray([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="group_sizes"):
    moe.gmm(x, w, gs, interpret=True)
  p, s = moe.quantize_mxfp4(jnp.swapaxes(w.astype(jnp.float32), 1, 2))
  with pytest.raises(ValueError, match="group_sizes"):
    moe.gmm_mxfp4(x, p, s, gs, interpret=True)


def test_expert_mlp_mxfp4_more_experts_than_tiny_matches_model_reference():
  """The shape class that 'failed' on the H200 (E=112 > the tiny config's 16 experts, k=16),
  reduced: E=40, k=8, several row tiles per expert. In-kernel MXFP4 (interpret) vs the model's
  routed_experts_reference with num_experts = E. With the old check's config (16 experts) the
  same comparison gives a relative error ~2 (measured on CPU, 2026-11-30): the kernel was right."""
  import dataclasses
  layer = pytest.importorskip("k3jax.layers.moe")
  from k3jax.presets import preset_config
  r = np.random.RandomState(2)
  t, d, i, e, k = 48, 128, 64, 40, 8
  x = _bf16(r.randn(t, d))
  ids = jnp.asarray(np.stack([r.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
  w = jnp.asarray(r.rand(t, k), jnp.float32)
  packs = [moe.quantize_mxfp4(jnp.asarray(r.randn(e, b, a) / np.sqrt(a), jnp.float32))
           for a, b in ((d, i), (d, i), (i, d))]
  out = moe.expert_mlp_mxfp4(x, ids, w, *packs, activation="situ", interpret=True,
                             tiling=(Tiling(16, 64, 32), Tiling(16, 32, 64)))
  c = dataclasses.replace(preset_config("tiny-random"), num_experts=e)
  pe = {f"{n}_packed": p[0] for n, p in zip(("w1", "w3", "w2"), packs)}
  pe.update({f"{n}_scale": p[1] for n, p in zip(("w1", "w3", "w2"), packs)})
  _close(out, layer.routed_experts_reference(pe, x, w, ids, c), rel=1.5e-2)


@pytest.mark.parametrize("fused", [False, True])
def test_default_tiles_fit_shared_memory(fused):
    """Every default tiling of the model's expert shapes fits Hopper's shared memory (a 1024-token
    Kimi-Linear step once asked Triton for 245760 B); decode tiles keep their 4 stages where they fit."""
    from pallas_kernels.moe import schedule as sch
    for tokens in (16, 64, 256, 1024, 4096, 16384):
        for k, n, g, topk in ((2304, 1024, 256, 8), (1024, 2304, 256, 8), (3584, 3072, 112, 16)):
            t = sch.choose_tiling(tokens * topk, k, 2 * n if fused else n, g, fused=fused)
            assert sch.pipeline_smem_bytes(t.bm, t.bk, t.bn, t.num_stages, fused) <= sch.SMEM_LIMIT, (tokens, k, n, t)
    t = sch.choose_tiling(16 * 8, 2304, 2048, 256, fused=True)
    assert t.bm == 16 and t.num_stages == 4
    assert sch.choose_tiling(1024 * 8, 2304, 2048, 256, fused=True).num_stages == 3


# ------------------------- rows gathered in the kernel, MXFP4 halves order, local combine

def test_combine_valid_rows_never_reads_rows_past_the_groups():
  """Rows past valid_rows (other devices' experts, left unwritten by the kernels) are poisoned
  with NaN: the combine must neither read them nor let them through."""
  r = _rng(21)
  ids = jnp.asarray([[0, 5], [1, 0], [-1, 2]], jnp.int32)  # E=3 local; 5 and -1 are foreign
  tok, gs, inv = moe.sort_by_expert(ids, 3)
  y = np.asarray(r.standard_normal((6, 4)), np.float32)
  y[4:] = np.nan  # 4 local rows
  wts = r.random((3, 2)).astype(np.float32)
  out = np.asarray(moe.combine(jnp.asarray(y), jnp.asarray(wts), inv, valid_rows=jnp.sum(gs)))
  flat_inv = np.asarray(inv).reshape(3, 2)
  ref = np.zeros((3, 4), np.float64)
  for t in range(3):
    for j in range(2):
      if 0 <= int(ids[t, j]) < 3:
        ref[t] += wts[t, j] * y[flat_inv[t, j]]
  np.testing.assert_allclose(out, ref, rtol=1e-6)


def test_mxfp4_halves_output_is_the_next_kernels_input():
  """out_halves writes [even columns | odd columns] * 2^shift: bit for bit to_halves of the plain
  output; a down kernel fed that (x_halves) equals the plain chain."""
  from pallas_kernels.moe import mxfp4 as mxm
  x, packed, scales, gs = _mxfp4_case(22, 40, 64, 64, [20, 0, 17, 3], (115, 135))
  shift = mxm.x_shift(mxm.DECODER)
  t = Tiling(16, 32, 32)
  plain = gm.run_mxfp4(x, (packed, scales), gs, tiling=t, mode="kernel", interpret=True)
  halves = gm.run_mxfp4(mxm.to_halves(x, shift), (packed, scales), gs, tiling=t, mode="kernel",
                        interpret=True, x_halves=True, out_halves=True)
  np.testing.assert_array_equal(np.asarray(halves, np.float32),
                                np.asarray(mxm.to_halves(plain, shift), np.float32))
  p2, s2 = moe.quantize_mxfp4(jnp.asarray(_rng(23).standard_normal((4, 32, 64)) / 8, jnp.float32))
  down = gm.run_mxfp4(halves, (p2, s2), gs, tiling=t, mode="kernel", interpret=True, x_halves=True)
  ref = moe.gmm_mxfp4_reference(plain, p2, s2, gs)
  _close(down[:40], ref[:40])


@pytest.mark.parametrize("fmt,swap", [("bf16", False), ("mxfp4", False), ("mxfp4", True)])
def test_expert_mlp_gather_expert_parallel_matches_numpy(fmt, swap):
  """The gather routing (token rows read by the up kernel, rows past the local groups never
  written nor read) with other devices' experts among the ids and several row tiles per expert,
  vs the float64 loop over the local experts; MXFP4 with the weights as either MMA operand."""
  e_tot = 6
  x, local, wts, (q1, q3, q2), ref = _ep_case(24, 24, 64, 64, 3, e_tot, 3, "situ")
  tiles = (Tiling(16, 32, 16, 2, 3, swap), Tiling(16, 32, 32, 2, 3, swap))
  kw = dict(activation="situ", interpret=True, tiling=tiles, gather=True, num_experts_total=e_tot)
  if fmt == "bf16":
    out = moe.expert_mlp(x, jnp.asarray(local), jnp.asarray(wts),
                         *(jnp.asarray(_deq_in_out(q), jnp.bfloat16) for q in (q1, q3, q2)), **kw)
  else:
    out = moe.expert_mlp_mxfp4(x, jnp.asarray(local), jnp.asarray(wts), q1, q3, q2, mode="kernel",
                               **kw)
  assert out.shape == x.shape and np.all(np.isfinite(np.asarray(out, np.float32)))
  _close(out, ref, rel=2e-2)


def test_arrays_that_overflow_32_bit_kernel_offsets_are_read_safely():
  """Pallas' Triton lowering uses signed 32-bit offsets for arrays of <= 2**32 bytes: 1-byte arrays of
  2-4 GiB (MXFP4 packed experts, e.g. a 2-layer stack of K3's 112 local merged experts) faulted on the
  H200. Such a stack is read through the layer's slice, and a lone array in the window is padded past
  2**32 bytes (64-bit offsets); shapes only (nothing allocated)."""
  from pallas_kernels.moe import grouped as gm
  assert gm.overflows_i32_offsets((224, 6144, 1792), jnp.uint8)            # 2.47e9 bytes: faulted
  assert not gm.overflows_i32_offsets((224, 3072, 1792), jnp.uint8)        # 1.23e9: fine
  assert not gm.overflows_i32_offsets((1536, 2304, 1024), jnp.bfloat16)    # 7.2e9 bytes: 64-bit offsets
  assert not gm.overflows_i32_offsets((22 * 112, 3072, 1792), jnp.uint8)   # K3's EP8 stack: 64-bit
  sds = jax.ShapeDtypeStruct
  stack = (sds((2, 112, 6144, 1792), jnp.uint8), sds((2, 112, 6144, 112), jnp.uint8))
  flat, off = jax.eval_shape(lambda *ws: gm._layer_groups(ws, jnp.int32(1)), *stack)
  assert off is None and [w.shape for w in flat] == [(112, 6144, 1792), (112, 6144, 112)]   # the layer's slice
  fits = (sds((2, 112, 3072, 1792), jnp.uint8),)
  flat, off = jax.eval_shape(lambda *ws: gm._layer_groups(ws, jnp.int32(1)), *fits)
  assert flat[0].shape == (224, 3072, 1792) and off is not None                # read in place
  lone = (sds((224, 6144, 1792), jnp.uint8),)
  (padded,), off = jax.eval_shape(lambda *ws: gm._layer_groups(ws, None), *lone)
  assert off is None and padded.shape[0] > 224 and padded.size > 2**32
  assert not gm.overflows_i32_offsets(padded.shape, padded.dtype)
