"""Dense weights of scanned layers read in place (pallas_kernels/stacked.py, Backend.dense_in_place): the
kernel equals the sliced matmul, and the scanned step's projections reach it as whole stacks and compute
what the repeats' slices compute."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from k3jax.cache import SeqChunk, make_pools, make_step_batch, pool_shapes
from k3jax.layer_stack import layer_stack_plan, stack_layers
from k3jax.nnx_model import make_step
from k3jax.params import init_params_numpy, param_shapes
from k3jax.presets import preset_config
from pallas_kernels import ops, stacked
from pallas_kernels.moe import schedule as sch
from pallas_kernels.backend import Backend

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("rows,k,n", [(5, 64, 48), (32, 128, 256)])
def test_kernel_reads_the_layer_in_place(rows, k, n):
    r = np.random.RandomState(0)
    w = jnp.asarray(r.randn(3, k, n) * 0.1, jnp.bfloat16)
    x = jnp.asarray(r.randn(2, rows, k), jnp.bfloat16)             # leading dims flattened and restored
    assert stacked.fits(x, w)
    for i in (0, 2):
        got = jax.jit(lambda x, w, i: stacked.stacked_matmul(x, w, i, kernel=True, interpret=True))(x, w, jnp.int32(i))
        want = np.asarray(x, np.float32) @ np.asarray(w[i], np.float32)
        assert got.shape == (2, rows, n) and got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=8e-3 * np.abs(want).max())


def test_kernel_path_only_where_it_fits():
    w = jnp.zeros((2, 64, 48), jnp.bfloat16)
    assert not stacked.fits(jnp.zeros((4, 64), jnp.float32), w.astype(jnp.float32))      # fp32: the slice
    assert not stacked.fits(jnp.zeros((stacked.MAX_ROWS + 1, 64), jnp.bfloat16), w)      # prefill: the slice
    assert not stacked.fits(jnp.zeros((4, 64), jnp.bfloat16), jnp.zeros((2, 64, 40), jnp.bfloat16))  # N % 16
    for m in (1, 16, 64):
        t = stacked.tiling(m, 2304, 4096)
        assert t.bm >= m and 2304 % t.bk == 0 and 4096 // t.bn >= 128    # one row tile, ~a column tile per SM
        assert sch.pipeline_smem_bytes(t.bm, t.bk, t.bn, t.num_stages + 1, False) <= sch.SMEM_LIMIT


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
def test_products_in_one_launch_are_each_products_bits(rows):
    """stacked_matmuls: products of different widths (K, N) in one launch give each product's bits as its
    own launch (stacked_matmul) does, for every repeat; a pair the kernel cannot take (N not a multiple of
    16) is the sliced matmul, and the others still share one launch."""
    r = np.random.RandomState(1)
    shapes = ((64, 96), (64, 32), (64, 16), (32, 48), (64, 8))
    ws = [jnp.asarray(r.randn(3, k, n) * 0.1, jnp.bfloat16) for k, n in shapes]
    xs = [jnp.asarray(r.randn(2, rows, w.shape[1]), jnp.bfloat16) for w in ws]
    launches = []
    real = stacked._one_launch
    for i in (0, 2):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(stacked, "_one_launch", lambda pairs, *a: launches.append(len(pairs)) or real(pairs, *a))
            got = jax.jit(lambda xs, ws, i: stacked.stacked_matmuls(list(zip(xs, ws)), i, kernel=True,
                                                                    interpret=True))(xs, ws, jnp.int32(i))
        for g, x, w in zip(got, xs, ws):
            alone = stacked.stacked_matmul(x, w, jnp.int32(i), kernel=True, interpret=True)
            want = np.asarray(x, np.float32) @ np.asarray(w[i], np.float32)
            assert g.shape == (2, rows, w.shape[2]) and g.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(g), np.asarray(alone))
            np.testing.assert_allclose(np.asarray(g, np.float32), want, rtol=0, atol=8e-3 * np.abs(want).max())
    assert launches == ([4, 4] if 2 * rows <= stacked.MAX_ROWS else [])     # 66 rows: each product alone


def test_glu_in_one_launch_is_act_of_the_two_products():
    """stacked_glu: act(x @ gate, x @ up) with act in the kernel's epilogue on each product rounded to bf16,
    as the two launches and the activation compute it; without the kernel the same function of the slices."""
    r = np.random.RandomState(2)
    gate, up = (jnp.asarray(r.randn(3, 64, 48) * 0.1, jnp.bfloat16) for _ in range(2))
    x = jnp.asarray(r.randn(5, 64), jnp.bfloat16)
    act = lambda g, u: (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)   # noqa: E731
    for i in (0, 1):
        got = stacked.stacked_glu(x, gate, up, jnp.int32(i), act, kernel=True, interpret=True)
        want = act(stacked.stacked_matmul(x, gate, jnp.int32(i), kernel=True, interpret=True),
                   stacked.stacked_matmul(x, up, jnp.int32(i), kernel=True, interpret=True))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0,
                                   atol=1e-2 * float(jnp.abs(want.astype(jnp.float32)).max()))
        np.testing.assert_array_equal(np.asarray(stacked.stacked_glu(x, gate, up, jnp.int32(i), act, kernel=False)),
                                      np.asarray(act(x @ gate[i], x @ up[i])))


def _matmul_weights(tree) -> list:
    """The arrays of a unit's parameter tree that the layers use as `x @ w` (their projections)."""
    if isinstance(tree, list):
        return [w for t in tree for w in _matmul_weights(t)]
    out = []
    for name, v in tree.items():
        if isinstance(v, (dict, list)):
            out += _matmul_weights(v) if name not in ("experts", "attn_res") else []   # kernels; mixing weights
        elif name in ("gate", "up", "down", "latent_down", "latent_up") or (name.endswith("_proj") and name != "kv_b_proj"):
            out.append(v)
    return out


# CI's time budget (a whole step compiled for its HLO); the GPU decode step's check runs by default
@pytest.mark.slow
def test_scanned_step_reads_projections_in_their_stacks(monkeypatch):
    """The scan passes only the repeat index; with dense_in_place every projection of the scanned block
    reaches ops.stacked_matmul(s) or ops.stacked_glu as its whole stack [repeats, K, N] (read in place where the kernel
    fits), and the step computes what it computes with the repeats' slices."""
    c = preset_config("tiny-random")
    params = stack_layers(init_params_numpy(c, 2, jnp.float32), c)
    tokens = np.random.RandomState(1).randint(0, c.vocab_size, 13).astype(np.int32)
    batch = make_step_batch([SeqChunk(tokens, 0, [3, 1], -1, 2, ckpt_dst=1)], 8, num_tokens=16, num_seqs=4,
                            max_pages=4)
    calls = []
    real = ops.stacked_matmul, ops.stacked_matmuls, ops.stacked_glu
    monkeypatch.setattr(ops, "stacked_matmul", lambda x, w, i, **kw: calls.append(w.shape) or real[0](x, w, i, **kw))
    monkeypatch.setattr(ops, "stacked_matmuls", lambda pairs, i, **kw: calls.extend(w.shape for _, w in pairs)
                        or real[1](pairs, i, **kw))
    monkeypatch.setattr(ops, "stacked_glu", lambda x, a, b, i, act, **kw: calls.extend((a.shape, b.shape))
                        or real[2](x, a, b, i, act, **kw))
    outs, scans, seen = [], [], []
    for b in (Backend(), Backend(dense_in_place=True)):
        fn = make_step(c, b)
        calls.clear()
        jaxpr = jax.make_jaxpr(fn)(params, make_pools(c, 6, 8, 5, jnp.float32), batch)
        seen.append(sorted(calls))
        scans.append(max((e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"), key=lambda e: len(e.invars)))
        outs.append(jax.jit(fn)(params, make_pools(c, 6, 8, 5, jnp.float32), batch))
    for a, b in zip(jax.tree_util.tree_leaves(outs[1]), jax.tree_util.tree_leaves(outs[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the scan's only sliced input is the repeat index: the parameters are its constants
    assert [len(s.invars) - s.params["num_consts"] - s.params["num_carry"] for s in scans] == [1, 1]
    repeats = layer_stack_plan(c).repeats
    want = sorted(w.shape for w in _matmul_weights(params["layers"]["units"]))
    assert len(want) > 8 and all(s[0] == repeats and len(s) == 3 for s in want)
    assert seen == [[], want], seen


def test_gpu_decode_step_slices_no_projection_stack():
    """The tiny model's decode step lowered for the GPU from CPU (bf16, shapes only): with dense_in_place no
    op slices a scanned projection the kernel takes (K, N multiples of 16) out of its stack; the kernel
    reads the whole stack. Without it, each such stack is sliced (the detector is seen to find them)."""
    c = preset_config("tiny-random")
    params = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, jnp.bfloat16))
    pools = pool_shapes(c, 17, 16, 6, jnp.bfloat16)
    batch = make_step_batch([SeqChunk([1], 5, [1], 1, 1), SeqChunk([1], 5, [2], 2, 2)], 16, num_tokens=16,
                            num_seqs=4, max_pages=2)
    stacks = {"x".join(map(str, w.shape)) + "xbf16" for w in _matmul_weights(params["layers"]["units"])
              if w.shape[1] % 16 == 0 and w.shape[2] % 16 == 0}
    assert len(stacks) >= 5
    sliced = []
    for in_place in (False, True):
        backend = Backend(kernels=True, platform="gpu", device="gpu", dense_in_place=in_place)
        text = jax.jit(make_step(c, backend)).trace(params, pools, batch).lower(lowering_platforms=("cuda",)).as_text()
        operands = {m.group(1) for m in re.finditer(r"stablehlo\.dynamic_slice .*?: \(tensor<([\dx\w]+)>", text)}
        sliced.append(stacks & operands)
    assert sliced == [stacks, set()], sliced


def _pallas_names(jaxpr, out):
    """Counts of the pallas_call kernel names in a jaxpr and its sub-jaxprs (a scan's body counted once)."""
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            name = e.params.get("name_and_src_info", e.params.get("name"))    # (its key differs by jax version)
            out[str(name).split(" ")[0]] += 1
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _pallas_names(inner, out)
    return out


def test_gpu_decode_step_runs_a_layers_projections_of_one_input_in_one_launch():
    """The tiny model's decode step traced for the GPU kernels with dense_in_place: the KDA layer's
    projections of x (q, k, v, f_a, full-rank gate; b_proj's 4 columns are not a multiple of 16) are one
    launch, MLA's q_a and kv_a another, every GLU (shared experts, dense MLP) gate + up + activation one."""
    import collections
    c = preset_config("tiny-random")
    assert c.kda_full_rank_gate and c.q_lora_rank
    params = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, jnp.bfloat16))
    pools = pool_shapes(c, 17, 16, 6, jnp.bfloat16)
    batch = make_step_batch([SeqChunk([1], 5, [1], 1, 1), SeqChunk([1], 5, [2], 2, 2)], 16, num_tokens=16,
                            num_seqs=4, max_pages=2)
    names = []
    for in_place in (False, True):
        backend = Backend(kernels=True, platform="gpu", device="gpu", dense_in_place=in_place)
        names.append(_pallas_names(jax.make_jaxpr(make_step(c, backend))(params, pools, batch).jaxpr,
                                   collections.Counter()))
    assert not any(n.startswith(("stacked", "moe_gmm_bf16")) for n in names[0])
    assert names[1]["stacked_matmuls_5"] == 1 and names[1]["stacked_matmuls_2"] == 1, names[1]
    assert names[1]["moe_gmm_bf16_2"] == _glus(params["layers"]["units"]) >= 1, names[1]


def _glus(tree) -> int:
    """GLU MLPs (gate, up and down weights of their own, not the routed experts') in a parameter tree."""
    if isinstance(tree, list):
        return sum(_glus(t) for t in tree)
    if not isinstance(tree, dict):
        return 0
    own = int({"gate", "up", "down"} <= tree.keys() and not isinstance(tree["gate"], dict))
    return own + sum(_glus(v) for k, v in tree.items() if k != "experts")
