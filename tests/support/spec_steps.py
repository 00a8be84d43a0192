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


def _tiny_linear():
    """Kimi-Linear's layer kinds and head counts (32 MLA heads: the Triton decode kernel; its unbounded KDA gate),
    tiny widths."""
    from k3jax.config import ModelConfig
    from k3jax.presets import preset_config_dict
    d = preset_config_dict("kimi-linear-48b-a3b")
    d.update(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=32,
             kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=256,
             moe_intermediate_size=64, num_experts=8, num_experts_per_token=2, bos_token_id=500, eos_token_id=501,
             pad_token_id=511, max_position_embeddings=8192,
             linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 32, "num_heads": 4,
                                 "short_conv_kernel_size": 4})
    return ModelConfig.from_dict(d)


def spec_model(name, kernels, dtype="float32"):
    """A test model for the verification tests: "tiny-random" / "tiny" or "tiny-linear" (_tiny_linear), on the
    backend detect(kernels) picks."""
    from k3jax import load_model
    from pallas_kernels.backend import detect
    if name in ("tiny-random", "tiny"):
        m = load_model(name, dtype=dtype)
    else:
        import jax.numpy as jnp
        from k3jax.api import Model, _place
        from k3jax.params import init_params_numpy
        c = _tiny_linear()
        m = Model(c, _place(init_params_numpy(c, 0, jnp.dtype(dtype)), None, c, detect()), None, name="tiny-linear",
                  backend=detect())
    m.backend = detect(kernels).replace(mxfp4_decoder=m.backend.mxfp4_decoder)
    return m
