"""Offline throughput and prefix-hit rate on a shared-prefix workload (prints one table).

  python scripts/bench_offline.py [--model tiny-random] [--requests 64] [--prefix 512] [--suffix 64] [--max-tokens 32]

Each request = one of a few long shared prefixes (a system prompt / document) + a unique suffix.
Runs the same workload with prefix caching off and on; reports output tok/s, total tok/s and the
fraction of prompt tokens served from the cache, and the on/off ratio (same run, same machine).

--turns K > 1: multi-turn chats instead: turn t+1 of a conversation is its turn-t prompt + answer +
a new --suffix of user tokens (what a chat client or an agent loop sends). Adds a row with
prefix caching on but without keeping finished requests' final state (`cache_finished_state`).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def workload(n: int, prefix: int, suffix: int, vocab: int, n_prefixes: int = 4, seed: int = 0):
    rng = np.random.RandomState(seed)
    prefixes = [rng.randint(0, vocab, prefix).tolist() for _ in range(n_prefixes)]
    return [prefixes[i % n_prefixes] + rng.randint(0, vocab, suffix).tolist() for i in range(n)]


def run(model, prompts, args, caching: bool, final_state: bool = True):
    from k3jax.offline import LLM, SamplingParams
    turns = max(args.turns, 1)
    llm = LLM(model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.prefix + turns * (args.suffix + args.max_tokens) + 16, enable_prefix_caching=caching,
              cache_finished_state=final_state, page_size=args.page_size, prefix_match_unit=16)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([[1] * len(prompts[0])] * 2, params)     # settle compilation outside the timing
    rng = np.random.RandomState(1)
    gen = prompt = cached = 0
    t0 = time.perf_counter()
    for _ in range(turns):
        outs = llm.generate(prompts, params)
        gen += sum(len(o.outputs[0].token_ids) for o in outs)
        prompt += sum(len(p) for p in prompts)
        cached += sum(o.num_cached_tokens for o in outs)
        prompts = [p + o.outputs[0].token_ids + rng.randint(0, 768, args.suffix).tolist() for p, o in zip(prompts, outs)]
    dt = time.perf_counter() - t0
    return dict(seconds=dt, out_tps=gen / dt, total_tps=(gen + prompt) / dt, hit=cached / prompt)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=None, help="random weights for presets without weights")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--turns", type=int, default=1, help="multi-turn chats (see the module docstring)")
    args = ap.parse_args()
    import jax
    from k3jax.api import load_model
    model = load_model(args.model, dtype=args.dtype, seed=args.seed)
    prompts = workload(args.requests, args.prefix, args.suffix, model.config.vocab_size)
    rows = [("off", run(model, prompts, args, caching=False))]
    if args.turns > 1:
        rows.append(("on, without final states", run(model, prompts, args, caching=True, final_state=False)))
    rows.append(("on", run(model, prompts, args, caching=True)))
    off, on = rows[0][1], rows[-1][1]
    dev = jax.devices()[0]
    print(f"\n# bench_offline  {datetime.date.today()}  {dev.platform}:{dev.device_kind}  host={platform.node()}")
    print(f"model={args.model} requests={args.requests} turns={args.turns} prompt={args.prefix}+{args.suffix} "
          f"out={args.max_tokens} "
          f"max_num_seqs={args.max_num_seqs} budget={args.max_num_batched_tokens}")
    print(f"| prefix caching | seconds | output tok/s | total tok/s | prompt tokens from cache |")
    print(f"|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['seconds']:.2f} | {r['out_tps']:.1f} | {r['total_tps']:.1f} | {r['hit']:.1%} |")
    print(f"speed-up on/off (total tok/s): {on['total_tps'] / off['total_tps']:.2f}x")


if __name__ == "__main__":
    main()
