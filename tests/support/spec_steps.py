"""Speculative verification against plain decoding at the step level (the model's step function, no engine)."""
import numpy as np

K = 4


def verify_vs_decode(config, params, backend, dtype, prompt_len=600, page_size=16, max_pages=256):
    """One sequence prefilled (prompt_len tokens in one step), then its next K + 1 tokens fed two ways from the
    same pools: K + 1 decode steps, and one verification step (a chunk of K + 1 tokens with a KDA slot per
    position). Returns (decode logits [K+1, V], verify logits [K+1, V], decode states [K+1, ...], verify
    states [K+1, ...]): the fed tokens are the decode path's greedy ones, so the two read the same inputs."""
    import jax
    from k3jax.cache import SeqChunk, make_pools, make_step_batch
    from k3jax.nnx_model import make_step
    W = K + 1
    pages = list(range(1, max_pages + 1))
    pools = make_pools(config, max_pages + 2, page_size, 16, dtype, bits=jax.default_backend() == "cpu")
    step = jax.jit(make_step(config, backend))
    prompt = np.random.default_rng(0).integers(0, config.vocab_size - 16, prompt_len).tolist()
    T0 = 1 << (prompt_len - 1).bit_length()
    lg, pools = step(params, pools, make_step_batch([SeqChunk(prompt, 0, pages, -1, 1)], page_size, num_tokens=T0,
                                                     num_seqs=1, max_pages=max_pages))
    prefilled = pools
    toks, dec, dec_states = [int(np.argmax(np.asarray(lg[0], np.float32)))], [], []
    for j in range(W):
        batch = make_step_batch([SeqChunk([toks[j]], prompt_len + j, pages, 1, 1)], page_size, num_tokens=16,
                                num_seqs=1, max_pages=max_pages)
        lg, pools = step(params, pools, batch)
        dec.append(np.asarray(lg[0], np.float32))
        dec_states.append(np.asarray(pools.kda_state[1]))
        toks.append(int(np.argmax(dec[-1])))
    slots = [2, 3, 4, 5, 1]
    batch = make_step_batch([SeqChunk(toks[:W], prompt_len, pages, 1, 1, spec_slots=slots)], page_size, num_tokens=16,
                            num_seqs=1, max_pages=max_pages, spec_width=W)
    lg, pools = step(params, prefilled, batch)
    ver = np.asarray(lg, np.float32).reshape(1, W, -1)[0]
    ver_states = [np.asarray(pools.kda_state[s]) for s in slots]
    return np.stack(dec), ver, np.stack(dec_states), np.stack(ver_states)
