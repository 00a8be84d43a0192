"""Expert-parallel MoE (shard_map + all-to-all) against the reference `MoE` module on 8 CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.moe import MoE
from k3jax.params import init_params_numpy
from k3jax.presets import preset_config
from sharding.mesh import make_mesh
from sharding.moe_ep import moe_ep, routed_experts_ep
from sharding.rules import shard_params
from tests.support.tiers import slow_case


def _setup(fmt, dtype, T=13):
    c = preset_config("tiny-random")
    if fmt == "bf16":
        c = c.replace(expert_format="bf16")
    params = init_params_numpy(c, 1, dtype)
    x = jax.random.normal(jax.random.key(2), (T, c.hidden_size), dtype)
    return c, params, x


# one case of each comparison below by default (fp32; bf16 bit-identical without a tensor split; bf16 with one)
@pytest.mark.parametrize("fmt,dtype,spec", [
    ("mxfp4", jnp.float32, "tensor=2,expert=4"), ("bf16", jnp.bfloat16, "data=2,expert=4"),
    ("mxfp4", jnp.bfloat16, "tensor=2,expert=4"),
    *(slow_case(f, d, s) for f, d, s in [("bf16", jnp.float32, "tensor=2,expert=4"),
                                         ("mxfp4", jnp.float32, "data=2,expert=4"),
                                         ("bf16", jnp.float32, "data=2,expert=4"),
                                         ("mxfp4", jnp.bfloat16, "data=2,expert=4"),
                                         ("bf16", jnp.bfloat16, "tensor=2,expert=4")])])
def test_moe_ep_matches_reference(fmt, dtype, spec):
    c, params, x = _setup(fmt, dtype)         # 13 tokens: not divisible by 8, exercises padding
    ref = np.asarray(jax.jit(lambda p, x: MoE.of(c, p)(x, c))(params["layers"][1]["mlp"], x), np.float32)
    mesh = make_mesh(spec)
    ps = shard_params(params, mesh, c)["layers"][1]["mlp"]
    f = jax.jit(lambda p, x: moe_ep(p, x, c, mesh))
    hlo = f.lower(ps, x).compile().as_text()
    assert "all-to-all" in hlo                        # the experts really are remote
    out = np.asarray(f(ps, x), np.float32)
    assert np.abs(ref).max() > 0.1
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    elif spec.startswith("data"):
        # bf16 without a tensor split: the same per-row matmuls and the same fp32 combine order
        np.testing.assert_array_equal(out, ref)
    else:
        # tensor=2 sums two bf16-rounded partial expert outputs: within a couple of bf16 ulps
        np.testing.assert_allclose(out, ref, rtol=2 ** -6, atol=2 ** -6 * np.abs(ref).max())


def test_dropless_under_skewed_routing_and_capacity_factor():
    c, params, _ = _setup("mxfp4", jnp.float32, T=16)
    mesh = make_mesh("expert=8")
    pe = shard_params(params, mesh, c)["layers"][1]["mlp"]["experts"]
    z = jax.random.normal(jax.random.key(3), (16, c.expert_hidden), jnp.float32)
    # every token picks experts 0..3, all owned by device 0: the worst case for a capacity buffer
    ids = jnp.tile(jnp.arange(4, dtype=jnp.int32), (16, 1))
    w = jax.random.uniform(jax.random.key(4), (16, 4), jnp.float32)
    from k3jax.layers.moe import routed_experts_reference
    ref = np.asarray(routed_experts_reference(params["layers"][1]["mlp"]["experts"], z, w, ids, c))
    out = np.asarray(jax.jit(lambda pe, z, w, i: routed_experts_ep(pe, z, w, i, c, mesh))(pe, z, w, ids))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # capacity_factor=1: 1 row per destination (ceil(1 * 2 tokens * 4 copies / 8)); each device keeps 2 of 8 copies
    dropped = np.asarray(jax.jit(lambda pe, z, w, i: routed_experts_ep(pe, z, w, i, c, mesh, capacity_factor=1.0))(
        pe, z, w, ids))
    kept = np.abs(dropped).sum(-1) > 0
    assert 0 < kept.sum() < 16                 # lossy by design, and documented as such
    full = np.asarray(jax.jit(lambda pe, z, w, i: routed_experts_ep(pe, z, w, i, c, mesh, capacity_factor=8.0))(
        pe, z, w, ids))
    np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-5)


def test_experts_not_divisible_by_expert_axis_raise():
    c, params, x = _setup("bf16", jnp.float32)
    c = c.replace(num_experts=12)
    mesh = make_mesh("expert=8")
    pe = {k: v[:12] for k, v in params["layers"][1]["mlp"]["experts"].items()}
    ids = jnp.zeros((4, c.num_experts_per_token), jnp.int32)
    with pytest.raises(ValueError, match="12 experts are not divisible by the expert axis"):
        routed_experts_ep(pe, x[:4, :c.expert_hidden], jnp.ones(ids.shape), ids, c, mesh)


def test_ep_splits_merged_experts_back():
    """A single-device load's merged gate/up (k3jax.expert_layout) reaching the expert-parallel path
    with a tensor split: split back to the checkpoint layout first, so the same output as that layout."""
    from k3jax.expert_layout import merge_experts
    c, params, _ = _setup("mxfp4", jnp.float32)
    pe = params["layers"][1]["mlp"]["experts"]
    r = np.random.RandomState(3)
    x = jnp.asarray(r.standard_normal((13, c.expert_hidden)), jnp.float32)    # the experts' (latent) width
    ids = jnp.asarray(np.stack([r.choice(c.num_experts, c.num_experts_per_token, replace=False)
                                for _ in range(x.shape[0])]), jnp.int32)
    wts = jnp.asarray(r.rand(*ids.shape), jnp.float32)
    f = jax.jit(lambda pe, x: routed_experts_ep(pe, x, wts, ids, c, make_mesh("tensor=2,expert=4")))
    np.testing.assert_array_equal(np.asarray(f(merge_experts(pe), x)), np.asarray(f(pe, x)))
