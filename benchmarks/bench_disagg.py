"""Prefill/decode disaggregation on one device: TTFT and cache-transfer rate (prints one table).

  python -m benchmarks.bench_disagg --model kimi-linear-48b-a3b --seed 0 --layers 8 --requests 8 --input 2048 [--csv PATH]

Starts `k3jax.serve --role prefill` and `--role decode --prefill-peer` as two processes sharing the
device (each gets --mem-fraction of its memory; warm-up is skipped, two untimed requests per path
compile what the timed ones use), then sends --requests prompts of --input random tokens one at a
time, streaming, to the decode server (disaggregated) and as many other prompts straight to the
prefill server (one ordinary server). Reports mean / median time to first token of each, the cache
bytes the decode server pulled and the transfer rate (bytes / time in jax.experimental.transfer),
and the peer's prefill time as the decode server saw it. --layers N keeps the first N layers of a
preset (two full Kimi-Linear-48B do not fit one H200).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.harness import ROOT, Table, add_csv_argument, header


def print_ttft_table(ttfts: dict) -> Table:
    """Mean and median time to first token of each path ({name: seconds per request}), printed; returns the
    table (for --csv)."""
    table = Table(("path", "path"), ("mean_ttft_s", "mean TTFT s", ".3f"), ("median_ttft_s", "median TTFT s", ".3f"))
    print(table.header())
    for name, xs in ttfts.items():
        print(table.add(path=name, mean_ttft_s=statistics.mean(xs), median_ttft_s=statistics.median(xs)))
    return table


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, port: int, role_args: list, log_path: str):
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(args.mem_fraction), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "benchmarks.bench_disagg", "_serve", "--layers", str(args.layers), "--",
           "--model", args.model, "--port", str(port), "--no-warmup", "--log-level", "warning",
           "--max-model-len", str(args.input + args.max_tokens + 64), "--max-num-seqs", "8",
           "--max-num-batched-tokens", str(args.budget), "--no-vision", *role_args]
    if args.seed is not None:
        cmd += ["--seed", str(args.seed)]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def wait_ready(port: int, proc, log_path: str, timeout: float):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on {port} exited:\n{open(log_path).read()[-3000:]}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server on {port} not ready in {timeout}s:\n{open(log_path).read()[-3000:]}")


def ttft(port: int, prompt: list, max_tokens: int) -> float:
    """Seconds from sending a streaming completion to its first token event."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {r.read()[:500]!r}")
    first = None
    for line in r:
        if line.startswith(b"data:") and first is None:
            first = time.perf_counter() - t0
        if line.strip() == b"data: [DONE]":
            break
    return first


def metrics(port: int) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    out = {}
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith("k3jax:") and "{" in line:
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def serve_role(argv):
    """`_serve --layers N -- serve args`: k3jax.serve with a truncated preset registered in this process. A preset
    without a tokenizer (random weights) gets the tiny model's, its vocabulary cut to match (prompts are token ids;
    the cache and the layers, what this measures, do not depend on the vocabulary)."""
    import k3jax.api as api
    import k3jax.presets as presets
    from k3jax.tokenizer import KimiTokenizer
    i = argv.index("--")
    layers, serve_args = int(argv[argv.index("--layers") + 1]), argv[i + 1:]
    m = serve_args.index("--model") + 1
    if layers:
        from benchmarks.bench_e2e import truncated_preset
        serve_args[m] = truncated_preset(serve_args[m], layers)
    if serve_args[m] != "tiny" and serve_args[m] in presets._PRESETS:
        d = presets.preset_config_dict(serve_args[m])
        d.get("text_config", d)["vocab_size"] = KimiTokenizer.tiny().vocab_size
        presets._PRESETS[serve_args[m]] = lambda d=d: d
    load = api.load_model

    def load_with_tokenizer(*a, **k):
        model = load(*a, **k)
        if model.tokenizer is None:
            model.tokenizer = KimiTokenizer.tiny()
        return model
    api.load_model = load_with_tokenizer
    from k3jax.serve import main
    return main(serve_args)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        return serve_role(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seed", type=int, default=None, help="random weights for presets without weights")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers of the preset (0 = all)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens of both servers")
    ap.add_argument("--mem-fraction", type=float, default=0.45, help="device memory share of each process")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--json", default=None)
    add_csv_argument(ap)
    args = ap.parse_args()
    tmp = os.environ.get("OUT") or "/tmp"
    pp, dp = free_port(), free_port()
    logs = [os.path.join(tmp, f"bench_disagg_{r}.log") for r in ("prefill", "decode")]
    procs = [start(args, pp, ["--role", "prefill"], logs[0]),
             start(args, dp, ["--role", "decode", "--prefill-peer", f"127.0.0.1:{pp}"], logs[1])]
    try:
        wait_ready(pp, procs[0], logs[0], args.start_timeout)
        wait_ready(dp, procs[1], logs[1], args.start_timeout)
        rng = np.random.RandomState(0)
        prompts = [rng.randint(1, 1000, args.input).tolist() for _ in range(2 * args.requests + 4)]
        for p in prompts[:2]:                     # compile the shapes the timed requests use, on both paths
            ttft(dp, p, args.max_tokens)
        for p in prompts[2:4]:
            ttft(pp, p, args.max_tokens)
        before = metrics(dp)
        disagg = [ttft(dp, p, args.max_tokens) for p in prompts[4:4 + args.requests]]
        after = metrics(dp)
        single = [ttft(pp, p, args.max_tokens) for p in prompts[4 + args.requests:]]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    d = {k: after.get(f"k3jax:{k}", 0) - before.get(f"k3jax:{k}", 0)
         for k in ("disagg_remote_prefills", "disagg_local_prefills", "disagg_peer_failures", "disagg_transfer_bytes",
                   "disagg_transfer_ms", "disagg_remote_prefill_ms")}
    print("\n" + header("bench_disagg: TTFT through a decode server with a prefill peer vs one server"))
    print(f"model={args.model} layers={args.layers or 'all'} requests={args.requests} input={args.input} "
          f"out={args.max_tokens} budget={args.budget} mem_fraction={args.mem_fraction} (each process)")
    table = print_ttft_table({"decode server, prefill peer (disaggregated)": disagg, "one server": single})
    print(f"remote prefills {d['disagg_remote_prefills']:.0f}, local {d['disagg_local_prefills']:.0f}, "
          f"peer failures {d['disagg_peer_failures']:.0f}; cache pulled {d['disagg_transfer_bytes'] / 2**20:.1f} MiB "
          f"({d['disagg_transfer_bytes'] / max(d['disagg_remote_prefills'], 1) / 2**20:.2f} MiB a request)")
    n = max(d["disagg_remote_prefills"], 1)
    rate = d["disagg_transfer_bytes"] / d["disagg_transfer_ms"] * 1e3 / 2**30 if d["disagg_transfer_ms"] else float("nan")
    print(f"transfer: {rate:.2f} GiB/s "
          f"({d['disagg_transfer_ms'] / n:.2f} ms a request, pull only); peer prefill as the decode server saw it "
          f"{d['disagg_remote_prefill_ms'] / n:.1f} ms a request")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ttft_disagg": disagg, "ttft_single": single, "metrics": d}, f, indent=1)
    if args.csv:
        table.write_csv(args.csv)


if __name__ == "__main__":
    sys.exit(main())
