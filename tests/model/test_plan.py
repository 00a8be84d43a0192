"""k3jax.plan: per-device figures equal what the sharded arrays really occupy; K3 layouts make sense."""
import collections

import jax
import jax.numpy as jnp
import pytest

from k3jax import plan as planmod
from k3jax.cache import make_pools
from k3jax.params import init_params_numpy
from k3jax.presets import preset_config
from sharding.mesh import make_mesh
from sharding.rules import shard_params, shard_pools


def _bytes_per_device(tree) -> dict:
    out = collections.Counter()
    for a in jax.tree_util.tree_leaves(tree):
        for sh in a.addressable_shards:
            out[sh.device.id] += sh.data.nbytes
    return out


@pytest.mark.parametrize("spec", ["data=2,expert=2,tensor=2", "tensor=8", "expert=8"])
def test_plan_matches_allocated_shards(spec):
    c = preset_config("tiny-random")
    r = planmod.plan(c, spec, memory_gib=1.0, page_size=16, context=100, batch=3)
    mesh = make_mesh(spec)
    params = shard_params(init_params_numpy(c, 0, jnp.bfloat16), mesh, c)
    pools = shard_pools(make_pools(c, r["num_pages"], 16, r["num_slots"], jnp.bfloat16), mesh)
    w = _bytes_per_device(params)
    mla = _bytes_per_device(pools.mla_kv)
    kda = _bytes_per_device([pools.kda_state, pools.kda_conv])
    assert len(w) == 8
    for got, want in ((max(w.values()), r["weights_bytes"]), (max(mla.values()), r["mla_pages_bytes"]),
                      (max(kda.values()), r["kda_states_bytes"])):
        assert abs(got - want) <= 0.05 * want, (spec, got, want)
    assert r["num_pages"] >= 3 * 7 + 1 and r["num_slots"] >= 4          # 3 sequences of 100 tokens
    # replication is accounted for: tensor=8 cannot split the 4 heads, so attention is whole per device
    assert r["total_bytes"] == (r["weights_bytes"] + r["vision_bytes"] + r["mla_pages_bytes"] + r["kda_states_bytes"]
                                + r["activations_bytes"])
    # the tiny tower, placed by the vision rules the way the engine places it, costs what the plan says
    from k3jax import load_model
    from sharding.rules import shard_vision
    from k3jax.vision.tower import stack_blocks, tower_of
    vision = load_model("tiny-random").vision
    for tower in (vision.tower, tower_of(stack_blocks(vision.params), vision.config)):
        v = _bytes_per_device(shard_vision(tower, mesh).tree())
        assert len(v) == 8 and set(v.values()) == {r["vision_bytes"]}


def _routed_bytes(c) -> int:
    """MXFP4 routed experts of all MoE layers: packed nibbles + one scale byte per 32 values."""
    per_matrix = c.moe_intermediate_size * c.expert_hidden
    return sum(1 for t in c.mlp_types if t == "moe") * c.num_experts * 3 * (per_matrix // 2 + per_matrix // 32)


def test_k3_weights_split_over_experts_as_expected():
    c = preset_config("kimi-k3")
    w64 = planmod.weight_bytes(c, {"data": 1, "expert": 64, "tensor": 1})
    w128 = planmod.weight_bytes(c, {"data": 1, "expert": 128, "tensor": 1})
    assert w64 - w128 == _routed_bytes(c) // 128
    from k3jax.info import model_info
    total = model_info(c)["weight_bytes"]
    assert planmod.weight_bytes(c, {"data": 1, "expert": 1, "tensor": 1}) == total
    w = planmod.weight_bytes(c, {"data": 8, "expert": 8, "tensor": 8})
    assert total / 64 < w < total / 8                                   # data replicates, expert*tensor split


def test_k3_layouts_fit_or_say_so(capsys):
    c = preset_config("kimi-k3")
    big = planmod.plan(c, "data=8,expert=64", "h200")                  # dense weights replicated 512 ways
    assert not big["fixed_fits"] and big["max_batch_at_context"] == 0
    assert planmod.main(["--model", "kimi-k3", "--mesh", "data=8,expert=64", "--device", "h200"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    ok = planmod.plan(c, "data=8,expert=8,tensor=8", "h200", page_size=64, context=131072)
    assert ok["fits"] and ok["max_batch_at_context"] > 0 and ok["max_context_at_batch"] >= 131072
    B = ok["max_batch_at_context"]
    assert planmod.plan(c, "data=8,expert=8,tensor=8", "h200", batch=B)["fits"]
    assert not planmod.plan(c, "data=8,expert=8,tensor=8", "h200", batch=B + 1)["fits"]
    assert planmod.main(["--model", "kimi-k3", "--mesh", "data=8,expert=8,tensor=8", "--device", "h200",
                         "--page-size", "64", "--context", "131072"]) == 0
    out = capsys.readouterr().out
    for word in ("weights", "MLA pages", "KDA states", "activations", "headroom", "largest batch", "largest context"):
        assert word in out
    small = planmod.plan(c, "data=8,expert=8,tensor=8", "tpu-v6e")
    assert small["max_batch_at_context"] < B                           # 32 GiB holds fewer sequences


def test_devices_and_errors():
    assert {"h100", "h200", "b200", "tpu-v5p", "tpu-v6e"} <= set(planmod.DEVICES)
    assert planmod.DEVICES["h100"] == 80 and planmod.DEVICES["tpu-v6e"] == 32
    c = preset_config("tiny-random")
    with pytest.raises(ValueError, match="device 'a100'"):
        planmod.plan(c, "expert=2", "a100")
    with pytest.raises(ValueError, match="unknown axes"):
        planmod.plan(c, "pipe=2", "h100")
    with pytest.raises(ValueError, match="axis=size"):
        planmod.plan(c, "data", "h100")
    with pytest.raises(ValueError, match="explicit sizes"):
        planmod.plan(c, "data=-1", "h100")
    # a page size of 0 was a ZeroDivisionError traceback; a negative context a nonsense plan
    for kw, needle in (({"page_size": 0}, "page_size"), ({"context": -1}, "context"), ({"batch": 0}, "batch"),
                       ({"step_tokens": 0}, "step_tokens"), ({"memory_fraction": 1.5}, "memory_fraction"),
                       ({"memory_gib": 0}, "memory_gib"), ({"extra_slots": -1}, "extra_slots")):
        with pytest.raises(ValueError, match=needle):
            planmod.plan(c, "data=2", "h100", **kw)
    assert planmod.main(["--model", "tiny-random", "--mesh", "data=1", "--page-size", "0"]) == 2
    assert planmod.main(["--model", "tiny-random", "--mesh", "data=1", "--mem-fraction", "1.5"]) == 2   # old spelling


def test_defaults_are_the_engines():
    """plan's page size, memory fraction and largest step are the engine's defaults (EngineArgs on an
    accelerator), and its budget is the engine's: the allocator's share, then memory_fraction of what the
    weights and activations leave for the cache."""
    import inspect
    from serving.engine_args import ACCELERATOR_BATCH_DEFAULTS, ALLOCATOR_MEMORY_FRACTION, EngineArgs
    kw = inspect.signature(planmod.plan).parameters
    a = EngineArgs()
    assert (kw["page_size"].default, kw["memory_fraction"].default) == (a.page_size, a.memory_fraction)
    assert kw["step_tokens"].default == ACCELERATOR_BATCH_DEFAULTS[1]
    c = preset_config("tiny-random")
    r = planmod.plan(c, "data=1", memory_gib=0.25, context=64)
    assert r["budget_bytes"] == int(0.25 * 2**30 * ALLOCATOR_MEMORY_FRACTION)
    left = r["budget_bytes"] - r["weights_bytes"] - r["vision_bytes"] - r["activations_bytes"]
    assert r["cache_budget_bytes"] == int(left * a.memory_fraction)
    assert r["fits"] and r["mla_pages_bytes"] + r["kda_states_bytes"] <= r["cache_budget_bytes"]
    more = planmod.plan(c, "data=1", memory_gib=0.25, context=64, batch=r["max_batch_at_context"] + 1)
    assert more["mla_pages_bytes"] + more["kda_states_bytes"] > more["cache_budget_bytes"] and not more["fits"]
