"""A verification step of short chunks (StepBatch.verify_only) against the general verification program on the same
pools (tiny-random, fp32, the reference ops): KDA runs the decode recurrence for every token instead of the chunk
kernel. Drafted positions come from the recurrence in both, so their logits and states are the same bits; the
other short chunks (a decode row without drafts, a fresh prompt of two tokens with a prefix checkpoint) agree
to fp32 rounding, and their last state and conv window reach state_dst and ckpt_dst as the chunk path writes
them."""
import jax
import numpy as np
import pytest

from k3jax.cache import SeqChunk, make_pools, make_step_batch
from k3jax.nnx_model import make_step

PAGE = 16


@pytest.fixture(scope="module")
def setup():
    from k3jax import load_model
    model = load_model("tiny-random", dtype="float32")
    c = model.config
    step = jax.jit(make_step(c, model.backend))
    pools = make_pools(c, 40, PAGE, 16, "float32", bits=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, c.vocab_size - 16, n).tolist() for n in (37, 21)]
    # two sequences prefilled: A in slot 1 (pages 1-8), B in slot 2 (pages 9-16)
    chunks = [SeqChunk(prompts[0], 0, list(range(1, 9)), -1, 1), SeqChunk(prompts[1], 0, list(range(9, 17)), -1, 2)]
    _, pools = step(model.params, pools, make_step_batch(chunks, PAGE, num_tokens=64, num_seqs=4, max_pages=8))
    W = 4
    verify = make_step_batch([
        SeqChunk([5, 6, 7, 8], 37, list(range(1, 9)), 1, 1, spec_slots=[3, 4, 5, 1]),   # A: a token and 3 drafts
        SeqChunk([9], 21, list(range(9, 17)), 2, 2),                                   # B: a decode row, no drafts
        SeqChunk([10, 11], 0, list(range(17, 25)), -1, 6, ckpt_dst=7),                 # C: a fresh 2-token prompt
    ], PAGE, num_tokens=16, num_seqs=4, max_pages=8, spec_width=W)
    assert verify.verify_only
    out = {}
    for name, batch in (("short", verify), ("general", verify.replace(verify_only=False))):
        logits, p = step(model.params, jax.tree.map(lambda x: x.copy(), pools), batch)
        out[name] = (np.asarray(logits).reshape(4, W, -1), np.asarray(p.kda_state), np.asarray(p.kda_conv))
    return out, model


def test_drafted_positions_are_the_same_bits(setup):
    out, _ = setup
    (ls, ss, cs), (lg, sg, cg) = out["short"], out["general"]
    np.testing.assert_array_equal(ls[0], lg[0])
    for slot in (3, 4, 5, 1):
        np.testing.assert_array_equal(ss[slot], sg[slot])
        np.testing.assert_array_equal(cs[slot], cg[slot])


def test_other_short_chunks_agree_and_write_their_slots(setup):
    out, model = setup
    (ls, ss, cs), (lg, sg, cg) = out["short"], out["general"]
    for n in (1, 2):                                    # B's row and C's last token
        np.testing.assert_allclose(ls[n, 0], lg[n, 0], rtol=1e-4, atol=1e-4)
    for slot in (2, 6, 7):                              # B's slot; C's slot and its checkpoint
        assert np.abs(ss[slot]).max() > 0
        np.testing.assert_allclose(ss[slot], sg[slot], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(cs[slot], cg[slot])      # conv windows are copies of the inputs
    np.testing.assert_array_equal(ss[6], ss[7])
    untouched = [s for s in range(ss.shape[0]) if s not in (0, 1, 2, 3, 4, 5, 6, 7)]
    np.testing.assert_array_equal(ss[untouched], sg[untouched])
