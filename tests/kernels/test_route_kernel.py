"""The routing kernel (pallas_kernels/moe/route_kernel.py) in interpret mode: its sort and tile schedules
equal XLA's (routing.sort_by_expert, schedule.tile_schedule) bit for bit, the routed expert MLP gives the
same bits with either routing, and the GPU kernel path takes it for decode-sized steps."""
import collections

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import moe
from pallas_kernels.moe import grouped, layout, route_kernel
from pallas_kernels.moe import routing
from pallas_kernels.moe import schedule as sch
from tests.kernels.test_stacked_matmul import _pallas_names

pytestmark = pytest.mark.interpret

BMS = (16, 32)


def _id_cases(r, t, k, e):
  """[t, k] id arrays: random with ids == E (bucket padding), > E and negative (other devices' experts);
  three experts (repeated within and across tokens) and padding; all padding; all in one expert (the
  first, the last); every token the same experts."""
  yield r.integers(-3, e + 3, (t, k))
  yield np.where(r.random((t, k)) < 0.3, e, r.integers(0, min(e, 3), (t, k)))
  yield np.full((t, k), e)
  yield np.full((t, k), 0)
  yield np.full((t, k), e - 1)
  yield np.tile(r.integers(0, e, (1, k)), (t, 1))                               # every token the same


def _xla_routing(ids, e):
  tok, gs, inv = routing.sort_by_expert(ids, e)
  return (tok, gs, inv), {bm: sch.tile_schedule(gs, max(ids.size, bm), bm) for bm in BMS}


@pytest.mark.parametrize("t,k", [(1, 2), (1, 8), (3, 2), (3, 8), (16, 2), (16, 8)])
@pytest.mark.parametrize("e", [8, 64, 256])
def test_kernel_equals_the_xla_routing(t, k, e):
  assert route_kernel.fits(t * k, e, BMS)
  kernel = jax.jit(lambda ids: route_kernel.route(ids, e, BMS, interpret=True))
  xla = jax.jit(lambda ids: _xla_routing(ids, e))
  for ids in _id_cases(np.random.default_rng(t * 1000 + k * 100 + e), t, k, e):
    ids = jnp.asarray(ids, jnp.int32)
    *sort, schedules = kernel(ids)
    want_sort, want_schedules = xla(ids)
    for got, want in zip(sort, want_sort):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for bm in BMS:
      s = schedules[bm]
      assert (s.bm, s.m) == (bm, max(t * k, bm))
      for got, want in zip((s.tg, s.ts, s.te), want_schedules[bm]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_fits_a_decode_bucket_and_no_more():
  """A 16-token bucket's top-8 over 256 experts is the largest: 32 tokens, or 512 experts, are not."""
  assert route_kernel.fits(16 * 8, 256, (16,))
  assert not route_kernel.fits(32 * 8, 256, (16,))
  assert not route_kernel.fits(16 * 8, 512, (16,))


def test_grouped_matmul_refuses_a_schedule_for_other_tiles():
  gs = jnp.asarray([3, 0, 5], jnp.int32)
  other = sch.TileSchedule(32, 32, *sch.tile_schedule(gs, 32, 32))
  x, w = jnp.zeros((32, 32), jnp.bfloat16), jnp.zeros((3, 32, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="tile schedule"):
    grouped.run_bf16(x, (w,), gs, tiling=sch.Tiling(16, 32, 32), interpret=True, schedule=other)


# ------------------------------------------------------------ the routed expert MLP, both routings

@pytest.fixture
def traced(monkeypatch):
  """Counts of the routing functions called while tracing: route_kernel.route, routing.sort_by_expert
  and schedule.tile_schedule (the XLA path's)."""
  calls = collections.Counter()
  for module, name in ((route_kernel, "route"), (routing, "sort_by_expert"), (sch, "tile_schedule")):
    def spy(*args, _f=getattr(module, name), _name=name, **kw):
      calls[_name] += 1
      return _f(*args, **kw)
    monkeypatch.setattr(module, name, spy)
  return calls


def _both_routings(run, traced, monkeypatch):
  """run() with the routing kernel, then with XLA's routing (no cell fits), checking each took its path."""
  new = run()
  assert traced["route"] == 1 and traced["sort_by_expert"] == traced["tile_schedule"] == 0, traced
  monkeypatch.setattr(route_kernel, "MAX_CELLS", 0)
  old = run()
  assert traced["route"] == 1 and traced["sort_by_expert"] == 1 and traced["tile_schedule"] == 2, traced
  return np.asarray(new, np.float32), np.asarray(old, np.float32)


def _inputs(t=16, d=64, i=32, e=16, k=4, seed=0):
  """A decode bucket: the first 5 rows real (random experts, one repeated across tokens), the rest
  bucket padding (every id == E, as the engine routes them) and one id of another device (-1)."""
  r = np.random.default_rng(seed)
  ids = np.stack([r.choice(e, k, replace=False) for _ in range(t)])
  ids[1, 0] = ids[0, 0]
  ids[2, 1] = -1
  ids[5:] = e
  x = jnp.asarray(r.standard_normal((t, d)), jnp.bfloat16)
  wts = jnp.asarray(r.random((t, k)), jnp.float32)
  w = lambda a, b: jnp.asarray(r.standard_normal((e, a, b)) / np.sqrt(a), jnp.bfloat16)  # noqa: E731
  return x, jnp.asarray(ids, jnp.int32), wts, (w(d, i), w(d, i), w(i, d))


@pytest.mark.parametrize("merged", [False, True])
def test_bf16_expert_mlp_has_the_same_bits_with_either_routing(merged, traced, monkeypatch):
  x, ids, wts, (w1, w3, w2) = _inputs()
  up = (layout.merge_gate_up(w1, w3), None) if merged else (w1, w3)
  run = lambda: jax.jit(lambda x, ids, wts: moe.expert_mlp(   # noqa: E731
      x, ids, wts, *up, w2, activation="silu", interpret=True))(x, ids, wts)
  new, old = _both_routings(run, traced, monkeypatch)
  np.testing.assert_array_equal(new, old)
  assert np.all(new[5:] == 0) and np.any(new[:5] != 0)       # padding rows: no routed part


def test_mxfp4_expert_mlp_has_the_same_bits_with_either_routing(traced, monkeypatch):
  x, ids, wts, ws = _inputs(seed=1)
  q1, q3, q2 = (moe.quantize_mxfp4(jnp.swapaxes(w.astype(jnp.float32), 1, 2)) for w in ws)
  run = lambda: jax.jit(lambda x, ids, wts: moe.expert_mlp_mxfp4(   # noqa: E731
      x, ids, wts, q1, q3, q2, activation="situ", interpret=True))(x, ids, wts)
  new, old = _both_routings(run, traced, monkeypatch)
  np.testing.assert_array_equal(new, old)


def test_bf16_expert_mlp_of_different_up_and_down_tiles(traced, monkeypatch):
  """Up tiles of 32 rows, down tiles of 16: one launch computes both schedules."""
  x, ids, wts, (w1, w3, w2) = _inputs(seed=2)
  tiles = (sch.Tiling(32, 64, 32), sch.Tiling(16, 32, 64))
  run = lambda: jax.jit(lambda x, ids, wts: moe.expert_mlp(   # noqa: E731
      x, ids, wts, w1, w3, w2, activation="silu", interpret=True, tiling=tiles))(x, ids, wts)
  new, old = _both_routings(run, traced, monkeypatch)
  np.testing.assert_array_equal(new, old)


# --------------------------------------------------------------------- selection on the GPU path

def _kimi_linear_decode_mlp(tokens):
  """expert_mlp at Kimi-Linear-48B's routing (256 experts, top-8; small widths), shapes only."""
  sds = jax.ShapeDtypeStruct
  e, d, i = 256, 64, 32
  ws = (sds((e, d, i), jnp.bfloat16),) * 2 + (sds((e, i, d), jnp.bfloat16),)
  f = lambda x, ids, wts, *ws: moe.expert_mlp(x, ids, wts, *ws, activation="silu")   # noqa: E731
  return f, (sds((tokens, d), jnp.bfloat16), sds((tokens, 8), jnp.int32), sds((tokens, 8), jnp.float32), *ws)


def test_gpu_decode_mlp_routes_in_one_launch(traced, monkeypatch):
  """With the GPU kernels (traced on CPU), a 16-token decode bucket's expert MLP routes in the routing
  kernel (one launch, before the two grouped matmuls, lowering through Pallas' Triton backend), with
  none of XLA's sort or schedule ops; a 32-token bucket (too many cells) keeps XLA's."""
  monkeypatch.setattr(sch, "use_kernel", lambda interpret: (True, False))   # CPU host, GPU target
  f, args = _kimi_linear_decode_mlp(16)
  names = _pallas_names(jax.make_jaxpr(f)(*args).jaxpr, collections.Counter())
  assert names == {"moe_route": 1, "moe_gmm_bf16_2": 1, "moe_gmm_bf16_1": 1}, names
  assert traced == {"route": 1}, traced
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3
  f, args = _kimi_linear_decode_mlp(32)
  names = _pallas_names(jax.make_jaxpr(f)(*args).jaxpr, collections.Counter())
  assert "moe_route" not in names and traced["sort_by_expert"] == 1, (names, traced)


def test_gpu_decode_step_routes_each_moe_layer_in_one_launch(traced, monkeypatch):
  """The tiny model's decode step traced for the GPU kernels: the routing kernel once per MoE layer
  (as often as the layer's down projection), and none of XLA's sort or schedule ops."""
  from k3jax.cache import SeqChunk, make_step_batch, pool_shapes
  from k3jax.layer_stack import stack_layers
  from k3jax.nnx_model import make_step
  from k3jax.params import param_shapes
  from k3jax.presets import preset_config
  from pallas_kernels.backend import Backend
  monkeypatch.setattr(sch, "use_kernel", lambda interpret: (True, False))   # CPU host, GPU target
  c = preset_config("tiny-random")
  params = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, jnp.bfloat16))
  pools = pool_shapes(c, 17, 16, 6, jnp.bfloat16)
  batch = make_step_batch([SeqChunk([1], 5, [1], 1, 1), SeqChunk([1], 5, [2], 2, 2)], 16, num_tokens=16,
                          num_seqs=4, max_pages=2)
  backend = Backend(kernels=True, platform="gpu", device="gpu")
  names = _pallas_names(jax.make_jaxpr(make_step(c, backend))(params, pools, batch).jaxpr, collections.Counter())
  assert names["moe_route"] == traced["route"] == names["moe_gmm_mxfp4_1"] >= 1, (names, traced)
  assert traced["sort_by_expert"] == traced["tile_schedule"] == 0, traced
