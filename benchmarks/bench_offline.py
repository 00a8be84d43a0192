"""Offline throughput and prefix-hit rate on a shared-prefix workload (prints one table).

  python -m benchmarks.bench_offline [--model tiny-random] [--requests 64] [--prefix 512] [--suffix 64] [--max-tokens 32]

Each request = one of a few long shared prefixes (a system prompt / document) + a unique suffix.
Runs the same workload with prefix caching off and on; reports output tok/s, total tok/s and the
fraction of prompt tokens served from the cache, and the on/off ratio (same run, same machine).

--turns K > 1: multi-turn chats instead: turn t+1 of a conversation is its turn-t prompt + answer +
a new --suffix of user tokens (what a chat client or an agent loop sends). Adds a row with
prefix caching on but without keeping finished requests' final state (`cache_finished_state`).

Rows (--rows, default all that apply): `off`; `at-once`: caching on, every request admitted as soon as
there is room (prefix_wait_steps 0: requests admitted while their group's prefix is still being computed
compute it again); `no-final-state` (--turns > 1 only); `on`: the engine's defaults (prefix-aware
admission); `verify` (only with --verify F): `on` that also recomputes a fraction F of its hits in the
background (--verify-prefix-cache) and reports checks, mismatches and the largest log-probability distance;
`host` (only with --host-cache-mb M): `on` with an M MiB host-memory tier for evicted checkpoints (with
--cache-mb small enough that the device cache evicts, e.g. multi-turn chats whose history outgrows it).

The shared-prefix workload of docs/performance.md (8 groups x 8 requests, 3072 shared + 64 own tokens, arriving group by group):
  python -m benchmarks.bench_offline --model kimi-linear-48b-a3b --seed 0 --dtype bfloat16 --requests 64 --groups 8 \
      --grouped --prefix 3072 --suffix 64 --max-tokens 16 --max-num-seqs 64 --max-num-batched-tokens 4096 --rows at-once,on
"""
from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from benchmarks.harness import Table, add_csv_argument, header, write_json


def workload(n: int, prefix: int, suffix: int, vocab: int, n_prefixes: int = 4, seed: int = 0, grouped: bool = False):
    """n prompts over n_prefixes shared prefixes: round robin, or (grouped) each prefix's requests in a row."""
    rng = np.random.RandomState(seed)
    prefixes = [rng.randint(0, vocab, prefix).tolist() for _ in range(n_prefixes)]
    per = -(-n // n_prefixes)
    return [prefixes[i // per if grouped else i % n_prefixes] + rng.randint(0, vocab, suffix).tolist()
            for i in range(n)]


ROWS = {"off": dict(enable_prefix_caching=False), "at-once": dict(prefix_wait_steps=0),
        "no-final-state": dict(cache_finished_state=False), "on": {}, "verify": {}, "host": {}}


def run(model, prompts, args, **engine_args):
    from k3jax.offline import LLM, SamplingParams
    turns = max(args.turns, 1)
    llm = LLM(model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.prefix + turns * (args.suffix + args.max_tokens) + 16, page_size=args.page_size,
              prefix_match_unit=16, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.engine.wait_for_compiles()                        # the background compile, then the first runs,
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
    st = llm.engine.stats()
    return dict(seconds=dt, out_tps=gen / dt, total_tps=(gen + prompt) / dt, hit=cached / prompt,
                **{k: v for k, v in st.items() if k.startswith(("prefix_verify", "host_"))})


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
    ap.add_argument("--groups", type=int, default=4, help="distinct shared prefixes")
    ap.add_argument("--grouped", action="store_true", help="each prefix's requests arrive together (default: round robin)")
    ap.add_argument("--rows", default=None, help=f"comma list of {','.join(ROWS)} (default: all that apply)")
    ap.add_argument("--verify", type=float, default=0.0, help="--verify-prefix-cache fraction of the `verify` row")
    ap.add_argument("--cache-mb", type=int, default=None, help="device cache budget in MiB (default: the engine's)")
    ap.add_argument("--host-cache-mb", type=int, default=0, help="host-memory tier of the `host` row, in MiB")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    add_csv_argument(ap)
    args = ap.parse_args()
    ROWS["verify"] = dict(verify_prefix_cache=args.verify)
    ROWS["host"] = dict(host_cache_bytes=args.host_cache_mb << 20)
    if args.cache_mb:
        for r in ROWS.values():
            r["cache_memory_bytes"] = args.cache_mb << 20
    names = args.rows.split(",") if args.rows else [r for r in ROWS if (r != "no-final-state" or args.turns > 1)
                                                    and (r != "verify" or args.verify)
                                                    and (r != "host" or args.host_cache_mb)]
    if not set(names) <= set(ROWS):
        ap.error(f"--rows: unknown {sorted(set(names) - set(ROWS))}; choose from {list(ROWS)}")
    from k3jax.api import load_model
    model = load_model(args.model, dtype=args.dtype, seed=args.seed)
    prompts = workload(args.requests, args.prefix, args.suffix, model.config.vocab_size, args.groups,
                       grouped=args.grouped)
    print("\n" + header("bench_offline: the offline engine, prefix caching off and on"))
    print(f"model={args.model} requests={args.requests} groups={args.groups}{' grouped' if args.grouped else ''} "
          f"turns={args.turns} prompt={args.prefix}+{args.suffix} out={args.max_tokens} "
          f"max_num_seqs={args.max_num_seqs} budget={args.max_num_batched_tokens}")
    table = Table(("prefix_caching", "prefix caching"), ("seconds", "seconds", ".2f"),
                  ("output_tok_s", "output tok/s", ".1f"), ("total_tok_s", "total tok/s", ".1f"),
                  ("hit_rate", "prompt tokens from cache", ".1%"))
    print(table.header(), flush=True)
    rows = []
    for name in names:              # each row as it finishes (a long run cut short keeps what it measured)
        r = run(model, prompts, args, **ROWS[name])
        gc.collect()                # the row's engine and its cache pools go before the next one allocates
        rows.append((name, r))
        print(table.add(prefix_caching=name, seconds=r["seconds"], output_tok_s=r["out_tps"],
                        total_tok_s=r["total_tps"], hit_rate=r["hit"]), flush=True)
    by = dict(rows)
    for a, b in (("on", "off"), ("on", "at-once")):
        if a in by and b in by:
            print(f"speed-up {a}/{b} (total tok/s): {by[a]['total_tps'] / by[b]['total_tps']:.2f}x")
    if "prefix_verify_checks" in by.get("verify", {}):
        v = by["verify"]
        print(f"verify: {v['prefix_verify_checks']} checks, {v['prefix_verify_mismatches']} mismatches, "
              f"{v['prefix_verify_skipped']} skipped, largest distance {v['prefix_verify_max_distance']:.3g}")
    if "host" in by:
        h = by["host"]
        print(f"host tier: {h.get('host_saved', 0)} checkpoints saved, {h.get('host_restored', 0)} copied back, "
              f"{h.get('host_evicted', 0)} dropped, {h.get('host_bytes', 0) / 2**20:.1f} MiB held at the end")
    if args.csv:
        table.write_csv(args.csv)
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": dict(rows)})


if __name__ == "__main__":
    main()
