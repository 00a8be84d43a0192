"""`python -m k3jax.generate`: complete a prompt with a model (the embedded tiny one by default).

A simple loop over the cache-aware model step: chunked prefill, then one decode step per token.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.cache import SeqChunk, make_pools, make_step_batch
from k3jax.model import forward_step

PAGE_SIZE = 16
PREFILL_CHUNK = 128


def _pages_for(n_tokens: int) -> int:
    return -(-n_tokens // PAGE_SIZE)


def generate_ids(model, prompt_ids, max_tokens: int = 32, temperature: float = 0.0, seed: int = 0,
                 stop_ids=()) -> list[int]:
    """Greedy (temperature 0) or sampled continuation of one prompt. Returns the new token ids."""
    prompt = model.check_tokens(prompt_ids, ndim=1)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    c = model.config
    total = len(prompt) + max_tokens
    if total > c.max_position_embeddings:
        raise ValueError(f"prompt + max_tokens = {total} exceeds the context length {c.max_position_embeddings}")
    n_pages = _pages_for(total)
    pages = list(range(1, n_pages + 1))
    pools = make_pools(c, n_pages + 1, PAGE_SIZE, 2, model.dtype)
    step = jax.jit(lambda p, pools, b: forward_step(p, c, pools, b), donate_argnums=1)
    bucket = dict(num_seqs=1, max_pages=n_pages)
    key = jax.random.key(seed)
    done = 0
    logits = None
    while done < len(prompt):
        chunk = prompt[done:done + PREFILL_CHUNK]
        batch = make_step_batch([SeqChunk(chunk, done, pages, 1 if done else -1, 1)], PAGE_SIZE,
                                num_tokens=PREFILL_CHUNK, **bucket)
        logits, pools = step(model.params, pools, batch)
        done += len(chunk)
    out: list[int] = []
    while True:
        if temperature <= 0:
            tok = int(jnp.argmax(logits[0]))
        else:
            key, sub = jax.random.split(key)
            tok = int(jax.random.categorical(sub, logits[0] / temperature))
        out.append(tok)
        if tok in stop_ids or len(out) >= max_tokens:
            return out
        batch = make_step_batch([SeqChunk([tok], done, pages, 1, 1)], PAGE_SIZE, num_tokens=1, **bucket)
        logits, pools = step(model.params, pools, batch)
        done += 1


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m k3jax.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset name or checkpoint directory (default: tiny)")
    ap.add_argument("--prompt", default="Hello", help="prompt text")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default) or float32")
    args = ap.parse_args(argv)
    from k3jax.api import load_model
    try:
        model = load_model(args.model, dtype=args.dtype)
        tok = model.tokenizer
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer")
        if args.chat:
            ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True)
        else:
            ids = tok.encode(args.prompt)
        t0 = time.perf_counter()
        out = generate_ids(model, ids, args.max_tokens, args.temperature, args.seed, stop_ids=set(tok.stop_ids))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    print(tok.decode(out, skip_special=True))
    print(f"[{len(ids)} prompt tokens, {len(out)} generated in {dt:.2f}s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
