"""The tiny model on 8 fake CPU devices gives the greedy tokens of 1 device (and logits within fp32 noise).

The sharded runs use the partition rules for params and pools, jit with donated pools kept on
their shardings, and expert-parallel MoE (the hook `moe.py` is to call is patched in here).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.cache import SeqChunk, make_pools, make_step_batch
from k3jax.params import init_params_numpy
from k3jax.presets import TINY_SEED, preset_config
from tests.support.mp_common import GEN, MAX_NEW, POOL, PROMPTS
from sharding.mesh import make_mesh
from sharding.rules import pool_shardings, shard_params, shard_pools
from sharding.step import greedy, sharded_step

# Measured: perturbing every fp32 weight of the tiny model by a relative 1e-7 moves its logits
# by ~5e-4 (max |logit| ~4): reordered fp32 sums (sharded matmuls, psums) do the same
# (measured here: <= 6e-4 over the 6 steps of both meshes).
LOGIT_ATOL = 5e-3


def _run(mesh, params, c):
    pools = make_pools(c, POOL["num_pages"], POOL["page_size"], POOL["num_slots"], jnp.float32)
    if mesh is not None:
        pools, params = shard_pools(pools, mesh), shard_params(params, mesh, c)
    step = sharded_step(c, mesh, pools)
    logits = []
    toks = greedy(step, params, pools, PROMPTS, MAX_NEW, on_logits=logits.append, **GEN)
    return toks, np.stack(logits)


@pytest.fixture(scope="module")
def model():
    c = preset_config("tiny-random")
    return c, init_params_numpy(c, TINY_SEED, jnp.float32)


@pytest.fixture(scope="module")
def single(model):
    return _run(None, model[1], model[0])


@pytest.mark.timeout(300)
# CI's time budget: the engine on a data=2,expert=4 mesh is tests/sharding/test_engine_mesh.py's default test
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["data=2,expert=4", "tensor=2,expert=4"])
def test_greedy_tokens_equal_on_8_devices(model, single, spec):
    c, params = model
    toks, logits = _run(make_mesh(spec), params, c)
    ref_toks, ref_logits = single
    assert len(set(map(tuple, ref_toks))) == 3           # three different continuations
    assert toks == ref_toks
    assert np.abs(ref_logits).max() > 1.0
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGIT_ATOL)


@pytest.mark.timeout(300)
def test_step_keeps_pool_shardings_and_uses_all_to_all(model):
    c, params = model
    mesh = make_mesh("data=2,expert=4")
    pools = shard_pools(make_pools(c, POOL["num_pages"], POOL["page_size"], POOL["num_slots"], jnp.float32), mesh)
    want = pool_shardings(c, mesh, pools)
    step = sharded_step(c, mesh, pools)
    batch = make_step_batch([SeqChunk(p, 0, [1 + 2 * i, 2 + 2 * i], -1, i + 1) for i, p in enumerate(PROMPTS)],
                            POOL["page_size"], num_tokens=16)
    compiled = step.lower(shard_params(params, mesh, c), pools, batch).compile()
    assert "all-to-all" in compiled.as_text()
    _, new = compiled(shard_params(params, mesh, c), pools, batch)
    for a, s in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(want)):
        assert a.sharding.is_equivalent_to(s, a.ndim)
    assert float(jnp.abs(new.kda_state[1, 0]).max()) > 0   # sequence 0's slot was written (first KDA layer)
