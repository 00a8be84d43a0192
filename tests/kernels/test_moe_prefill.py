"""The MoE kernels at prefill shapes: default prefill tiles, merged gate/up weights, joined MXFP4
halves and half-height tail tiles, each against the numpy / dequantized references (interpret mode)."""
import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels import moe
from pallas_kernels.moe import grouped as gm
from pallas_kernels.moe import kernel as kn
from pallas_kernels.moe.schedule import Tiling

from tests.kernels.test_moe_kernels import _bf16, _close, _deq_in_out, _ep_case, _rng

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_expert_mlp_prefill_defaults(fmt, monkeypatch):
  """At prefill (here 80 rows per expert) the MLP runs the tiling the MoE prefill sweep
  measured: schedule.PREFILL_TILES, rows gathered in the kernel from GATHER_MIN_ROWS on, MXFP4
  decoded in the kernel below PREDEQUANT_MIN_ROWS; and stays equal to the float64 loop."""
  from pallas_kernels.moe import schedule as sch
  seen = []
  orig = kn.grouped_matmul
  monkeypatch.setattr(gm.kn, "grouped_matmul", lambda *a, **kw: seen.append(kw) or orig(*a, **kw))
  x, local, wts, (q1, q3, q2), ref = _ep_case(25, 80, 64, 64, 2, 2, 2, "silu")
  kw = dict(activation="silu", interpret=True)
  if fmt == "bf16":
    out = moe.expert_mlp(x, jnp.asarray(local), jnp.asarray(wts),
                         *(jnp.asarray(_deq_in_out(q), jnp.bfloat16) for q in (q1, q3, q2)), **kw)
  else:
    out = moe.expert_mlp_mxfp4(x, jnp.asarray(local), jnp.asarray(wts), q1, q3, q2, **kw)
  _close(out, ref, rel=2e-2)
  mx4 = fmt == "mxfp4"
  want_fmt = ("mxfp4" if 80 < sch.PREDEQUANT_MIN_ROWS else "bf16t") if mx4 else "bf16"
  assert [s["fmt"] for s in seen] == [want_fmt] * 2
  for s, fused in zip(seen, (True, False)):
    t = sch.PREFILL_TILES[(mx4 and want_fmt == "mxfp4", fused)]
    assert (s["tiling"].bm, s["tiling"].swap_ab, s["tiling"].num_warps) == (128, t.swap_ab, t.num_warps)
  assert (seen[0]["row_index"] is not None) == (80 >= sch.GATHER_MIN_ROWS)


def test_prefill_tiles_survive_the_shared_memory_check():
  """The measured prefill winners come out of choose_tiling unchanged at the bench shapes (the
  shared-memory loop would silently drop a stage)."""
  from pallas_kernels.moe import schedule as sch
  for (k, n), fused in (((3584, 3072), True), ((3072, 3584), False), ((2304, 1024), True),
                        ((1024, 2304), False)):
    for mx4 in (False, True):
      assert sch.choose_tiling(524288, k, n, 112, mxfp4=mx4, fused=fused, avg_rows=585.0) == \
          sch.PREFILL_TILES[(mx4, fused)]


# ------------------------------------- merged gate/up weights, half-height tail tiles

def test_merged_gate_up_layout_round_trips():
  """The merged layouts interleave gate / up columns (bf16) or rows (MXFP4; features in halves
  order: 0, 2, 4, 6, 1, 3, 5, 7); unmerge gives the inputs back bit for bit."""
  from pallas_kernels.moe import layout
  r = _rng(30)
  q = lambda: (jnp.asarray(r.integers(0, 256, (2, 8, 16), dtype=np.uint8)),
               jnp.asarray(r.integers(100, 140, (2, 8, 1), dtype=np.uint8)))
  q1, q3 = q(), q()
  merged = layout.merge_gate_up_mxfp4(q1, q3)
  np.testing.assert_array_equal(np.asarray(merged[0])[:, 2 * 5], np.asarray(q1[0])[:, 3])
  np.testing.assert_array_equal(np.asarray(merged[0])[:, 2 * 2], np.asarray(q1[0])[:, 4])
  np.testing.assert_array_equal(np.asarray(merged[1])[:, 2 * 3 + 1], np.asarray(q3[1])[:, 6])
  for a, b in zip((*q1, *q3), (*sum(layout.unmerge_gate_up_mxfp4(merged), ()),)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  w1, w3 = (_bf16(r.standard_normal((2, 4, 6))) for _ in range(2))
  w13 = np.asarray(layout.merge_gate_up(w1, w3), np.float32)
  np.testing.assert_array_equal(w13[..., 0::2], np.asarray(w1, np.float32))
  np.testing.assert_array_equal(w13[..., 1::2], np.asarray(w3, np.float32))


@pytest.mark.parametrize("fmt,swap,gather,joined,merged", [
    ("bf16", False, True, False, True), ("mxfp4", False, False, False, True),
    ("mxfp4", True, True, False, True), ("mxfp4", True, True, True, False),
    ("mxfp4", False, False, True, False)])
def test_expert_mlp_merged_joined_half_tail_matches_numpy(fmt, swap, gather, joined, merged):
  """The expert MLP on merged gate/up weights (one matmul per tile, the activation splitting its
  accumulator) or two, MXFP4 halves joined back into natural K order (one MMA per K step, x and h
  in natural order), bm-32 tiles whose tail tiles of <= 16 rows run the half-height loop,
  gathered and materialized rows, other devices' experts among the ids: the float64 loop's
  values."""
  from pallas_kernels.moe import layout
  e_tot = 5
  x, local, wts, (q1, q3, q2), ref = _ep_case(32, 72, 64, 64, 3, e_tot, 3, "situ")
  tiles = (Tiling(32, 32, 16, 4, 3, swap, True, joined), Tiling(32, 32, 32, 4, 3, swap, True, joined))
  sizes = np.bincount(local[local >= 0].ravel(), minlength=3)
  assert any(0 < s % 32 <= 16 for s in sizes) and any(s % 32 > 16 for s in sizes), sizes
  kw = dict(activation="situ", interpret=True, tiling=tiles, gather=gather, num_experts_total=e_tot)
  if fmt == "bf16":
    w1, w3, w2 = (jnp.asarray(_deq_in_out(q), jnp.bfloat16) for q in (q1, q3, q2))
    out = moe.expert_mlp(x, jnp.asarray(local), jnp.asarray(wts), layout.merge_gate_up(w1, w3),
                         None, w2, **kw)
  else:
    up = (layout.merge_gate_up_mxfp4(q1, q3), None) if merged else (q1, q3)
    out = moe.expert_mlp_mxfp4(x, jnp.asarray(local), jnp.asarray(wts), *up, q2, mode="kernel",
                               **kw)
  _close(out, ref, rel=2e-2)


def test_merged_gate_up_rejects_predequant_and_bad_pairs():
  from pallas_kernels.moe import layout
  x, local, wts, (q1, q3, q2), _ = _ep_case(32, 4, 64, 32, 2, 2, 1, "silu")
  with pytest.raises(ValueError, match="mode 'kernel' only"):
    moe.expert_mlp_mxfp4(x, jnp.asarray(local), jnp.asarray(wts), layout.merge_gate_up_mxfp4(q1, q3),
                         None, q2, activation="silu", interpret=True, mode="predequant")
  with pytest.raises(ValueError, match="differ"):
    layout.merge_gate_up_mxfp4(q1, q2)
  with pytest.raises(ValueError, match="halves order"):
    moe.expert_mlp_mxfp4(x, jnp.asarray(local), jnp.asarray(wts), layout.merge_gate_up_mxfp4(q1, q3),
                         None, q2, activation="silu", interpret=True,
                         tiling=(Tiling(16, 32, 16, joined=True), Tiling(16, 32, 16, joined=True)))
  with pytest.raises(ValueError, match="agree on joined"):
    moe.expert_mlp_mxfp4(x, jnp.asarray(local), jnp.asarray(wts), q1, q3, q2, activation="silu",
                         interpret=True, tiling=(Tiling(16, 32, 16, joined=True), Tiling(16, 32, 16)))
  with pytest.raises(ValueError, match="GLU needs"):
    gm.run_bf16(x, (jnp.zeros((2, 64, 32), jnp.bfloat16),) * 3, jnp.asarray([2, 2], jnp.int32),
                tiling=None, act=lambda a, b: a * b, interpret=True)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_expert_mlp_merged_prefill_defaults(fmt, monkeypatch):
  """Merged gate/up weights at prefill (80 rows per expert) run schedule.PREFILL_TILES' merged
  tiles (bm capped at 128 below 256 rows), MXFP4's down kernel reads h in the up kernel's joined
  form; the float64 loop's values."""
  from pallas_kernels.moe import layout
  from pallas_kernels.moe import schedule as sch
  seen = []
  orig = kn.grouped_matmul
  monkeypatch.setattr(gm.kn, "grouped_matmul", lambda *a, **kw: seen.append(kw["tiling"]) or orig(*a, **kw))
  x, local, wts, (q1, q3, q2), ref = _ep_case(33, 80, 64, 64, 2, 2, 2, "silu")
  kw = dict(activation="silu", interpret=True)
  if fmt == "bf16":
    w1, w3, w2 = (jnp.asarray(_deq_in_out(q), jnp.bfloat16) for q in (q1, q3, q2))
    out = moe.expert_mlp(x, jnp.asarray(local), jnp.asarray(wts), layout.merge_gate_up(w1, w3), None,
                         w2, **kw)
  else:
    out = moe.expert_mlp_mxfp4(x, jnp.asarray(local), jnp.asarray(wts),
                               layout.merge_gate_up_mxfp4(q1, q3), None, q2, **kw)
  _close(out, ref, rel=2e-2)
  mx4 = fmt == "mxfp4"
  up = sch.PREFILL_TILES[(mx4, "merged")]
  down = sch.PREFILL_TILES[(mx4, "joined" if mx4 and up.joined else False)]
  assert [(t.swap_ab, t.joined, t.half_tail) for t in seen] == [
      (t.swap_ab, t.joined, t.half_tail) for t in (up, down)]
  assert seen[0].bm == 128


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_expert_mlp_merged_reads_a_layer_of_stacked_experts(fmt):
  """Merged gate/up weights stacked over layers ([L, E, ...]): `layer` picks its experts in place
  (MXFP4 with half-tail tiles); layer 0 holds other weights, so reading it would show."""
  from pallas_kernels.moe import layout
  x, local, wts, (q1, q3, q2), ref = _ep_case(34, 40, 64, 64, 2, 3, 2, "situ")
  stack = lambda a: jnp.stack([jnp.flip(a, axis=0), a])      # layer 0: the experts in reverse order
  kw = dict(activation="situ", interpret=True, layer=1, num_experts_total=3, gather=True)
  if fmt == "bf16":
    w1, w3, w2 = (jnp.asarray(_deq_in_out(q), jnp.bfloat16) for q in (q1, q3, q2))
    out = moe.expert_mlp(x, jnp.asarray(local), jnp.asarray(wts), stack(layout.merge_gate_up(w1, w3)),
                         None, stack(w2), **kw)
  else:
    tiles = (Tiling(32, 32, 16, 4, 3, True, True), Tiling(32, 32, 32, 4, 3, True, True))
    out = moe.expert_mlp_mxfp4(x, jnp.asarray(local), jnp.asarray(wts),
                               tuple(map(stack, layout.merge_gate_up_mxfp4(q1, q3))), None,
                               tuple(map(stack, q2)), tiling=tiles, mode="kernel", **kw)
  _close(out, ref, rel=2e-2)


def triton_ir(f, *args):
  """Triton IR text of the (one) Pallas kernel that jax.jit(f)(*args) lowers for CUDA, on any host
  (uses jax internals)."""
  import jax
  from jax._src.pallas.triton import pallas_call_registration as pcr
  got, orig = [], pcr.lowering.lower_jaxpr_to_triton_module

  def grab(*a, **kw):
    r = orig(*a, **kw)
    got.append(getattr(r, "module", r))
    return r

  pcr.lowering.lower_jaxpr_to_triton_module = grab
  try:
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    pcr.lowering.lower_jaxpr_to_triton_module = orig
  return got[-1].operation.get_asm(enable_debug_info=False)


@pytest.mark.parametrize("swap", [True, False])
def test_joined_halves_never_join_straight_from_the_decoder_asm(swap):
  """XLA's Triton joins a tt.join's operands two values at a time when the first one comes straight
  from an inline asm of 4 packed elements with 16-bit results (its int4 unpacking patch), which
  scrambled the joined MXFP4 tiles' K order on the H200 (rel err 1.2-1.3, 2026-12-01; interpret
  mode and upstream Triton join one at a time). The kernel's Triton IR must give the join another
  producer (kernel.interleave_k: a bitcast)."""
  import re
  import jax
  g, k, n = 4, 256, 128
  sds = jax.ShapeDtypeStruct
  p, s = sds((g, n, k // 2), jnp.uint8), sds((g, n, k // 32), jnp.uint8)
  t = Tiling(64, 64, 64, 4, 3, swap, joined=True)
  f = lambda x, gs, p, s: gm.run_mxfp4(x, (p, s), gs, tiling=t, mode="kernel", decoder="ptx8")
  ir = triton_ir(f, sds((256, k), jnp.bfloat16), sds((g,), jnp.int32), p, s)
  asm = set(re.findall(r"(%\w+) = tt\.elementwise_inline_asm .*packed_element = 4", ir))
  joins = re.findall(r"tt\.join (%\w+), (%\w+)", ir)
  assert len(asm) == 2 and len(joins) == 1, (asm, joins)
  assert not asm & {a for a, _ in joins}, joins
