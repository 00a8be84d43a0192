"""A verification step keeps the KDA state of every fed position (k3jax/layers/kda_positions.py): each
position's recurrent and conv state, and its logits, equal what one-token decode steps produce."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import load_model
from k3jax.cache import SeqChunk, make_pools, make_step_batch
from k3jax.model import forward_step

PS = 16


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", dtype="float32")


def _stepper(model):
    fn = jax.jit(functools.partial(forward_step, c=model.config))
    return lambda pools, chunks, **kw: fn(model.params, pools=pools, batch=make_step_batch(
        chunks, PS, num_tokens=16, num_seqs=2, max_pages=2, **kw))


def test_verify_keeps_each_positions_state(tiny):
    c = tiny.config
    step = _stepper(tiny)
    pools = make_pools(c, num_pages=4, page_size=PS, num_slots=8, dtype=jnp.float32)
    prompt = [5, 17, 99, 3, 250, 41, 7, 600, 12]
    logits, pools = step(pools, [SeqChunk(prompt, 0, [1, 2], -1, 1)])
    fed = [int(jnp.argmax(logits[0])), 321, 44, 908]               # its next token, then three drafts
    base = pools
    # verification: the state after fed token j goes to slot 2 + j (the last also to slot 1, as the engine does)
    slots = [2, 3, 4, 1]
    vlogits, vpools = step(base, [SeqChunk(fed, len(prompt), [1, 2], 1, 1, spec_slots=slots)], spec_width=4)
    # reference: one decode step per fed token in slot 1, from the same starting pools
    ref, states = base, []
    ref_logits = []
    for j, t in enumerate(fed):
        lg, ref = step(ref, [SeqChunk([t], len(prompt) + j, [1, 2], 1, 1)])
        ref_logits.append(np.asarray(lg[0]))
        states.append((np.asarray(ref.kda_state[1]), np.asarray(ref.kda_conv[1])))
    vs, vc = np.asarray(vpools.kda_state), np.asarray(vpools.kda_conv)
    for j, slot in enumerate(slots):
        np.testing.assert_allclose(vs[slot], states[j][0], rtol=1e-5, atol=1e-6, err_msg=f"state, position {j}")
        np.testing.assert_allclose(vc[slot], states[j][1], rtol=1e-5, atol=1e-6, err_msg=f"conv, position {j}")
        np.testing.assert_allclose(np.asarray(vlogits[j]), ref_logits[j], rtol=1e-4, atol=1e-4)
        for k in range(j):                                     # the positions are told apart
            assert np.abs(states[k][0] - states[j][0]).max() > 1e-3
    # a non-verify row in the same batch (a prefill chunk) keeps its last-token logits in every column
    pl, _ = step(base, [SeqChunk(fed, len(prompt), [1, 2], 1, 1, spec_slots=slots), SeqChunk(prompt, 0, [3], -1, 5)],
                 spec_width=4)
    first, _ = step(make_pools(c, num_pages=4, page_size=PS, num_slots=8, dtype=jnp.float32),
                    [SeqChunk(prompt, 0, [3], -1, 5)])
    for j in range(4):
        np.testing.assert_allclose(np.asarray(pl[4 + j]), np.asarray(first[0]), rtol=1e-4, atol=1e-4)
