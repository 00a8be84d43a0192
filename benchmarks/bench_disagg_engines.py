"""Prefill/decode disaggregation between two engine processes, without the HTTP server (prints one table).

  python -m benchmarks.bench_disagg_engines --model kimi-linear-48b-a3b --seed 0 --layers 8 --requests 4 --input 2048 [--csv PATH]

For machines without fastapi / uvicorn (benchmarks/bench_disagg.py measures the served path). A child
process holds the prefill engine; this process holds the decode engine. Per prompt, the decode side
sends the token ids over a multiprocessing pipe (control only), the child computes the prompt, offers
its cache entry on its jax.experimental.transfer server and answers with the entry's description; the
decode side pulls it (serving/kv_transfer.py), indexes it and steps until the first token. Reports the
time to first token of that path and of the decode engine prefilling fresh prompts itself, the bytes
pulled and the pull rate. Each process gets --mem-fraction of the device memory.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

from benchmarks.bench_disagg import print_ttft_table
from benchmarks.harness import add_csv_argument, header


def make_engine(args, host_cache_bytes: int = 0):
    from k3jax.api import load_model
    from serving.engine import LLMEngine
    from serving.engine_args import EngineArgs
    name = args.model
    if args.layers:
        from bench_e2e import truncated_preset
        name = truncated_preset(name, args.layers)
    model = load_model(name, dtype=args.dtype, seed=args.seed)
    return LLMEngine(model, EngineArgs(max_num_seqs=8, max_num_batched_tokens=args.budget,
                                       max_model_len=args.input + args.max_tokens + 64, warmup=False, vision=False,
                                       host_cache_bytes=host_cache_bytes))


def first_token(engine, prompt, rid: str, max_tokens: int = 1) -> float:
    """Seconds until the request's first token (the caller has done whatever precedes admission)."""
    from serving.sampling_params import SamplingParams
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                       request_id=rid)
    ttft = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and ttft is None:
                ttft = time.perf_counter() - t0
    return ttft


def prefill_process(args, conn):
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
    from serving.kv_transfer import Transport, export_prefix
    engine = make_engine(args)
    transport = Transport()
    conn.send("ready")
    n = 0
    while True:
        prompt = conn.recv()
        if prompt is None:
            return
        n += 1
        first_token(engine, prompt, f"p{n}")
        res = export_prefix(engine, prompt)
        if res is None:
            conn.send({"num_tokens": 0})
            continue
        desc, flat = res
        conn.send({**desc, "uuid": transport.offer(flat), "address": transport.address})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=None, help="random weights for presets without weights")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers of the preset (0 = all)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens of both engines")
    ap.add_argument("--mem-fraction", type=float, default=0.45, help="device memory share of each process")
    ap.add_argument("--json", default=None)
    add_csv_argument(ap)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_process, args=(args, child), daemon=True)
    proc.start()
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
    import numpy as np
    from serving.kv_transfer import Transport, import_prefix
    engine = make_engine(args, host_cache_bytes=4 << 30)
    transport = Transport()
    if parent.recv() != "ready":
        raise RuntimeError("prefill process failed")
    rng = np.random.RandomState(0)
    vocab = engine.model.config.vocab_size
    prompts = [rng.randint(1, min(vocab, 100000), args.input).tolist() for _ in range(2 * args.requests + 4)]
    rows = {"disaggregated": [], "local": []}
    pulled = pull_s = 0.0
    try:
        for i, p in enumerate(prompts):
            warm = i < 4                         # two untimed requests per path compile their shapes
            remote = i % 2 == 0
            t0 = time.perf_counter()
            if remote:
                parent.send(p)
                desc = parent.recv()
                if not desc["num_tokens"]:
                    raise RuntimeError("the prefill side cached nothing for the prompt")
                t1 = time.perf_counter()
                flat = transport.fetch(desc["address"], desc["uuid"], desc)
                t2 = time.perf_counter()
                if not import_prefix(engine, p, desc, flat):
                    raise RuntimeError("the prefill side's entry was not kept")
            ttft = time.perf_counter() - t0 + first_token(engine, p, f"d{i}", args.max_tokens)
            if not warm:
                rows["disaggregated" if remote else "local"].append(ttft)
                if remote:
                    pulled += desc["nbytes"]
                    pull_s += t2 - t1
    finally:
        parent.send(None)
        proc.join(30)
    print("\n" + header("bench_disagg_engines: TTFT with the prompt prefilled by another engine process vs locally"))
    print(f"model={args.model} layers={args.layers or 'all'} requests={args.requests} input={args.input} "
          f"out={args.max_tokens} budget={args.budget} mem_fraction={args.mem_fraction} (each process)")
    table = print_ttft_table(rows)
    n = len(rows["disaggregated"])
    print(f"pulled {pulled / n / 2**20:.2f} MiB a request at {pulled / pull_s / 2**30:.2f} GiB/s "
          f"({1000 * pull_s / n:.2f} ms a request)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ttft": rows, "pulled_bytes": pulled, "pull_s": pull_s}, f, indent=1)
    if args.csv:
        table.write_csv(args.csv)


if __name__ == "__main__":
    main()
