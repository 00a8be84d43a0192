"""k3jax.expert_layout: the routed experts' merged gate/up serving layout (what load_model holds on one
device running the MoE kernels with merged_experts=True): the model's graph takes it, the MoE layer gives the checkpoint
layout's output with the kernels (interpret mode) and the reference ops, checkpoints get w1 / w3 back."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from k3jax.expert_layout import experts_merged, merge_gate_up, split_gate_up
from k3jax.layer_stack import stack_layers
from k3jax.params import init_params_numpy, moe_spec
from k3jax.presets import preset_config
from pallas_kernels.backend import detect

pytestmark = pytest.mark.interpret


@pytest.fixture(scope="module")
def tiny():
    c = preset_config("tiny-random")
    return c, init_params_numpy(c, 0, jnp.float32)


def test_merge_round_trips_and_the_graph_takes_it(tiny):
    from k3jax.nnx_model import graph_for
    c, params = tiny
    stacked = stack_layers(params, c)
    merged = merge_gate_up(stacked)
    assert experts_merged(merged) and not experts_merged(stacked)
    assert set(merged["layers"]["units"][0]["mlp"]["experts"]) >= {"w13_packed", "w13_scale", "w2_packed"}
    jax.tree_util.tree_map(np.testing.assert_array_equal, split_gate_up(merged), stacked)
    graph_for(c, merged).merge(merged)          # the merged spec's shapes are the arrays'


@pytest.mark.parametrize("mode", ["reference", "pallas"])
def test_moe_layer_on_merged_experts_matches_the_checkpoint_layout(tiny, mode):
    """The first MoE layer (MXFP4 experts) at 48 tokens, merged vs the checkpoint's w1 / w3 on the
    reference ops; "pallas": the fused kernels read w13 (decode tiles: few rows per expert)."""
    from k3jax.layers.moe import MoE
    c, params = tiny
    lp = params["layers"][c.mlp_types.index("moe")]["mlp"]
    x = jnp.asarray(np.random.RandomState(1).standard_normal((48, c.hidden_size)), jnp.float32)
    ref = MoE.of(c, lp)(x, c, backend=detect("reference"))
    merged = MoE.of(c, merge_gate_up({"mlp": lp})["mlp"])
    assert merged.experts.merged and set(merged.experts.spec()) == set(moe_spec(c, merged_experts=True)["experts"])
    got = merged(x, c, backend=detect(mode))
    ref, got = np.asarray(ref), np.asarray(got)
    assert np.abs(got - ref).max() <= (0 if mode == "reference" else 5e-3) * np.abs(ref).max()
