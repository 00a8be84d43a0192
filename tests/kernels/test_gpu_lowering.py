"""The tiny presets' engine steps lower for CUDA on the GPU kernels, without a GPU (jax lowers for another
platform; the kernels pick the GPU path when jax's default backend says "gpu"). Triton's blocks must be powers
of two wide: a kernel that loads a block of another width fails here as it fails on the GPU (the trained
tiny's 48-wide MLA nope once did, in the expanded form's kernel)."""
import numpy as np

import jax
import jax.numpy as jnp

from k3jax.cache import SeqChunk, make_pools, make_step_batch
from k3jax.layer_stack import stack_layers
from k3jax.nnx_model import make_step
from k3jax.params import param_shapes
from k3jax.presets import preset_config
from pallas_kernels.backend import Backend

PAGES = list(range(1, 40))
STEPS = {  # a fresh 512-token prompt (the expanded form), a chunk over cached pages, a decode row
    "prefill": ([SeqChunk([1] * 512, 0, PAGES[:32], -1, 1)], 512),
    "chunk": ([SeqChunk([1] * 88, 512, PAGES[:38], 1, 1)], 128),
    "decode": ([SeqChunk([1], 599, PAGES[:38], 1, 1)], 8),
}


def test_trained_tiny_steps_lower_for_cuda_on_the_kernels(traced_as_gpu):
    """(the trained tiny: its head widths are the ones that are not all powers of two)"""
    c = preset_config("tiny")
    params = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, jnp.bfloat16))
    pools = jax.eval_shape(lambda: make_pools(c, 64, 16, 8, jnp.bfloat16))
    backend = Backend(kernels=True, platform="gpu", device="gpu", mla_decode="triton", dense_in_place=True)
    step = jax.jit(make_step(c, backend))
    for name, (chunks, tokens) in STEPS.items():
        batch = make_step_batch(chunks, 16, num_tokens=tokens, num_seqs=4, max_pages=40)
        batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
        text = step.trace(params, pools, batch).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text, name                  # the kernels are in the program, not the references
