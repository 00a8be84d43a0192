"""MoE on TPU: jax's megablox gmm behind ragged_dot semantics, and the dispatch that routes the
model's experts to it (run in Pallas interpret mode on CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.moe import MoE
from k3jax.params import init_params_numpy
from k3jax.presets import preset_config
from pallas_kernels.backend import detect
from pallas_kernels.moe.tpu import gmm_tpu

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("m,k,n,g", [(200, 96, 160, 5), (37, 64, 48, 3), (300, 256, 384, 4), (5, 128, 256, 8)])
def test_gmm_tpu_equals_ragged_dot(m, k, n, g):
    rng = np.random.default_rng(m)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
    total = max(m - 7, 1)                         # rows past the groups must come back as zeros
    sizes = rng.multinomial(total, [1 / g] * g)
    sizes[0] += sizes[1]
    sizes[1] = 0                                  # an empty group
    out = gmm_tpu(lhs, rhs, jnp.asarray(sizes, jnp.int32), interpret=True)
    ref = jax.lax.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32))
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4)
    assert not np.any(np.asarray(out)[total:])


def test_model_moe_on_the_tpu_path_equals_the_reference(monkeypatch):
    c = preset_config("tiny-random")                    # MXFP4 experts: dequantized, then megablox gmm
    params = init_params_numpy(c, 0, jnp.float32)
    layer = next(lp["mlp"] for lp, t in zip(params["layers"], c.mlp_types) if t == "moe")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((80, c.hidden_size)), jnp.float32)
    ref = np.asarray(MoE.of(c, layer)(x, c, backend=detect("reference")))
    calls = []
    import pallas_kernels.moe.tpu as tpu
    real = tpu.gmm_tpu
    monkeypatch.setattr(tpu, "gmm_tpu", lambda *a, **kw: calls.append(kw) or real(*a, **kw))   # a spy
    got = np.asarray(MoE.of(c, layer)(x, c, backend=detect("pallas", platform="tpu")))
    assert calls and all(kw["interpret"] for kw in calls)        # 3 matmuls per MoE layer went to megablox
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
