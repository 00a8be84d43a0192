"""The compiled engine step holds no copy of a cache pool: the scanned decoder updates the stacked pools in
place (the first scanned version was reverted for pool/weight-sized copies around its kernels on the H200).

CPU, abstract weights, float32 pools (XLA:CPU converts bf16 pools for any scatter, which GPUs do not; the
bf16 layout's copies are measured on the GPU by scripts/scan_copies.py). Pools are sized so that each
is far larger than any activation of the step: a data move of pool size can only be a pool.
"""
import jax
import jax.numpy as jnp
import pytest

from k3jax import hlo_stats
from k3jax.cache import pool_shapes
from k3jax.layer_stack import stack_layers
from k3jax.params import param_shapes
from k3jax.presets import preset_config
from scripts_module import load_script
from serving.runner import make_step_fn


@pytest.fixture(scope="module")
def compiled_steps():
    c = preset_config("tiny-random")
    params = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, jnp.float32))
    pools = pool_shapes(c, 4097, 16, 514, jnp.float32)
    step = jax.jit(make_step_fn(c), donate_argnums=(1,))
    batches = load_script("scan_copies").step_batches(16, context=64, prefill=(2, 64))
    smallest = min(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(pools))
    return {k: step.lower(params, pools, b).compile() for k, b in batches.items()}, smallest


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_scanned_step_holds_no_pool_sized_copy(compiled_steps, kind):
    steps, smallest = compiled_steps
    compiled = steps[kind]
    text = compiled.as_text()
    assert " while(" in text                                  # the layers did run as a loop
    assert hlo_stats.data_moves(text, smallest) == []
    assert compiled.memory_analysis().temp_size_in_bytes < smallest


def test_data_moves_sees_a_pool_copy():
    """The detector itself: a step that keeps the old pool alive next to the new one needs a copy."""
    pool = jax.ShapeDtypeStruct((4096, 256), jnp.float32)
    f = jax.jit(lambda p, i: (p.at[i].set(1.0), p.sum()), donate_argnums=(0,))
    text = f.lower(pool, jax.ShapeDtypeStruct((4,), jnp.int32)).compile().as_text()
    moves = hlo_stats.data_moves(text, 4096 * 256 * 4)
    assert moves and moves[0].nbytes == 4096 * 256 * 4
