"""Speculative verification against plain decoding at the step level (the model's step function, no engine)."""
import numpy as np

K = 4


def prefilled(config, params, backend, dtype, prompt_len=600, page_size=16, max_pages=256):
    """One sequence of prompt_len random tokens prefilled in one step (KDA slot 1, pages 1..max_pages).
    Returns (decode, pools, the prefill's last logits row): decode(pools, token, position) runs one decode
    step of that sequence and returns (logits row [V] fp32, pools)."""
    import jax
    from k3jax.cache import SeqChunk, make_pools, make_step_batch
    from k3jax.nnx_model import make_step
    pages = list(range(1, max_pages + 1))
    pools = make_pools(config, max_pages + 2, page_size, 16, dtype, bits=jax.default_backend() == "cpu")
    step = jax.jit(make_step(config, backend))
    prompt = np.random.default_rng(0).integers(0, config.vocab_size - 16, prompt_len).tolist()
    T0 = 1 << (prompt_len - 1).bit_length()
    lg, pools = step(params, pools, make_step_batch([SeqChunk(prompt, 0, pages, -1, 1)], page_size, num_tokens=T0,
                                                     num_seqs=1, max_pages=max_pages))

    def decode(pools, token, pos):
        lg, pools = step(params, pools, make_step_batch([SeqChunk([token], pos, pages, 1, 1)], page_size,
                                                         num_tokens=16, num_seqs=1, max_pages=max_pages))
        return np.asarray(lg[0], np.float32), pools

    def verify(pools, tokens, slots):
        batch = make_step_batch([SeqChunk(tokens, prompt_len, pages, 1, 1, spec_slots=slots)], page_size,
                                num_tokens=16, num_seqs=1, max_pages=max_pages, spec_width=len(tokens))
        lg, pools = step(params, pools, batch)
        return np.asarray(lg, np.float32).reshape(len(tokens), -1), pools

    decode.verify = verify
    return decode, pools, np.asarray(lg[0], np.float32)


def decode_logits(config, params, backend, feed, dtype, prompt_len=600):
    """A prompt_len-token prefill, then decode steps fed `feed` (one token a step): the logits
    [1 + len(feed), V] (the prefill's last row first)."""
    decode, pools, row = prefilled(config, params, backend, dtype, prompt_len)
    out = [row]
    for j, t in enumerate(feed):
        row, pools = decode(pools, t, prompt_len + j)
        out.append(row)
    return np.stack(out)


def verify_vs_decode(config, params, backend, dtype, prompt_len=600):
    """One sequence prefilled (prompt_len tokens in one step), then its next K + 1 tokens fed two ways from the
    same pools: K + 1 decode steps, and one verification step (a chunk of K + 1 tokens with a KDA slot per
    position). Returns (decode logits [K+1, V], verify logits [K+1, V], decode states [K+1, ...], verify
    states [K+1, ...]): the fed tokens are the decode path's greedy ones, so the two read the same inputs."""
    W = K + 1
    decode, start, row = prefilled(config, params, backend, dtype, prompt_len)
    pools, toks, dec, dec_states = start, [int(np.argmax(row))], [], []
    for j in range(W):
        row, pools = decode(pools, toks[j], prompt_len + j)
        dec.append(row)
        dec_states.append(np.asarray(pools.kda_state[1]))
        toks.append(int(np.argmax(row)))
    slots = [2, 3, 4, 5, 1]
    ver, pools = decode.verify(start, toks[:W], slots)
    ver_states = [np.asarray(pools.kda_state[s]) for s in slots]
    return np.stack(dec), ver, np.stack(dec_states), np.stack(ver_states)
