"""The NNX model (k3jax/nnx_model.py): module tree, logical axes, functional split / merge."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import nnx_model
from k3jax.layer_stack import layer_stack_plan, stack_layers, unstack_layers
from k3jax.layers.module import matmul, read, repeat, value
from k3jax.params import init_params_numpy, is_leaf, param_spec, tree_parameter_count
from k3jax.presets import preset_config, preset_names
from sharding import rules


@pytest.fixture(scope="module")
def tiny():
    c = preset_config("tiny-random")
    return c, init_params_numpy(c, 0, jnp.float32)


def test_merged_model_traces_the_functional_core(tiny):
    """The model merged from (graph, params) inside a trace runs exactly the functional forward."""
    c, params = tiny
    params = stack_layers(params, c)
    graph, flat = nnx_model.split_model(nnx_model.K3Model(c, params))
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(flat), jax.tree_util.tree_leaves(params)))
    toks = (np.arange(10, dtype=np.int32).reshape(2, 5) * 37) % c.vocab_size
    merged = jax.make_jaxpr(lambda p, t: graph.merge(p)(t))(flat, toks)
    direct = jax.make_jaxpr(lambda p, t: nnx_model.K3Model(c, p)(t))(params, toks)
    assert str(merged) == str(direct)
    # the graph made from abstract parameters merges real ones the same way
    assert str(jax.make_jaxpr(lambda p, t: nnx_model.graph_for(c, p).merge(p)(t))(params, toks)) == str(direct)
    with pytest.raises(ValueError, match="parameter arrays for a model graph"):
        graph.merge({"embed": params["embed"]})
    # the checkpoint layout is stacked into the one model layout (the same program)
    assert str(jax.make_jaxpr(lambda p, t: nnx_model.K3Model(c, p)(t))(stack_layers(params, c), toks)) == str(direct)


def test_the_repeating_unit_is_one_block_run_by_one_scan(tiny):
    """The (KDA, KDA, ..) unit is one DecoderBlock whose parameters are stacked over the repeats,
    and the forward holds one scan whose body runs the whole unit."""
    c, params = tiny
    plan = layer_stack_plan(c)
    model = nnx_model.K3Model(c, params)
    block = model.layers.units
    assert isinstance(block, nnx_model.DecoderBlock) and len(block) == plan.unit
    assert block.kinds == tuple(c.layer_types[plan.layer(0, j)] for j in range(plan.unit))
    for j, layer in enumerate(block):
        assert value(layer.input_norm).shape == (plan.repeats, c.hidden_size)
        np.testing.assert_array_equal(value(layer.input_norm)[1], params["layers"][plan.layer(1, j)]["input_norm"])
    assert model.layers[plan.layer(1, 1)] is block[1] and model.layers[0] is model.layers.head[0]
    toks = np.zeros((1, 5), np.int32)
    jaxpr = jax.make_jaxpr(lambda t: model(t))(toks)
    # (the head's KDA layers scan over their 5 tokens; the block over its repeats)
    scans = [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert plan.repeats > 1 and scans.count(plan.repeats) == 1 and set(scans) == {5, plan.repeats}, scans


def test_stacked_parameters_read_the_current_repeat(tiny):
    """A scanned layer reads its parameters out of the block's stacks at the repeat its block's call made
    current (module.read / matmul); outside a repeat, a stacked parameter refuses to be read, an unscanned
    layer's reads as it is."""
    c, params = tiny
    plan = layer_stack_plan(c)
    model = nnx_model.K3Model(c, params)
    q = model.layers.units[0].attn.q_proj
    x = np.random.RandomState(0).randn(3, c.hidden_size).astype(np.float32)
    for r in range(plan.repeats):
        want = params["layers"][plan.layer(r, 0)]["attn"]["q_proj"]
        with repeat(jnp.int32(r), None):
            np.testing.assert_array_equal(read(q), want)
            np.testing.assert_array_equal(matmul(x, q), x @ want)
    with pytest.raises(ValueError, match="outside a repeat"):
        read(q)
    head = model.layers.head[0].input_norm
    np.testing.assert_array_equal(read(head), params["layers"][0]["input_norm"])


def test_runner_step_traces_the_functional_step(tiny):
    """The engine's step body (merge inside the trace, then the module's step) is the same program
    as the model called on the parameter dict."""
    from k3jax.cache import make_pools
    from pallas_kernels.backend import detect
    from serving.step_shapes import padding_step_args
    c, params = tiny
    params = stack_layers(params, c)
    backend = detect("reference")
    pools = make_pools(c, 5, 16, 4, jnp.float32)
    batch, _, _ = padding_step_args(c, 16, 4, 32, 2, False, False, np.float32)
    graph, flat = nnx_model.split_model(nnx_model.K3Model(c, params))
    merged = jax.make_jaxpr(nnx_model.make_step(c, backend, graph))(flat, pools, batch)
    call = lambda p, po, b: nnx_model.K3Model(c, p)(b.tokens, po, b, backend=backend)  # noqa: E731
    direct = jax.make_jaxpr(call)(params, pools, batch)
    assert str(merged) == str(direct)


def test_variants_are_fixed_from_the_config(tiny):
    """Each module's variant flags come from the config; parameters of another variant are refused
    by name when the model is built (not a KeyError deep inside a traced step)."""
    c, params = tiny
    layer = nnx_model.K3Model(c, params).layers[c.mla_layers[0]]
    assert (layer.attn.low_rank_q, layer.attn.output_gate) == (bool(c.q_lora_rank), c.mla_output_gate)
    moe = nnx_model.K3Model(c, params).layers[c.mlp_types.index("moe")].mlp
    assert moe.experts.mxfp4 == (c.expert_format == "mxfp4") and moe.latent == bool(c.routed_expert_hidden_size)
    other = c.replace(kda_full_rank_gate=not c.kda_full_rank_gate, q_lora_rank=None)
    kda = nnx_model.K3Model(other, init_params_numpy(other, 0, jnp.float32)).layers[other.kda_layers[0]].attn
    assert kda.full_rank_gate == other.kda_full_rank_gate
    with pytest.raises(ValueError, match="KDA: no parameter"):
        nnx_model.K3Model(other, params)


def test_module_tree_types_and_counts(tiny):
    c, params = tiny
    model = nnx_model.K3Model(c, stack_layers(params, c))
    rows = nnx_model.summary(model)
    assert [r["attention"] for r in rows] == [t.upper() for t in c.layer_types]
    assert [r["mlp"] for r in rows] == ["DenseMLP" if t == "dense" else "MoE" for t in c.mlp_types]
    plan = layer_stack_plan(c)
    assert [r["scanned"] for r in rows] == [plan.start <= i < plan.stop for i in range(c.num_layers)]
    from k3jax.info import model_info
    outside = tree_parameter_count({k: v for k, v in params.items() if k != "layers"})
    assert sum(r["params"] for r in rows) + outside == model_info(c)["total_params"]
    assert rows[1]["params"] > rows[0]["params"] > 0                    # MoE layer > dense layer
    assert isinstance(model.layers.units[0].mlp.experts, nnx_model.RoutedExperts)
    q = model.layers.units[0].attn.q_proj
    assert isinstance(q, nnx.Param) and q.logical_axes == ("layers", "embed", "kda_heads")


@pytest.mark.parametrize("preset", preset_names())
def test_logical_axes_resolve_for_every_parameter(preset):
    """Every parameter of every preset, as an abstract NNX model (nothing allocated), has logical
    axes the rules resolve on a mesh, to the specs param_specs gives for that layout."""
    c = preset_config(preset)
    mesh = {"data": 2, "expert": 4, "tensor": 8}
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    for stacked in (False, True):       # the model stacks a checkpoint-layout tree into its one layout
        abstract = jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.bfloat16),
                                          param_spec(c, stacked=stacked), is_leaf=is_leaf)
        model = nnx_model.K3Model(c, abstract)
        axes = nnx_model.logical_axes(model)
        shapes = {path: p.shape for path, p in nnx_model.named_params(model).items()}
        assert len(shapes) == len(jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
        want = {rules.path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
            rules.param_specs(c, mesh, stacked=True), is_leaf=is_spec)[0]}
        assert axes.keys() == want.keys() and len(want) > 10
        for path, names in axes.items():
            assert rules.logical_spec(names, shapes[path], mesh, rules.axis_units(c), path) == want[path], path
    # the checkpoint layout's specs are the model's, one layer per repeat (the "layers" axis dropped)
    unstacked = unstack_layers(rules.param_specs(c, mesh, stacked=True), c,
                               take=lambda s, r: jax.sharding.PartitionSpec(*s[1:]), is_leaf=is_spec)
    assert unstacked == rules.param_specs(c, mesh, stacked=False)


def test_runner_splits_once_and_merges_only_while_tracing(monkeypatch):
    from serving import runner as runner_mod
    from serving.runner import ModelRunner
    counts = {"split": 0, "merge": 0}
    split, merge = runner_mod.split_model, nnx_model.ModelGraph.merge

    def counted_split(model):
        counts["split"] += 1
        return split(model)

    def counted_merge(self, params):
        counts["merge"] += 1
        return merge(self, params)
    monkeypatch.setattr(runner_mod, "split_model", counted_split)
    monkeypatch.setattr(nnx_model.ModelGraph, "merge", counted_merge)
    c = preset_config("tiny-random")
    runner = ModelRunner(c, init_params_numpy(c, 0, jnp.float32), num_pages=9, num_slots=4, page_size=16,
                         max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
    assert counts["split"] == 1
    assert type(runner.params) is dict                  # the jitted step gets plain arrays, no nnx objects
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(runner.params))
    for _ in range(3):
        runner._run_padding(32, 2, decode=False)
    assert counts == {"split": 1, "merge": 1}           # one trace, three steps


def test_modules_declare_their_parameters():
    """The model's own __init__ makes its parameters: random ones from nnx.Rngs (each of the declared
    shape, dtype and logical axes, norms near one), abstract ones without rngs or under
    nnx.eval_shape, and the spec the loaders and rules read is exactly those declarations."""
    c = preset_config("tiny-random")
    spec = param_spec(c, stacked=True)
    model = nnx_model.K3Model(c, dtype=jnp.float32, rngs=nnx.Rngs(3))
    abstract = nnx_model.K3Model(c, dtype=jnp.float32)
    traced = nnx.eval_shape(lambda: nnx_model.K3Model(c, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    flat_spec = jax.tree_util.tree_leaves(spec, is_leaf=is_leaf)
    for m in (model, abstract, traced):
        assert m.spec() == spec
    for leaf, x, a, t in zip(flat_spec, *(jax.tree_util.tree_leaves(m.tree()) for m in (model, abstract, traced))):
        assert isinstance(x, jax.Array) and x.shape == a.shape == t.shape == leaf.shape
        assert x.dtype == a.dtype == t.dtype == leaf.dtype(jnp.float32)
    norms = [x for leaf, x in zip(flat_spec, jax.tree_util.tree_leaves(model.tree())) if leaf.kind == "norm"]
    assert all(0.5 < float(jnp.mean(x)) < 1.5 for x in norms)
    assert len({float(jnp.sum(x)) for x in jax.tree_util.tree_leaves(model.tree())}) > len(flat_spec) // 2
    # a scanned unit's repeats are drawn separately, not one draw repeated
    q = value(model.layers.units[0].attn.q_proj)
    assert model.layers.units[0].attn.q_proj.logical_axes[0] == "layers" and not np.array_equal(q[0], q[1])
    # (under nnx.jit: one compile, where eager dispatch compiles every op of the forward on its own)
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.arange(6, dtype=jnp.int32).reshape(1, 6))
    assert logits.shape == (1, 6, c.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))
    with pytest.raises(ValueError, match="without cache"):
        model(jnp.zeros((1, 2), jnp.int32), metadata=object())


def test_random_init_follows_the_declared_initializers():
    """init_params_numpy (tiny-random's weights) draws each declared parameter from its module's
    initializer kind: fp32 kinds are fp32, MXFP4 bytes uint8 within their ranges."""
    c = preset_config("tiny-random")
    params = init_params_numpy(c, 0, jnp.bfloat16)
    spec = param_spec(c)
    for leaf, x in zip(jax.tree_util.tree_leaves(spec, is_leaf=is_leaf), jax.tree_util.tree_leaves(params)):
        assert x.shape == leaf.shape and x.dtype == leaf.dtype(jnp.bfloat16), leaf
        if leaf.kind == "mx_scale":
            assert 121 <= int(x.min()) and int(x.max()) <= 123
        if leaf.kind == "A_log":
            assert float(x.min()) >= 0.0 and float(x.max()) <= np.log(16.0) + 1e-6
