"""The compiled engine step holds no copy of a cache pool: the scanned decoder updates the stacked pools in
place (the first scanned version was reverted for pool/weight-sized copies around its kernels on the H200).

CPU, abstract weights; float32 pools, and bf16 pools stored as uint16 bits as the CPU runner stores them
(XLA:CPU converted bf16 pools to f32 for every scatter and for the reference attention's looped gathers:
pallas_kernels/scatter.py). Pools are sized
so that each is far larger than any activation of the step: a data move of pool size can only be a pool.
"""
import jax
import jax.numpy as jnp
import pytest

from k3jax import hlo_stats
from k3jax.cache import SeqChunk, make_step_batch, pool_shapes
from k3jax.layer_stack import stack_layers
from k3jax.nnx_model import make_step
from k3jax.params import param_shapes
from k3jax.presets import preset_config
from tests.support.tiers import slow_case


def step_batches(page_size: int, context: int = 1024, decode_seqs: int = 16, prefill=(2, 2048)):
    """{name: StepBatch}: a decode step (decode_seqs sequences, one token each after `context`) and a
    prefill step (prefill[0] fresh sequences of prefill[1] tokens), on distinct pages and slots."""
    pages_per = -(-(context + 1) // page_size)
    dec = [SeqChunk([1], context, list(range(1 + i * pages_per, 1 + (i + 1) * pages_per)), 1 + i, 1 + i)
           for i in range(decode_seqs)]
    n, L = prefill
    pp = -(-L // page_size)
    pre = [SeqChunk([1] * L, 0, list(range(1 + i * pp, 1 + (i + 1) * pp)), -1, 1 + i) for i in range(n)]
    max_pages = max(pages_per, pp)
    return {"decode": make_step_batch(dec, page_size, num_seqs=decode_seqs, max_pages=max_pages),
            "prefill": make_step_batch(pre, page_size, num_tokens=n * L, num_seqs=max(4, n), max_pages=max_pages)}


@pytest.fixture(scope="module", params=[slow_case("float32"), "bfloat16-bits"])
def compiled_steps(request):
    c = preset_config("tiny-random")
    dtype = jnp.float32 if request.param == "float32" else jnp.bfloat16
    params = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, dtype))
    scale = 4 // jnp.dtype(dtype).itemsize             # the same pool bytes for both dtypes
    pools = pool_shapes(c, 4096 * scale + 1, 16, 512 * scale + 2, dtype, bits=request.param.endswith("bits"))
    step = jax.jit(make_step(c), donate_argnums=(1,))
    batches = step_batches(16, context=64, prefill=(2, 64))
    # steps of one sequence (max_num_seqs=1, e.g. k3jax.generate): XLA turns one-row gathers / scatters into
    # dynamic slices and selects, which copied every pool (pallas_kernels/scatter.py)
    batches["decode-1seq"] = step_batches(16, context=64, decode_seqs=1)["decode"]
    batches["prefill-1seq"] = make_step_batch([SeqChunk([1] * 20, 0, [1, 2], -1, 1)], 16, num_tokens=32,
                                              num_seqs=1, max_pages=5)
    smallest = min(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(pools))
    return (lambda kind: step.lower(params, pools, batches[kind]).compile()), smallest


# the prefill steps in the slow tier (CI's time budget: each compile is ~13 s on 2 cores)
@pytest.mark.parametrize("kind", ["decode", slow_case("prefill"), "decode-1seq", slow_case("prefill-1seq")])
def test_scanned_step_holds_no_pool_sized_copy(compiled_steps, kind):
    compile_step, smallest = compiled_steps
    compiled = compile_step(kind)
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
