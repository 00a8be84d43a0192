"""Mesh construction and partition rules: every leaf has a rule, specs fit the mesh, arrays land there."""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax.cache import make_pools, pool_shapes
from k3jax.layer_stack import layer_stack_plan, stack_layers
from k3jax.params import init_params_numpy, param_shapes
from k3jax.presets import preset_config
from sharding import rules
from sharding.mesh import make_mesh, parse_mesh_spec


def _configs():
    tiny = preset_config("tiny-random")
    return {
        "tiny": tiny,
        "tiny-trained": preset_config("tiny"),
        "tiny-bf16-tied": tiny.replace(expert_format="bf16", tie_word_embeddings=True, attn_res_block_size=None),
        "tiny-no-qlora-lowrank-gate": tiny.replace(q_lora_rank=None, kda_full_rank_gate=False, mla_output_gate=False,
                                                   routed_expert_hidden_size=None, latent_moe_norm=False,
                                                   num_shared_experts=0),
        "kimi-linear-48b-a3b": preset_config("kimi-linear-48b-a3b"),
        "kimi-k3": preset_config("kimi-k3"),
    }


# ---- mesh -----------------------------------------------------------------
def test_mesh_axes_and_sizes():
    m = make_mesh("data=2,expert=4")
    assert m.axis_names == ("data", "expert", "tensor")
    assert dict(m.shape) == {"data": 2, "expert": 4, "tensor": 1}
    assert sorted(d.id for d in m.devices.flat) == sorted(d.id for d in jax.devices())
    assert dict(make_mesh({"tensor": 2, "expert": 4}).shape) == {"data": 1, "expert": 4, "tensor": 2}
    assert dict(make_mesh("tensor=2,data=-1").shape) == {"data": 4, "expert": 1, "tensor": 2}
    # default: heads inside the host (8 local devices -> tensor 8)
    assert dict(make_mesh(None).shape) == {"data": 1, "expert": 1, "tensor": 8}
    assert parse_mesh_spec(None, 64, 8) == {"data": 1, "expert": 8, "tensor": 8}
    assert dict(make_mesh("expert=2", devices=jax.devices()[:2]).shape)["expert"] == 2


@pytest.mark.parametrize("spec, msg", [
    ("data=2,expert=2", "product of the axis sizes must equal the device count"),
    ("data=3", "= 3 devices, but 8 are available"),
    ("pipeline=8", "unknown axes"),
    ("data=2,data=4", "given twice"),
    ("data=x", "not an integer"),
    ("data", "axis=size"),
    ("data=-1,expert=-1", "at most one axis"),
    ("data=0,expert=8", "must be >= 1"),
    ("data=-1,expert=3", "not divisible"),
])
def test_mesh_spec_errors(spec, msg):
    with pytest.raises(ValueError, match=msg):
        make_mesh(spec)


# ---- rule coverage ----------------------------------------------------------
@pytest.mark.parametrize("name", list(_configs()))
def test_every_leaf_has_an_explicit_rule(name):
    c = _configs()[name]
    pshapes, poshapes = param_shapes(c), pool_shapes(c, 16, 16, 16)
    shapes = {rules.path_str(p): x.shape for t in (pshapes, poshapes)
              for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
    for mesh in (None, {"data": 2, "expert": 4, "tensor": 1}, {"data": 1, "expert": 4, "tensor": 2}):
        params = rules.explain(pshapes, mesh, config=c)
        pools = rules.explain(poshapes, mesh)
        assert len(params) == len(shapes) - len(pools) and len(params) > 10
        assert [p for p, *_ in pools] == ["mla_kv", "kda_state", "kda_conv"]    # one array per kind
        for path, axes, spec in params + pools:
            assert axes and isinstance(spec, P) and len(spec) == len(shapes[path]), path
        # the scan layout's leaves keep their layer's spec behind a replicated "layers" axis
        by_path = {path: spec for path, _, spec in params}
        plan, scanned = layer_stack_plan(c), 0
        for path, axes, spec in rules.explain(jax.eval_shape(lambda p: stack_layers(p, c), pshapes), mesh, config=c):
            m = re.fullmatch(r"layers\.units\.(\d+)\.(.*)", path)
            if m:
                assert axes[0] == "layers" and spec == P(None, *by_path[f"layers.{plan.layer(0, int(m[1]))}.{m[2]}"])
                scanned += 1
        assert bool(scanned) == bool(plan.repeats)


def test_unknown_logical_axis_and_axes_of_wrong_rank_raise():
    with pytest.raises(ValueError, match="unknown logical axis 'heads_typo'.*add it to sharding.rules.LOGICAL_AXES"):
        rules.logical_spec(("embed", "heads_typo"), (4, 8), {"data": 1, "expert": 1, "tensor": 2}, what="x.w")
    with pytest.raises(ValueError, match="x.w declares logical axes .'embed',. but has shape .4, 8."):
        rules.logical_spec(("embed",), (4, 8), what="x.w")


def test_unmatched_leaf_and_wrong_rank_raise():
    c = preset_config("tiny-random")
    shapes = param_shapes(c)
    shapes["layers"][2]["attn"]["new_proj"] = jax.ShapeDtypeStruct((4, 4), jnp.bfloat16)
    with pytest.raises(KeyError, match="layers.2.attn.new_proj"):
        rules.param_tree_specs(shapes, None, c)
    shapes = param_shapes(c)
    shapes["layers"][2]["attn"]["o_proj"] = jax.ShapeDtypeStruct((4, 4, 4), jnp.bfloat16)
    with pytest.raises(ValueError, match="has shape"):
        rules.param_tree_specs(shapes, None, c)


def test_specs_of_representative_leaves():
    c = preset_config("kimi-k3")
    specs = rules.param_specs(c, {"data": 8, "expert": 8, "tensor": 8})
    L = specs["layers"]
    assert specs["embed"] == P("tensor", None) and specs["lm_head"] == P(None, "tensor")
    assert L[0]["attn"]["q_proj"] == P(None, "tensor") and L[0]["attn"]["o_proj"] == P("tensor", None)
    assert L[0]["attn"]["A_log"] == P("tensor")
    assert L[3]["attn"]["kv_b_proj"] == P(None, "tensor") and L[3]["attn"]["kv_a_proj"] == P(None, None)
    assert L[0]["mlp"]["gate"] == P(None, "tensor") and L[0]["mlp"]["down"] == P("tensor", None)
    e = L[1]["mlp"]["experts"]
    assert e["w1_packed"] == P("expert", "tensor", None) and e["w2_scale"] == P("expert", None, "tensor")
    assert L[1]["mlp"]["router"] == P(None, None) and L[1]["mlp"]["shared"]["down"] == P("tensor", None)
    pools = rules.pool_specs(pool_shapes(c, 128, 64, 64), {"data": 8, "expert": 8, "tensor": 8})
    assert pools.mla_kv == P(("data", "expert"), None, None, None)
    assert pools.kda_state == P(("data", "expert"), None, "tensor", None, None)
    assert pools.kda_conv == P(("data", "expert"), None, None, None)


def test_indivisible_dims_fall_back_with_a_note(caplog):
    c = preset_config("tiny-random")               # 4 KDA/MLA heads, 16 experts, I/32 = 2 MXFP4 blocks
    rules._noted.clear()
    with caplog.at_level(logging.WARNING, logger="sharding.rules"):
        specs = rules.param_specs(c, {"data": 1, "expert": 1, "tensor": 8})
        pspecs = rules.pool_specs(pool_shapes(c, 12, 16, 6), {"data": 2, "expert": 4, "tensor": 1})
    a = specs["layers"][0]["attn"]
    assert a["q_proj"] == P(None, None) and a["A_log"] == P(None)       # 4 heads cannot split 8 ways
    assert specs["layers"][1]["mlp"]["experts"]["w2_packed"] == P("expert", None, None)
    assert specs["embed"] == P("tensor", None)                          # 1024 rows do split
    assert pspecs.mla_kv == P("expert", None, None, None)               # 12 pages: not 8, but 4
    assert pspecs.kda_state == P("data", None, "tensor", None, None)     # 6 slots: only data=2
    text = caplog.text
    assert "heads (4 units) not divisible by tensor=8: replicated" in text
    assert "split over expert=4" in text and "split over data=2" in text
    # head-aligned: 4 heads on tensor=2 split, even though the column count would allow 8
    assert rules.param_specs(c, {"data": 1, "expert": 1, "tensor": 2})["layers"][0]["attn"]["q_proj"] == P(None, "tensor")


def test_shard_params_and_pools_place_arrays():
    c = preset_config("tiny-random")
    mesh = make_mesh("data=2,expert=2,tensor=2")
    params = init_params_numpy(c, 0, jnp.float32)
    sharded = rules.shard_params(params, mesh, c)
    want = rules.param_shardings(c, mesh)
    for (path, x), y, s in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_leaves(sharded),
                               jax.tree_util.tree_leaves(want)):
        assert y.sharding.is_equivalent_to(s, x.ndim), rules.path_str(path)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    e = sharded["layers"][1]["mlp"]["experts"]["w1_packed"]           # [16, 64, 32] -> [8, 32, 32] per device
    assert {sh.data.shape for sh in e.addressable_shards} == {(8, 32, 32)}
    pools = rules.shard_pools(make_pools(c, 8, 16, 8, jnp.float32), mesh)
    assert {sh.data.shape for sh in pools.kda_state.addressable_shards} == {(2, 4, 2, 32, 32)}   # [slots, layers, H, K, V]
    assert {sh.data.shape for sh in pools.mla_kv.addressable_shards} == {(2, 2, 16, c.mla_cache_dim)}
    assert rules.shard_shape((8, 4, 4, 32, 32), rules.pool_specs(pools, mesh).kda_state, mesh) == (2, 4, 2, 32, 32)


@pytest.mark.parametrize("preset", ["tiny-random", "kimi-k3"])
def test_every_vision_parameter_is_declared_replicated(preset):
    from k3jax.vision.config import VisionConfig
    from k3jax.vision.tower import VisionTower
    c = preset_config(preset)
    vc = VisionConfig.from_dict(c.vision, text_hidden_size=c.hidden_size)
    for stacked in (False, True):                                     # per-layer and scanned layouts
        tower = VisionTower(vc, c.hidden_size, stacked=stacked)      # abstract: nothing allocated
        flat = rules.explain(tower, {"data": 2, "expert": 4, "tensor": 2})
        assert len(flat) == len(jax.tree_util.tree_leaves(tower.tree())) > 10
        assert all(len(axes) == len(spec_) and all(d is None for d in spec_) for _, axes, spec_ in flat)
        assert any(path.startswith("blocks.wqkv") if stacked else path.startswith("blocks.0.wqkv") for path, _, _ in flat)


def test_random_init_made_on_the_stacked_shardings(monkeypatch):
    """Random presets are made in the scan layout straight onto the rules' shardings (placed once),
    each leaf from the key the unsharded per-layer init gives it. (Each leaf is filled from its key's
    bits instead of drawn: the subject is where keys and values go; threefry programs cost ~20 s of
    CPU compiles.)"""
    from k3jax import params as params_mod
    monkeypatch.setattr(params_mod, "_init_leaf", lambda leaf, r, dtype, std: jnp.full(
        leaf.shape, (jax.random.key_data(r.key)[0] ^ jax.random.key_data(r.key)[1]) % (1 << 20), jnp.float32))
    c = preset_config("tiny-random")
    mesh = make_mesh("expert=4,tensor=2")
    want_sh = rules.param_shardings(c, mesh, stacked=True)
    made = params_mod.init_params_by_leaf(c, jax.random.key(1), jnp.float32, stacked=True, shardings=want_sh)
    ref = stack_layers(params_mod.init_params_by_leaf(c, jax.random.key(1), jnp.float32), c)
    assert jax.tree_util.tree_structure(made) == jax.tree_util.tree_structure(ref)
    firsts = set()
    for (path, x), y, s in zip(jax.tree_util.tree_flatten_with_path(made)[0], jax.tree_util.tree_leaves(ref),
                               jax.tree_util.tree_leaves(want_sh)):
        assert x.sharding.is_equivalent_to(s, x.ndim), rules.path_str(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=rules.path_str(path))
        firsts.add(float(np.asarray(x).flat[0]))
    assert len(firsts) > 0.9 * len(jax.tree_util.tree_leaves(made))       # leaves got different keys
