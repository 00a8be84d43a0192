"""Jitted token sampler: penalties, bitmask, temperature, min-p / top-k / top-p, seeded draws.

Order of operations (as vLLM v1):
  1. allowed-token bitmask (structured output): forbidden logits -> -inf;
  2. penalties: repetition on prompt+output tokens, then frequency and presence on output
     tokens only (`apply_penalties`);
  3. greedy rows (temperature < 1e-5) take argmax of these logits (first index on ties);
  4. other rows divide by temperature, then min-p, top-k, top-p (top-p is measured on the
     distribution renormalised after min-p and top-k), then draw with the Gumbel-max trick.

Ties: every truncation is a value threshold, so tokens tied with the last kept one are all
kept (top-k may keep more than k; top-p keeps all tokens tied with the boundary token).

Logprobs (`logprobs_mode`): "raw" (default, like vLLM's raw_logprobs) = log_softmax of the
model's logits before bitmask, penalties, temperature and truncation; "processed" = log_softmax
of the logits actually sampled from (after all of the above; greedy rows: after 1-2 only).

Randomness: row key = fold_in(fold_in(base_key, seed), step_counter) where step_counter is the
row's own number of generated tokens, so a seeded row draws the same token whatever the batch
around it. Seeds are used modulo 2**32.
"""
from __future__ import annotations

from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from serving.sampling_params import GREEDY_EPS, MAX_LOGIT_BIAS, SamplingParams

NEG_INF = -jnp.inf


@flax.struct.dataclass
class SamplingArrays:
    """Per-row sampling controls for a batch of S rows (a pytree; optional fields may be None,
    which changes the tree structure and so the compiled variant)."""

    temperature: jax.Array         # [S] f32, < 1e-5 means greedy
    top_k: jax.Array               # [S] i32, 0 = off
    top_p: jax.Array               # [S] f32, 1 = off
    min_p: jax.Array               # [S] f32, 0 = off
    repetition_penalty: jax.Array  # [S] f32, 1 = off (prompt + output tokens)
    presence_penalty: jax.Array    # [S] f32, 0 = off (output tokens)
    frequency_penalty: jax.Array   # [S] f32, 0 = off (output tokens)
    seed: jax.Array                # [S] u32
    prompt_mask: Optional[jax.Array] = None    # [S, ceil(V/32)] u32 bitmask of prompt tokens
    output_tokens: Optional[jax.Array] = None  # [S, L] i32 generated tokens, -1 = padding
    allowed_mask: Optional[jax.Array] = None   # [S, ceil(V/32)] u32, bit t%32 of word t//32
    # logit bias (SamplingParams.logit_bias): present together with allowed_mask (one "logit processors"
    # variant, not a fifth variant dimension to compile)
    bias_ids: Optional[jax.Array] = None       # [S, MAX_LOGIT_BIAS] i32 token ids, -1 = padding
    bias_values: Optional[jax.Array] = None    # [S, MAX_LOGIT_BIAS] f32
    # Static (compiled variants; build_sampling_arrays sets them from the rows): some row uses top-k or
    # top-p (the full sort runs), the top logprobs are computed. Static rather than lax.cond on device
    # values: XLA:GPU reads a conditional's predicate back to the host, which blocks the dispatching
    # thread until the model step before it has run.
    truncate: bool = flax.struct.field(pytree_node=False, default=True)
    top_logprobs: bool = flax.struct.field(pytree_node=False, default=True)


def make_key_data(seed: int) -> np.ndarray:
    """Engine base key as raw uint32 data [2] (fixed for the engine's lifetime)."""
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def unpack_bitmask(mask: jax.Array, vocab_size: int) -> jax.Array:
    """[S, W] uint32 -> [S, V] bool; token t is bit (t % 32) of word t // 32."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (mask[:, :, None] >> shifts) & jnp.uint32(1)
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].astype(bool)


def token_counts(ids: jax.Array, vocab_size: int) -> jax.Array:
    """[S, L] int32 token ids (-1 = padding) -> [S, V] int32 occurrence counts."""
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
    valid = (ids >= 0).astype(jnp.int32)
    return jnp.zeros((ids.shape[0], vocab_size), jnp.int32).at[rows, jnp.maximum(ids, 0)].add(valid)


def apply_penalties(logits, prompt_mask, output_tokens, repetition, presence, frequency):
    """vLLM's penalties. logits [S, V] f32; prompt_mask [S, W] u32 or None; output_tokens
    [S, L] i32 or None; penalties [S]. For each token t seen in prompt or output:
    logit > 0 -> logit / rep, else logit * rep; then logit -= freq * count_out(t) + pres *
    [count_out(t) > 0]."""
    v = logits.shape[-1]
    seen = jnp.zeros(logits.shape, bool)
    counts = None
    if prompt_mask is not None:
        seen = seen | unpack_bitmask(prompt_mask, v)
    if output_tokens is not None:
        counts = token_counts(output_tokens, v)
        seen = seen | (counts > 0)
    r = jnp.where(seen, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / r, logits * r)
    if counts is not None:
        logits = (logits - frequency[:, None] * counts.astype(jnp.float32)
                  - presence[:, None] * (counts > 0).astype(jnp.float32))
    return logits


def truncation_mask(x: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                    sort: bool = True) -> jax.Array:
    """Tokens kept by min-p, then top-k, then top-p. x [S, V] temperature-scaled logits;
    top_k [S] i32 (0 off), top_p [S] f32 (1 off), min_p [S] f32 (0 off). Returns [S, V] bool.

    min-p keeps p_t >= min_p * p_max; top-k keeps logits >= the k-th largest; top-p keeps the
    smallest head of the (renormalised) sorted distribution whose mass reaches top_p, i.e.
    every token whose strictly-higher-sorted mass is < top_p, widened to ties. The full sort runs
    when `sort` (static: some row uses top-k or top-p; without it every row must have them off)."""
    v = x.shape[-1]
    xmax = jnp.max(x, axis=-1)
    thr = jnp.where(min_p > 0, xmax + jnp.log(jnp.maximum(min_p, 1e-38)), NEG_INF)

    def with_sort(thr):
        s = -jnp.sort(-x, axis=-1)  # descending
        k = jnp.clip(top_k, 1, v)
        kth = jnp.take_along_axis(s, (k - 1)[:, None], axis=-1)[:, 0]
        thr = jnp.maximum(thr, jnp.where(top_k > 0, kth, NEG_INF))
        s1 = jnp.where(s >= thr[:, None], s, NEG_INF)
        q = jax.nn.softmax(s1, axis=-1)
        cum = jnp.cumsum(q, axis=-1)
        excl = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)
        n_keep = jnp.sum(excl < top_p[:, None], axis=-1)  # a prefix, >= 1
        pth = jnp.take_along_axis(s1, (n_keep - 1)[:, None], axis=-1)[:, 0]
        return jnp.maximum(thr, jnp.where(top_p < 1.0, pth, NEG_INF))

    return x >= (with_sort(thr) if sort else thr)[:, None]


def row_keys(key_data: jax.Array, seeds: jax.Array, counters: jax.Array):
    """Per-row PRNG keys [S]: fold_in(fold_in(base, seed), counter); independent of row order."""
    base = jax.random.wrap_key_data(jnp.asarray(key_data, jnp.uint32))
    fold = lambda s, c: jax.random.fold_in(jax.random.fold_in(base, s), c)
    return jax.vmap(fold)(seeds.astype(jnp.uint32), counters.astype(jnp.uint32))


def sample(logits, params: SamplingArrays, key_data, step_counters,
           num_top_logprobs: int = 0, logprobs_mode: str = "raw"):
    """Sample one token per row.

    logits [S, V] (cast to f32); params: SamplingArrays of S rows; key_data: uint32 [2] base key
    (`make_key_data`); step_counters [S] int: each row's number of already generated tokens.
    num_top_logprobs (static K) and logprobs_mode (static, "raw" | "processed").
    Returns (token_ids [S] i32, logprobs [S] f32 of the chosen tokens, (top_ids [S, K] i32,
    top_vals [S, K] f32)).
    """
    if logprobs_mode not in ("raw", "processed"):
        raise ValueError(f"logprobs_mode: expected 'raw' or 'processed', got {logprobs_mode!r}")
    logits = logits.astype(jnp.float32)
    s, v = logits.shape
    x, xs, keep, greedy = process(logits, params)
    greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
    processed = jnp.where(keep | greedy[:, None], xs, NEG_INF)
    keys = row_keys(key_data, params.seed, step_counters)
    g = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
    tok = jnp.argmax(jnp.where(keep, xs + g, NEG_INF), axis=-1).astype(jnp.int32)
    tokens = jnp.where(greedy, greedy_tok, tok)
    lp = jax.nn.log_softmax(logits if logprobs_mode == "raw" else processed, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if num_top_logprobs > 0 and params.top_logprobs:
        top_vals, top_ids = jax.lax.top_k(lp, num_top_logprobs)
    else:
        top_vals, top_ids = jnp.zeros((s, 0), jnp.float32), jnp.zeros((s, 0), jnp.int32)
    return tokens, chosen, (top_ids.astype(jnp.int32), top_vals)


def process(logits, params: SamplingArrays):
    """Steps 1-4 of the module docstring up to the draw: (x [S, V] the logits after bitmask, bias and
    penalties (greedy rows take its argmax), xs = x / temperature, keep [S, V] the tokens truncation
    keeps, greedy [S]). A sampled row draws from softmax(xs) restricted to keep."""
    s, v = logits.shape
    x = logits
    if params.allowed_mask is not None:
        x = jnp.where(unpack_bitmask(params.allowed_mask, v), x, NEG_INF)
    if params.bias_ids is not None:
        rows = jnp.broadcast_to(jnp.arange(s)[:, None], params.bias_ids.shape)
        x = x.at[rows, jnp.where(params.bias_ids >= 0, params.bias_ids, v)].add(params.bias_values, mode="drop")
    if params.prompt_mask is not None or params.output_tokens is not None:
        x = apply_penalties(x, params.prompt_mask, params.output_tokens,
                            params.repetition_penalty, params.presence_penalty,
                            params.frequency_penalty)
    greedy = params.temperature < GREEDY_EPS
    xs = x / jnp.where(greedy, 1.0, params.temperature)[:, None]
    # every row is drawn, greedy ones too (then discarded): a lax.cond on "all greedy" would sync the
    # host (see SamplingArrays.truncate), and the draw costs little next to it
    keep = truncation_mask(xs, params.top_k, params.top_p, params.min_p, sort=params.truncate)
    return x, xs, keep, greedy


sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs", "logprobs_mode"))


# ---------------------------------------------------------------- host side (numpy)

def token_bitmask(token_ids, vocab_size: int) -> np.ndarray:
    """Host: ids -> uint32 [ceil(V/32)] bitmask with a bit set for each id present."""
    words = np.zeros((vocab_size + 31) // 32, np.uint32)
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return words


def _bucket(n: int, minimum: int = 16) -> int:
    """Next power of two >= n (bounded set of padded lengths -> bounded compilations)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def build_sampling_arrays(params: Sequence[SamplingParams], *, seeds=None, num_rows=None,
                          vocab_size=None, prompt_token_ids=None, output_token_ids=None,
                          allowed_masks=None, penalty_width=None, top_logprobs=None) -> SamplingArrays:
    """Host: SamplingArrays (numpy) for a batch.

    params: one SamplingParams per row. seeds: optional per-row ints overriding params.seed
    (the engine passes the seed it drew for unseeded requests so a request keeps one seed);
    a row with neither gets a fresh random seed. num_rows: pad to this many rows (padding is
    greedy, no penalties). vocab_size: needed for penalties. prompt_token_ids /
    output_token_ids: per-row token sequences, used only if some row has penalties (prompt
    ids only for repetition). allowed_masks: per-row uint32 [ceil(V/32)] or None (no
    constraint); the field stays None when every row is unconstrained and has no logit_bias (vocab_size
    is then needed for the all-allowed mask).
    penalty_width: when set, penalties take one shape whatever the batch (output_tokens
    [rows, penalty_width], prompt_mask always present, zero where repetition is off), so a
    server compiles one penalties variant at warm-up instead of one per output length.
    top_logprobs: compute the top logprobs (None: when some row asks for logprobs).
    """
    n = len(params)
    rows = n if num_rows is None else num_rows
    if rows < n:
        raise ValueError(f"num_rows: {rows} < batch size {n}")

    def col(name, fill, dtype):
        a = np.full(rows, fill, dtype)
        a[:n] = [getattr(p, name) for p in params]
        return a

    seed = np.zeros(rows, np.uint32)
    rng = None                    # made only for a row without a seed (the engine gives every row one)
    for i, p in enumerate(params):
        sd = seeds[i] if seeds is not None and seeds[i] is not None else p.seed
        if sd is None:
            rng = rng or np.random.default_rng()
            sd = int(rng.integers(0, 2**32))
        seed[i] = sd % 2**32
    out = dict(
        temperature=col("temperature", 0.0, np.float32), top_k=col("top_k", 0, np.int32),
        top_p=col("top_p", 1.0, np.float32), min_p=col("min_p", 0.0, np.float32),
        repetition_penalty=col("repetition_penalty", 1.0, np.float32),
        presence_penalty=col("presence_penalty", 0.0, np.float32),
        frequency_penalty=col("frequency_penalty", 0.0, np.float32), seed=seed)

    if any(p.uses_penalties for p in params):
        if vocab_size is None or output_token_ids is None:
            raise ValueError("vocab_size/output_token_ids: required when a row uses penalties")
        outs = [list(output_token_ids[i]) if params[i].uses_penalties else [] for i in range(n)]
        width = penalty_width or _bucket(max(len(o) for o in outs))
        if max(len(o) for o in outs) > width:
            raise ValueError(f"output_token_ids: longer than penalty_width {width}")
        ot = np.full((rows, width), -1, np.int32)
        for i, o in enumerate(outs):
            ot[i, :len(o)] = o
        out["output_tokens"] = ot
        repetition = any(p.repetition_penalty != 1.0 for p in params)
        if penalty_width or repetition:
            if repetition and prompt_token_ids is None:
                raise ValueError("prompt_token_ids: required when a row uses repetition_penalty")
            pm = np.zeros((rows, (vocab_size + 31) // 32), np.uint32)
            for i, p in enumerate(params[:n]):
                if p.repetition_penalty != 1.0 and len(prompt_token_ids[i]):
                    pm[i] = token_bitmask(prompt_token_ids[i], vocab_size)
            out["prompt_mask"] = pm

    masked = allowed_masks is not None and any(m is not None for m in allowed_masks)
    if masked or any(p.logit_bias for p in params):
        if vocab_size is None and not masked:
            raise ValueError("vocab_size: required when a row uses logit_bias")
        w = next(np.asarray(m).shape[-1] for m in allowed_masks if m is not None) if masked else (vocab_size + 31) // 32
        am = np.full((rows, w), 0xFFFFFFFF, np.uint32)
        for i, m in enumerate(allowed_masks if masked else ()):
            if m is not None:
                am[i] = np.asarray(m, np.uint32)
        out["allowed_mask"] = am
        out["bias_ids"] = np.full((rows, MAX_LOGIT_BIAS), -1, np.int32)
        out["bias_values"] = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
        for i, p in enumerate(params):
            if p.logit_bias:
                out["bias_ids"][i, :len(p.logit_bias)] = list(p.logit_bias)
                out["bias_values"][i, :len(p.logit_bias)] = list(p.logit_bias.values())
    out["truncate"] = bool((out["top_k"] > 0).any() or (out["top_p"] < 1.0).any())
    out["top_logprobs"] = any(p.logprobs for p in params) if top_logprobs is None else bool(top_logprobs)
    return SamplingArrays(**out)
