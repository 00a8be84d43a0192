"""Verification of draft tokens against the target's logits: greedy matching and rejection sampling.

A verify row fed its last token and d <= K drafts; the target's logits after each of these W = K + 1
tokens are p_0 .. p_d (the sampler's processed distribution: bitmask, bias, penalties, temperature,
truncation, serving/sampler.py). Draft j (0-based) was proposed from q_j and is judged by p_j.

Greedy rows accept draft j when it is argmax p_j and stop at the first mismatch, emitting argmax there:
exactly the tokens plain decoding would produce.

Sampled rows (Leviathan et al., 2023): draft x = d_j is accepted with probability min(1, p_j(x) / q_j(x));
at the first rejection the row emits a draw from the residual max(0, p_j - q_j) / Z, and when all d
drafts pass, a draw from p_d (the bonus token). Each emitted token is then distributed as p given the
tokens before it, whatever q was. A drafter that proposes one token deterministically (n-gram lookup,
a greedy draft model) has q_j = one-hot(x): acceptance probability p_j(x), and the residual is p_j with x
removed, renormalised (p_j(x) < 1 whenever x can be rejected, so Z = 1 - p_j(x) > 0).

Randomness: position j of a row uses the key the plain sampler would use for that token
(fold_in(fold_in(base, seed), counter + j)): its Gumbel draw picks a bonus or residual token, and a
uniform from a key folded once more decides acceptance. A row without drafts draws exactly the
token `sampler.sample` draws.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.sampler import NEG_INF, SamplingArrays, process, row_keys


def _repeat_rows(params: SamplingArrays, w: int) -> SamplingArrays:
    return jax.tree_util.tree_map(lambda a: jnp.repeat(a, w, axis=0), params)


def verify(logits, params: SamplingArrays, key_data, counters, drafts, num_drafts, draft_probs=None,
           num_top_logprobs: int = 0):
    """Judge the drafts of N rows.

    logits [N, W, V]: the target's logits after each fed token (row n fed its last token, then
    drafts[n, :num_drafts[n]]); params: SamplingArrays of N rows; key_data: the base key (uint32 [2]);
    counters [N]: each row's generated tokens so far; drafts [N, K] int32 (K = W - 1); num_drafts [N];
    draft_probs [N, K, V] the drafter's distributions q_j, or None for deterministic proposals.
    Returns (tokens [N, W] int32: position j < accepted holds draft j, position `accepted` the
    bonus or residual token; num_accepted [N] int32; logprobs [N, W] raw log-probabilities of the
    tokens; (top_ids [N, W, L], top_vals [N, W, L])).
    """
    logits = logits.astype(jnp.float32)
    n, w, v = logits.shape
    k = w - 1
    flat = logits.reshape(n * w, v)
    rep = _repeat_rows(params, w)
    x, xs, keep, greedy = process(flat, rep)
    logp = jax.nn.log_softmax(jnp.where(keep, xs, NEG_INF), axis=-1).reshape(n, w, v)
    greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32).reshape(n, w)
    cnt = (counters.astype(jnp.int32)[:, None] + jnp.arange(w, dtype=jnp.int32)[None]).reshape(-1)
    keys = row_keys(key_data, rep.seed, cnt)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(keys).reshape(n, w, v)
    unif = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), (), jnp.float32))(keys).reshape(n, w)
    is_greedy = greedy.reshape(n, w)[:, 0]

    # the token each position emits when it is not a draft: a draw from p_j (what sample() draws)
    plain = jnp.argmax(jnp.where(keep.reshape(n, w, v), xs.reshape(n, w, v) + gumbel, NEG_INF), axis=-1)
    plain = jnp.where(is_greedy[:, None], greedy_tok, plain.astype(jnp.int32))

    d = jnp.clip(drafts.astype(jnp.int32), 0, v - 1)                      # [N, K]
    lp_d = jnp.take_along_axis(logp[:, :k], d[..., None], axis=-1)[..., 0]  # log p_j(d_j)
    vocab = jnp.arange(v, dtype=jnp.int32)
    if draft_probs is None:
        ratio = jnp.exp(lp_d)                                             # p / q with q one-hot
        residual = jnp.where(vocab[None, None] == d[..., None], NEG_INF, logp[:, :k])
    else:
        q = draft_probs.astype(jnp.float32)
        q_d = jnp.take_along_axis(q, d[..., None], axis=-1)[..., 0]
        ratio = jnp.exp(lp_d) / jnp.maximum(q_d, 1e-30)
        r = jnp.maximum(jnp.exp(logp[:, :k]) - q, 0.0)
        residual = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)), NEG_INF)
    # p == q leaves no residual mass (rejection then has probability 0): fall back to p itself
    residual = jnp.where(jnp.any(residual > NEG_INF, axis=-1, keepdims=True), residual, logp[:, :k])
    resampled = jnp.argmax(residual + gumbel[:, :k], axis=-1).astype(jnp.int32)
    resampled = jnp.where(is_greedy[:, None], greedy_tok[:, :k], resampled)

    ok = jnp.where(is_greedy[:, None], d == greedy_tok[:, :k], unif[:, :k] < ratio)
    ok = ok & (jnp.arange(k)[None] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)   # [N]

    last = jnp.where(accepted < num_drafts,
                     jnp.take_along_axis(jnp.pad(resampled, ((0, 0), (0, 1))), accepted[:, None], axis=1)[:, 0],
                     jnp.take_along_axis(plain, accepted[:, None], axis=1)[:, 0])
    pos = jnp.arange(w)[None]
    tokens = jnp.where(pos < accepted[:, None], jnp.pad(d, ((0, 0), (0, 1))), last[:, None]).astype(jnp.int32)

    raw = jax.nn.log_softmax(flat, axis=-1).reshape(n, w, v)
    chosen = jnp.take_along_axis(raw, tokens[..., None], axis=-1)[..., 0]
    if num_top_logprobs > 0 and params.top_logprobs:
        top_vals, top_ids = jax.lax.top_k(raw, num_top_logprobs)
    else:
        top_vals, top_ids = jnp.zeros((n, w, 0), jnp.float32), jnp.zeros((n, w, 0), jnp.int32)
    return tokens, accepted, chosen, (top_ids.astype(jnp.int32), top_vals)


verify_jit = jax.jit(verify, static_argnames=("num_top_logprobs",))
