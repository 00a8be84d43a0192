"""The cache-aware step over pools equals the full-sequence forward.

Random prefill-chunk sizes, decode steps, several sequences per step, shuffled pages and slots,
bucket padding, and prefix checkpoints resumed by another sequence (copy-on-write).
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from k3jax.cache import SeqChunk, make_pools, make_step_batch
from k3jax.model import K3Model
from k3jax.nnx_model import make_step
from k3jax.params import init_params_numpy
from k3jax.presets import preset_config

PAGE = 8
BUCKET = dict(num_tokens=96, num_seqs=4, max_pages=24)
# one pool shape for every test: each distinct shape is another compile of the step, this file's largest cost
POOL = dict(num_pages=64, num_slots=8)
FULL_LEN = 160       # the reference forward's one length (the longest sequence here is 150)


def _pools(c):
    return make_pools(c, POOL["num_pages"], PAGE, POOL["num_slots"], jnp.float32)


@pytest.fixture(scope="module")
def model():
    c = preset_config("tiny-random")
    params = init_params_numpy(c, 11, jnp.float32)
    # both through the scanned decoder (tests/model/test_layer_stack.py checks scan == unrolled)
    forward = jax.jit(lambda p, t: K3Model(c, p)(t))

    def full(p, t):
        """The forward of t (1, n), right-padded to one length (one compile): a causal model's logits of the
        first n positions ignore the padding."""
        n = t.shape[1]
        assert n <= FULL_LEN
        return forward(p, np.pad(t, ((0, 0), (0, FULL_LEN - n))))[:, :n]

    step = jax.jit(make_step(c), donate_argnums=1)
    return c, params, full, step


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_random_chunks_match_full_forward(model):
    c, params, full, step = model
    rng = np.random.RandomState(0)
    lengths = [150, 90, 61]
    seqs = [rng.randint(0, c.vocab_size, n).astype(np.int32) for n in lengths]
    refs = [np.asarray(full(params, s[None]))[0] for s in seqs]
    pages = rng.permutation(np.arange(1, 64))
    tables = [pages[0:20], pages[20:40], pages[40:60]]
    slots = rng.permutation(np.arange(1, 8))[:3]
    pools = _pools(c)
    done = [0, 0, 0]
    checked = 0
    while any(d < n for d, n in zip(done, lengths)):
        chunks, owners = [], []
        budget = BUCKET["num_tokens"]
        for i in rng.permutation(3):
            if done[i] >= lengths[i] or rng.rand() < 0.25:
                continue
            m = min(lengths[i] - done[i], budget, 1 if rng.rand() < 0.3 else rng.randint(1, 40))
            if m <= 0:
                continue
            chunks.append(SeqChunk(seqs[i][done[i]:done[i] + m], done[i], tables[i],
                                   state_src=slots[i] if done[i] else -1, state_dst=slots[i]))
            owners.append(i)
            budget -= m
        if not chunks:
            continue
        logits, pools = step(params, pools, make_step_batch(chunks, PAGE, **BUCKET))
        for n, i in enumerate(owners):
            done[i] += len(chunks[n].tokens)
            # fp32 rounding of two summation orders (chunked vs whole): 1.1e-4 at worst with the jax 0.10.2
            # CPU build of 2026-12-01 (the same commit measured under 1e-4 before)
            assert _rel(np.asarray(logits[n]), refs[i][done[i] - 1]) <= 2e-4
            checked += 1
    assert checked >= 10


def test_prefix_checkpoint_resumed_by_another_sequence(model):
    """B resumes from A's checkpoint after 48 tokens and shares A's first 6 pages; A is unaffected."""
    c, params, full, step = model
    rng = np.random.RandomState(1)
    a = rng.randint(0, c.vocab_size, 80).astype(np.int32)
    b = np.concatenate([a[:48], rng.randint(0, c.vocab_size, 30).astype(np.int32)])
    ref_a, ref_b = (np.asarray(full(params, s[None]))[0] for s in (a, b))
    pools = _pools(c)
    pages_a = list(range(10, 20))
    pages_b = pages_a[:6] + [30, 31, 32, 33]
    # A: 48 tokens, also writing its state into checkpoint slot 5.
    _, pools = step(params, pools, make_step_batch([SeqChunk(a[:48], 0, pages_a, -1, 1, ckpt_dst=5)], PAGE, **BUCKET))
    # B (from the checkpoint, into its own slot 2) and A (continuing in slot 1) in the same step.
    logits, pools = step(params, pools, make_step_batch(
        [SeqChunk(b[48:], 48, pages_b, 5, 2), SeqChunk(a[48:], 48, pages_a, 1, 1)], PAGE, **BUCKET))
    assert _rel(np.asarray(logits[0]), ref_b[-1]) <= 1e-4
    assert _rel(np.asarray(logits[1]), ref_a[-1]) <= 1e-4
    # The checkpoint slot still holds the state after exactly 48 tokens: resume again, one token at a time.
    logits, pools = step(params, pools, make_step_batch([SeqChunk(b[48:49], 48, pages_b[:6] + [34], 5, 3)], PAGE, **BUCKET))
    assert _rel(np.asarray(logits[0]), ref_b[48]) <= 1e-4


def test_padding_sequences_do_not_touch_real_slots(model):
    c, params, full, step = model
    pools = _pools(c)
    pools = jax.tree_util.tree_map(lambda x: x + 1.0, pools)     # non-zero everywhere
    before = jax.tree_util.tree_map(np.asarray, pools)
    toks = np.arange(5, dtype=np.int32)
    _, pools = step(params, pools, make_step_batch([SeqChunk(toks, 0, [3], -1, 2)], PAGE, **BUCKET))
    after = jax.tree_util.tree_map(np.asarray, pools)
    for j in range(len(c.kda_layers)):
        b_, a_ = before.kda_state[:, j], after.kda_state[:, j]
        np.testing.assert_array_equal(b_[[1, 3]], a_[[1, 3]])    # untouched slots
        assert not np.array_equal(b_[2], a_[2])
    for j in range(len(c.mla_layers)):
        b_, a_ = before.mla_kv[:, j], after.mla_kv[:, j]
        np.testing.assert_array_equal(np.delete(b_, [0, 3], axis=0), np.delete(a_, [0, 3], axis=0))


def test_decode_only_steps_use_the_pool_in_place_and_match(model):
    """Several sequences decoding one token each (the fused decode path) == full forward."""
    c, params, full, step = model
    rng = np.random.RandomState(3)
    seqs = [rng.randint(0, c.vocab_size, n).astype(np.int32) for n in (20, 33, 9)]
    refs = [np.asarray(full(params, s[None]))[0] for s in seqs]
    pools = _pools(c)
    tables = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13]]
    prefill = [SeqChunk(s[:-3], 0, t, -1, slot) for s, t, slot in zip(seqs, tables, (4, 2, 5))]
    _, pools = step(params, pools, make_step_batch(prefill, PAGE, **BUCKET))
    for back in (3, 2, 1):
        chunks = [SeqChunk(s[-back:len(s) - back + 1], len(s) - back, t, slot, slot)
                  for s, t, slot in zip(seqs, tables, (4, 2, 5))]
        batch = make_step_batch(chunks, PAGE, **BUCKET)
        assert batch.decode_only
        logits, pools = step(params, pools, batch)
        for n, s in enumerate(seqs):
            assert _rel(np.asarray(logits[n]), refs[n][len(s) - back]) <= 1e-4
