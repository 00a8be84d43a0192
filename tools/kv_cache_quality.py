"""`python -m tools.kv_cache_quality`: what an FP8 MLA cache costs a model, against its 16-bit cache.

Text the model never trained on (the project's own docs/*.md, in name order) is cut into S windows of T + 1
tokens; each window is fed through the engine's step one token a step (teacher forcing: every token's
attention reads all earlier tokens from the paged cache, as decode does), once per cache dtype. Reported:
perplexity over the S * T next tokens with each cache, their ratio, and greedy agreement: the share of the
S * T positions where both caches pick the same next token (same context, so one disagreement does not
carry into the later positions).

    python -m tools.kv_cache_quality [--model tiny] [--seqs 16] [--tokens 256] [--dtype bfloat16] [--json]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def heldout_windows(tokenizer, seqs: int, tokens: int) -> np.ndarray:
    """[seqs, tokens + 1] token ids from docs/*.md (name order), windows back to back."""
    ids = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            ids += tokenizer.encode(f.read())
        if len(ids) >= seqs * (tokens + 1):
            break
    need = seqs * (tokens + 1)
    if len(ids) < need:
        raise ValueError(f"docs/*.md holds {len(ids)} tokens, fewer than {need}")
    return np.asarray(ids[:need], np.int32).reshape(seqs, tokens + 1)


def score(model, windows: np.ndarray, kv_cache_dtype: str, page_size: int = 16):
    """(next-token NLL [S, T] fp64, argmax [S, T]) of each window's tokens 1..T, fed one token a step through
    the engine's step on pools of `kv_cache_dtype` (an EngineArgs value)."""
    import jax
    import jax.numpy as jnp
    from k3jax.cache import SeqChunk, make_pools, make_step_batch
    from k3jax.layer_stack import stack_layers
    from k3jax.nnx_model import K3Model, make_step, split_model
    from pallas_kernels.backend import resolve
    from serving.engine_args import EngineArgs

    c = model.config
    backend = resolve(getattr(model, "backend", None))
    weight_dtype = model.params["embed"].dtype
    args = EngineArgs(kv_cache_dtype=kv_cache_dtype)
    S, T1 = windows.shape
    per_seq = -(-T1 // page_size)
    pools = make_pools(c, S * per_seq + 1, page_size, S + 1, args.cache_dtype(weight_dtype), bits=backend.pool_bits,
                       mla_dtype=args.mla_cache_dtype(weight_dtype))
    graph, params = split_model(K3Model(c, stack_layers(model.params, c)))
    step = jax.jit(make_step(c, backend, graph), donate_argnums=(1,))
    nll = np.zeros((S, T1 - 1))
    top = np.zeros((S, T1 - 1), np.int32)
    pages = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(S)]
    for t in range(T1 - 1):
        # each sequence resumes from its own slot, zero at t = 0 (a fresh state): every step is one decode shape
        chunks = [SeqChunk([int(windows[s, t])], t, pages[s], s + 1, s + 1) for s in range(S)]
        batch = make_step_batch(chunks, page_size, max_pages=per_seq)
        logits, pools = step(params, pools, jax.tree_util.tree_map(jnp.asarray, batch))
        logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), np.float64)
        nll[:, t] = -logp[np.arange(S), windows[:, t + 1]]
        top[:, t] = logp.argmax(-1)
    return nll, top


def compare(model, seqs: int, tokens: int, base: str = "auto", test: str = "fp8_e4m3") -> dict:
    windows = heldout_windows(model.tokenizer, seqs, tokens)
    nll_b, top_b = score(model, windows, base)
    nll_t, top_t = score(model, windows, test)
    ppl_b, ppl_t = math.exp(nll_b.mean()), math.exp(nll_t.mean())
    return {"seqs": seqs, "tokens": tokens, f"ppl_{base}": ppl_b, f"ppl_{test}": ppl_t,
            "ppl_ratio": ppl_t / ppl_b, "greedy_agreement": float((top_b == top_t).mean())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.kv_cache_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="bfloat16", help="the weights' (the 16-bit cache takes it)")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from k3jax import load_model
    model = load_model(args.model, dtype=args.dtype)
    res = {"model": args.model, "dtype": args.dtype, **compare(model, args.seqs, args.tokens)}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{args.model} ({args.dtype} weights), {args.seqs} x {args.tokens} held-out tokens: perplexity "
              f"{res['ppl_auto']:.4f} (16-bit cache) vs {res['ppl_fp8_e4m3']:.4f} (fp8_e4m3), ratio "
              f"{res['ppl_ratio']:.5f}; greedy agreement {100 * res['greedy_agreement']:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
