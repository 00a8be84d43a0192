"""An engine step's bucket padding gets no routed expert: rows past the step's tokens route to an id past
the experts (skipped by every routed-experts path), so a one-sequence decode step reads its token's experts
only; the real rows' outputs are unchanged."""
import jax
import jax.numpy as jnp
import numpy as np

from k3jax import nnx_model
from k3jax.cache import SeqChunk, make_pools, make_step_batch
from k3jax.layer_stack import stack_layers
from k3jax.layers.moe import MoE, RoutedExperts
from k3jax.params import init_params_numpy
from k3jax.presets import preset_config


def _spy(monkeypatch):
    """Record the (ids, weights) every RoutedExperts call gets, scanned layers included."""
    seen = []
    call = RoutedExperts.__call__

    def spy(self, z, weights, ids, c, layer=None, backend=None):
        jax.debug.callback(lambda i, w: seen.append((np.asarray(i), np.asarray(w))), ids, weights)
        return call(self, z, weights, ids, c, layer, backend)
    monkeypatch.setattr(RoutedExperts, "__call__", spy)
    return seen


def test_moe_routes_padding_rows_to_no_expert(monkeypatch):
    c = preset_config("tiny-random")
    params = init_params_numpy(c, 0, jnp.float32)
    layer = next(i for i, t in enumerate(c.mlp_types) if t != "dense")
    moe = MoE.of(c, params["layers"][layer]["mlp"])
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, c.hidden_size)), jnp.float32)
    seen = _spy(monkeypatch)
    whole = moe(x, c)
    part = moe(x, c, real_tokens=jnp.int32(2))
    jax.effects_barrier()
    (ids, w), (ids_p, w_p) = seen
    assert np.array_equal(ids_p[:2], ids[:2]) and np.array_equal(w_p[:2], w[:2])
    assert np.all(ids_p[2:] == c.num_experts) and np.all(w_p[2:] == 0)
    assert np.array_equal(np.asarray(part[:2]), np.asarray(whole[:2]))         # real rows: the same bits
    assert not np.allclose(np.asarray(part[2:]), np.asarray(whole[2:]))        # padding rows: no routed part


def test_one_sequence_decode_step_reads_its_tokens_experts_only(monkeypatch):
    """The model's step (head, scanned and tail layers) passes the step's token count to every MoE: with one
    decode token in a 16-token bucket, each MoE layer routes exactly one row, to k experts."""
    c = preset_config("tiny-random")
    params = stack_layers(init_params_numpy(c, 0, jnp.float32), c)
    model = nnx_model.K3Model(c, params)
    page_size = 16
    pools = make_pools(c, num_pages=4, page_size=page_size, num_slots=2, dtype=jnp.float32)
    batch = make_step_batch([SeqChunk([7], 5, [1], 1, 1)], page_size, num_tokens=16, num_seqs=4, max_pages=2)
    seen = _spy(monkeypatch)
    logits, _ = model(jnp.asarray(batch.tokens), pools, jax.tree_util.tree_map(jnp.asarray, batch))
    jax.effects_barrier()
    moe_layers = sum(t != "dense" for t in c.mlp_types)
    assert len(seen) == moe_layers and logits.shape == (4, c.vocab_size)
    for ids, w in seen:
        routed = ids[ids < c.num_experts]
        assert len(routed) == c.num_experts_per_token and len(set(routed.tolist())) == c.num_experts_per_token
        assert np.all(ids[1:] == c.num_experts) and np.all(w[1:] == 0)
