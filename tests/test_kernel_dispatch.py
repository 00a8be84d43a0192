"""The model's call sites run the Pallas kernels (interpret mode on CPU) through the one dispatch
point and agree with the reference ops: KDA chunk (varlen, resumed states), paged MLA, fused
MXFP4 expert MLP."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from k3jax.cache import SeqChunk, make_pools, make_step_batch
from k3jax.model import forward_step
from k3jax.params import init_params_numpy
from k3jax.presets import preset_config
from pallas_kernels import ops


@pytest.fixture
def restore_mode():
    yield
    ops.set_kernel_mode(None)


def test_step_with_pallas_kernels_matches_reference(restore_mode):
    c = preset_config("tiny")
    params = init_params_numpy(c, 0, jnp.float32)
    toks = np.random.RandomState(0).randint(0, c.vocab_size, 40)
    steps = [[SeqChunk(toks[:30], 0, [1, 2, 3], -1, 1), SeqChunk(toks[:7], 0, [4], -1, 2)],
             [SeqChunk(toks[30:31], 30, [1, 2, 3], 1, 1), SeqChunk(toks[7:8], 7, [4], 2, 2)]]
    out = {}
    for mode in ("reference", "pallas"):
        ops.set_kernel_mode(mode)
        assert ops.use_pallas() == ((True, True) if mode == "pallas" else (False, False))
        pools = make_pools(c, 16, 16, 4, jnp.float32)
        step = jax.jit(lambda p, pools, b: forward_step(p, c, pools, b))
        logits = []
        for i, chunks in enumerate(steps):
            batch = make_step_batch(chunks, 16, num_tokens=64, num_seqs=4, max_pages=4)
            assert batch.decode_only == (i == 1)        # the second step runs the fused decode op
            lg, pools = step(params, pools, batch)
            logits.append(np.asarray(lg[:2]))
        out[mode] = logits
    for ref, ker in zip(out["reference"], out["pallas"]):
        assert np.abs(ref - ker).max() / np.abs(ref).max() < 5e-4


def test_bad_kernel_mode_is_rejected(restore_mode, monkeypatch):
    with pytest.raises(ValueError, match="kernel mode"):
        ops.set_kernel_mode("fast")
    monkeypatch.setenv("K3JAX_KERNELS", "turbo")
    with pytest.raises(ValueError, match="K3JAX_KERNELS"):
        ops.kernel_mode()
