"""Shared by the dispatch tests: the tiny model's two steps (a prefill of two sequences, then one
decode token each) on the backend the caller passes."""
import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.cache import SeqChunk, make_pools, make_step_batch
from k3jax.layer_stack import stack_layers
from k3jax.nnx_model import make_step
from k3jax.params import init_params_numpy
from k3jax.presets import preset_config


def two_step_logits(backend):
    """(logits of the two real sequences per step, each step batch's decode_only flag), run on `backend`."""
    c = preset_config("tiny-random")
    params = stack_layers(init_params_numpy(c, 0, jnp.float32), c)      # the runner's (scanned) layout
    toks = np.random.RandomState(0).randint(0, c.vocab_size, 40)
    steps = [[SeqChunk(toks[:30], 0, [1, 2, 3], -1, 1), SeqChunk(toks[:7], 0, [4], -1, 2)],
             [SeqChunk(toks[30:31], 30, [1, 2, 3], 1, 1), SeqChunk(toks[7:8], 7, [4], 2, 2)]]
    pools = make_pools(c, 16, 16, 4, jnp.float32)
    # interpret-mode kernels are big unrolled HLO: without XLA's backend optimisations the step compiles
    # in a fraction of the time (as tests/kernels/test_kda_kernels.py's kernels do)
    step = jax.jit(make_step(c, backend), compiler_options={"xla_backend_optimization_level": 0})
    logits, decode_only = [], []
    for chunks in steps:
        batch = make_step_batch(chunks, 16, num_tokens=64, num_seqs=4, max_pages=4)
        decode_only.append(bool(batch.decode_only))
        lg, pools = step(params, pools, batch)
        logits.append(np.asarray(lg[:2]))
    return logits, decode_only


def can_export_for_tpu():
    """Whether this jax lowers a Pallas kernel through Mosaic for TPU (jax.export, no chip needed)."""
    def k(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0
    f = lambda x: pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(x)  # noqa: E731
    try:
        jax.export.export(jax.jit(f), platforms=["tpu"])(jax.ShapeDtypeStruct((8, 128), jnp.float32))
    except Exception:                                                 # noqa: BLE001
        return False
    return True
