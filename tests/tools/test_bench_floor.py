"""benchmarks/bench_e2e.py's decode floor split by part (profile_step's part table): every weight counted once,
routed experts at their touched share, states under KDA and the cache under MLA."""
import jax
import pytest

from benchmarks import bench_e2e as bench


@pytest.mark.parametrize("concurrency", [1, 64])
def test_floor_parts_add_up_to_the_floor(concurrency):
    from k3jax.api import load_model
    model = load_model("tiny-random", dtype="bfloat16", seed=0)
    c = model.config
    parts = bench.floor_parts(model, concurrency, 300)
    fb = bench.floor_bytes(c, concurrency, 300)
    leaves = jax.tree_util.tree_leaves(model.params)
    every = sum(x.size * x.dtype.itemsize for x in leaves)
    experts = sum(x.size * x.dtype.itemsize for p, x in jax.tree_util.tree_flatten_with_path(model.params)[0]
                  if "experts" in jax.tree_util.keystr(p))
    untied_embed = model.params["embed"].size * 2 if "lm_head" in model.params else 0
    share = fb["touched"] / c.num_experts
    weights = every - untied_embed - experts * (1 - share)
    assert sum(parts.values()) == pytest.approx(weights + fb["states"] + fb["cache"], rel=1e-9)
    assert parts["routed experts"] == pytest.approx(experts * share, rel=1e-9)
    assert parts["KDA"] > fb["states"] and parts["MLA"] > fb["cache"] and parts["other"] > 0
    # the config-based total floor agrees with the parameter walk to within the fp32 leaves (router, gates)
    assert sum(parts.values()) == pytest.approx(sum(v for k, v in fb.items() if k != "touched"), rel=0.01)


def test_part_of_names_the_scopes():
    assert bench.part_of("jit(run)/model/while/body/kda_in/dot_general") == "KDA"
    assert bench.part_of("jit(run)/model/mla_attn/custom_call") == "MLA"
    assert bench.part_of("jit(run)/model/moe_experts/pallas_call") == "routed experts"
    assert bench.part_of("jit(sample)/argmax") == "other"
