"""The scanned decoder: which layers it stacks, that the stacked layout round-trips, that scan and
layers one at a time give the same logits, and that the traced program stops growing with depth."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from k3jax.layer_stack import LayerStackPlan, layer_stack_plan, stack_layers, unstack_layers
from k3jax.layers.common import rms_norm
from k3jax.layers.decoder import DecoderLayer, blocks_before, num_sources
from k3jax.layers.module import value
from k3jax.model import K3Model
from k3jax.params import init_params_numpy, param_shapes
from k3jax.presets import preset_config
from pallas_kernels.backend import detect


def test_plans_of_the_presets():
    # K3: dense layer 0 and the (KDA, KDA, MLA, MLA) ending unrolled; 22 x (K, K, M, K) from layer 1.
    assert layer_stack_plan(preset_config("kimi-k3")) == LayerStackPlan(1, 4, 22, 93)
    assert layer_stack_plan(preset_config("kimi-linear-48b-a3b")) == LayerStackPlan(1, 4, 6, 27)
    p = layer_stack_plan(preset_config("tiny-random"))            # K K K M K M, AttnRes: layer 0 unrolled
    assert p == LayerStackPlan(2, 2, 2, 6) and list(p.head) == [0, 1] and list(p.tail) == []


def test_stack_unstack_round_trip():
    c = preset_config("tiny-random")
    params = init_params_numpy(c, 0, jnp.float32)
    st = stack_layers(params, c)
    assert st["layers"]["units"][0]["attn"]["q_proj"].shape == (2,) + params["layers"][2]["attn"]["q_proj"].shape
    np.testing.assert_array_equal(st["layers"]["units"][1]["mlp"]["router"][1], params["layers"][5]["mlp"]["router"])
    assert stack_layers(st, c) is st
    owned = init_params_numpy(c, 0, jnp.float32)
    st2 = stack_layers(owned, c, donate=True)                  # load_model's path: sources freed
    assert owned["layers"][2]["attn"]["q_proj"].is_deleted() and not owned["layers"][0]["attn"]["q_proj"].is_deleted()
    np.testing.assert_array_equal(st2["layers"]["units"][0]["attn"]["q_proj"], st["layers"]["units"][0]["attn"]["q_proj"])
    back = unstack_layers(st, c)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _unrolled_logits(params, c, tokens):
    """The decoder one layer at a time, each DecoderLayer over its own checkpoint dict (no stacking,
    no scan): the reference the scanned block must match."""
    b = detect("reference")
    model = K3Model(c, params)                    # embedding, final norm, output mixing, LM head
    h0 = model.embed_tokens(tokens)
    B, eps = c.attn_res_block_size, c.rms_norm_eps
    stream = jnp.zeros((num_sources(c),) + h0.shape, h0.dtype).at[0].set(h0) if B else h0
    for i, values in enumerate(params["layers"]):
        layer = DecoderLayer.of(c, values, index=i)
        stream, _ = layer(c, i, stream, None, lambda m, x, ch: (m.full(x, c, b), ch), b)
    if B:
        stream = model.output_attn_res(stream, blocks_before(c.num_layers, B), eps)
    return model.lm_logits(rms_norm(stream, value(model.final_norm), eps))


@pytest.mark.parametrize("variant", [{}, dict(attn_res_block_size=None, hidden_act="silu")], ids=["k3", "no-attnres"])
def test_scan_equals_unrolled(variant):
    c = preset_config("tiny-random").replace(**variant)
    params = init_params_numpy(c, 2, jnp.float32)
    tokens = np.random.RandomState(1).randint(0, c.vocab_size, (2, 21)).astype(np.int32)
    scanned = jax.jit(lambda p, t: K3Model(c, p)(t, backend=detect("reference")))(stack_layers(params, c), tokens)
    unrolled = jax.jit(lambda p, t: _unrolled_logits(p, c, t))(params, tokens)
    # fp32: the scan's masked AttnRes softmax and fusions round differently, nothing more
    assert _rel(scanned, unrolled) <= 1e-4
    assert _rel(scanned, unrolled[::-1]) > 0.1                   # (the comparison sees the inputs)


def _deep(layers: int):
    """The tiny config at K3's layout: dense layer 0, (K, K, K, M) repeated, MLA last."""
    types = tuple("mla" if i % 4 == 3 or i == layers - 1 else "kda" for i in range(layers))
    return preset_config("tiny-random").replace(num_layers=layers, layer_types=types,
                                         mlp_types=("dense",) + ("moe",) * (layers - 1), attn_res_block_size=12)


def test_traced_program_does_not_grow_with_depth():
    def eqns(layers):
        c = _deep(layers)
        shapes = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, jnp.float32))
        jaxpr = jax.make_jaxpr(lambda p, t: K3Model(c, p)(t))(shapes, jax.ShapeDtypeStruct((1, 8), jnp.int32))
        return len(jaxpr.jaxpr.eqns)
    small, k3_depth = eqns(29), eqns(93)
    assert layer_stack_plan(_deep(93)).repeats == 22
    assert k3_depth == small, (small, k3_depth)


def test_loaded_model_holds_the_scan_layout_and_shows_each_layer():
    from k3jax.api import load_model
    from k3jax.presets import TINY_SEED
    m = load_model("tiny-random", dtype="float32")
    assert set(m.params["layers"]) == {"head", "units", "tail"}
    want = init_params_numpy(m.config, TINY_SEED, jnp.float32)["layers"][3]
    got = m.layer_params(3)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    np.testing.assert_array_equal(got["attn"]["kv_b_proj"], want["attn"]["kv_b_proj"])
