"""K3-only features (AttnRes, SiTU, latent MoE + norm, safe gate, full-rank gate, MLA output gate,
MXFP4 experts) and the Kimi Linear variants, against the independent float64 numpy model."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.support import numpy_model
from k3jax.layer_stack import stack_layers
from k3jax.model import K3Model
from k3jax.params import init_params_numpy
from k3jax.presets import preset_config
from tests.support.tiers import slow_case

VARIANTS = {
    "k3-all-features": {},
    "k3-bf16-experts": dict(expert_format="bf16"),
    "kimi-linear-style": dict(attn_res_block_size=None, hidden_act="silu", gate_lower_bound=None,
                              kda_full_rank_gate=False, mla_output_gate=False, q_lora_rank=None,
                              routed_expert_hidden_size=None, latent_moe_norm=False, expert_format="bf16",
                              routed_scaling_factor=2.446),
    "attnres-block-3-no-linear-beta": dict(attn_res_block_size=3, situ_linear_beta=None),
}
GROUPED = dict(num_expert_group=4, topk_group=2)


def _config(name):
    return preset_config("tiny-random").replace(**VARIANTS[name])


@pytest.mark.parametrize("name", [slow_case(n) if n in ("k3-bf16-experts", "attnres-block-3-no-linear-beta") else n
                                  for n in VARIANTS])
def test_fp32_forward_matches_float64_numpy(name):
    c = _config(name)
    params = init_params_numpy(c, 3, jnp.float32)
    tokens = np.random.RandomState(4).randint(0, c.vocab_size, 70).astype(np.int32)
    ours = np.asarray(jax.jit(lambda p, t: K3Model(c, p)(t))(stack_layers(params, c), tokens[None]))[0]
    ref = numpy_model.forward(jax.device_get(params), c, tokens)
    per_token = np.abs(ours - ref).max(-1) / np.abs(ref).max()
    # fp32 rounding, amplified by softmaxes on a few tokens; the float64 test below is the tight one.
    assert np.median(per_token) <= 5e-5 and per_token.max() <= 5e-3, per_token


@pytest.fixture(scope="module")
def float64_run():
    c = _config("k3-all-features")
    tokens = np.random.RandomState(5).randint(0, c.vocab_size, 40).astype(np.int32)
    with jax.enable_x64(True):
        params = init_params_numpy(c, 6, jnp.float64)
        ours = np.asarray(jax.jit(lambda p, t: K3Model(c, p)(t))(stack_layers(params, c),
                                                                      jnp.asarray(tokens[None])))[0]
    assert ours.dtype == np.float64
    return c, jax.device_get(params), tokens, ours


def test_float64_forward_is_tight(float64_run):
    """In float64 the two implementations agree to ~1e-12: catches eps / scale slips that fp32 hides."""
    c, params, tokens, ours = float64_run
    ref = numpy_model.forward(params, c, tokens)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= 1e-9, err


@pytest.mark.parametrize("change", [dict(rms_norm_eps=1e-4), dict(situ_beta=4.5), dict(gate_lower_bound=-4.0)])
def test_float64_comparison_can_fail(float64_run, change):
    """A slightly wrong eps, SiTU beta or gate bound in the reference is detected."""
    c, params, tokens, ours = float64_run
    ref = numpy_model.forward(params, c.replace(**change), tokens)
    assert np.abs(ours - ref).max() / np.abs(ref).max() > 1e-7


def test_group_limited_routing_float64():
    """Grouped routing (DeepSeek-style group limit) against the numpy reference, in float64: in
    fp32 a near-tie between two groups' scores can flip a group and the comparison with it."""
    c = preset_config("tiny-random").replace(**GROUPED)
    tokens = np.random.RandomState(7).randint(0, c.vocab_size, 40).astype(np.int32)
    with jax.enable_x64(True):
        params = init_params_numpy(c, 8, jnp.float64)
        ours = np.asarray(jax.jit(lambda p, t: K3Model(c, p)(t))(params, jnp.asarray(tokens[None])))[0]
    params = jax.device_get(params)
    ref = numpy_model.forward(params, c, tokens)
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-9
    ungrouped = numpy_model.forward(params, c.replace(num_expert_group=1, topk_group=1), tokens)
    assert np.abs(ours - ungrouped).max() / np.abs(ref).max() > 1e-3   # the limit mattered here


def test_group_limited_routing_changes_the_choice():
    """The grouped test above tests something: with these sizes the group limit changes picks."""
    c = preset_config("tiny-random").replace(**GROUPED)
    rng = np.random.RandomState(0)
    choices = rng.randn(64, c.num_experts)
    grouped = [set(numpy_model.routed_experts(ch, c)) for ch in choices]
    free = [set(numpy_model.routed_experts(ch, c.replace(num_expert_group=1))) for ch in choices]
    assert sum(g != f for g, f in zip(grouped, free)) > 10
    per = c.num_experts // c.num_expert_group
    assert all(len({e // per for e in g}) <= c.topk_group for g in grouped)
