"""`k3jax.serve` with every default, cold and restarted: time to ready, then a few real requests (one table).

  python -m benchmarks.bench_serve_start --model kimi-linear-48b-a3b --seed 0 [--json PATH] [--csv PATH]

Starts the server twice with only --model / --seed / --port / --compilation-cache-dir given (every engine
and memory setting at its default): first with an empty compilation cache (cold), then again over the
cache the first run filled (restart). For each start: seconds from launch to /health answering 200 (ready),
a chat completion served then (while programs may still compile in the background), seconds from launch until
/metrics reports no program pending (all compiled), the warm-up's own figures from the log, the cache pools
it sized, then: 16 concurrent streamed 1024-token completions (mean / max time to first token and output
tok/s, steady state: after every program compiled), a bad request (must be a 4xx) and /metrics. A preset
without a tokenizer gets the tiny model's, its vocabulary cut to match (as in bench_disagg.py: prompts are
token ids; the layers and the cache do not depend on it).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.bench_disagg import free_port, wait_ready
from benchmarks.harness import ROOT, Table, add_csv_argument, header


def post(port: int, path: str, body: dict, timeout: float = 600) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()


def stream_completion(port: int, prompt: list, max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token event, seconds to [DONE], tokens) of one streamed completion. Tokens come
    from the final usage chunk: under load the server coalesces several tokens into one event, so counting
    events undercounts."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {r.read()[:300]!r}")
    first, tokens = None, None
    for line in r:
        if line.strip() == b"data: [DONE]":
            break
        if line.startswith(b"data:"):
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                first = first or time.perf_counter() - t0
    if tokens is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return first, time.perf_counter() - t0, tokens


def metric(port: int, name: str) -> float:
    """A gauge's value from /metrics (nan when absent)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([-\d.e+]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def wait_compiled(port: int, timeout: float) -> float:
    """Poll the background compile's gauge until no program is pending; the programs left at the first poll."""
    first, t_end = None, time.perf_counter() + timeout
    while time.perf_counter() < t_end:
        pending = metric(port, "k3jax:compiles_pending")
        first = pending if first is None else first
        if not pending > 0:            # 0, or nan: a server without the gauge
            return first
        time.sleep(0.5)
    raise TimeoutError(f"programs still compiling after {timeout:.0f}s")


def one_start(args, cache_dir: str, log_path: str) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.bench_disagg", "_serve", "--layers", "0", "--",
           "--model", args.model, "--port", str(port), "--compilation-cache-dir", cache_dir]
    if args.seed is not None:
        cmd += ["--seed", str(args.seed)]
    cmd += args.serve_flag
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=ROOT)
    row = {}
    try:
        wait_ready(port, proc, log_path, args.start_timeout)
        row["ready_s"] = time.perf_counter() - t0
        t = time.perf_counter()
        status, body = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                                           "max_tokens": 8})
        row["chat_status"], row["chat_s"] = status, time.perf_counter() - t
        row["pending_at_ready"] = wait_compiled(port, args.start_timeout)
        row["all_compiled_s"] = time.perf_counter() - t0
        rng = np.random.RandomState(0)
        prompts = [rng.randint(1, 1000, args.input).tolist() for _ in range(args.concurrency)]
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:
            res = list(ex.map(lambda p: stream_completion(port, p, args.output), prompts))
        wall = time.perf_counter() - t
        row["mean_ttft_s"] = sum(r[0] for r in res) / len(res)
        row["max_ttft_s"] = max(r[0] for r in res)
        row["output_tok_s"] = sum(r[2] for r in res) / wall
        row["bad_request_status"] = post(port, "/v1/completions", {"prompt": "x", "max_tokens": -3})[0]
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/metrics")
        row["metrics_status"] = c.getresponse().status
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    log = open(log_path, errors="replace").read()
    for key, pattern in (("warmup_s", r"warm-up: (?:\d+ step shapes compiled|ready) in ([\d.]+)s"),
                         ("programs_at_ready", r"ready in [\d.]+s with (\d+) of \d+ programs"),
                         ("background_s", r"background compile: all \d+ programs in ([\d.]+)s"),
                         ("lowering_s", r"\(lowering ([\d.]+)s"), ("compiling_s", r"compiling ([\d.]+)s,"),
                         ("first_runs_s", r"first runs ([\d.]+)s\)"), ("pages", r"(\d+) pages of"),
                         ("slots", r"(\d+) KDA state slots"),
                         ("programs_loaded", r"executable cache: (\d+) of \d+ step programs loaded")):
        m = re.search(pattern, log)
        row[key] = float(m.group(1)) if m else float("nan")
    row["tracebacks_in_log"] = log.count("Traceback")
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seed", type=int, default=None, help="random weights for presets without weights")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input", type=int, default=1024)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                    help="an extra k3jax.serve flag, repeatable (e.g. --serve-flag=--no-background-compile)")
    ap.add_argument("--json", default=None)
    add_csv_argument(ap)
    args = ap.parse_args(argv)
    cache_dir = tempfile.mkdtemp(prefix="k3jax-serve-cache-")
    logs = os.environ.get("OUT") or tempfile.gettempdir()
    table = Table(("start", "start"), ("ready_s", "ready s", ".1f"), ("all_compiled_s", "all compiled s", ".1f"),
                  ("chat_s", "chat s (at ready)", ".2f"), ("programs_at_ready", "programs at ready", ".0f"),
                  ("pending_at_ready", "programs pending at ready", ".0f"),
                  ("warmup_s", "warm-up s (log)", ".1f"), ("background_s", "background done s (log)", ".1f"),
                  ("lowering_s", "lowering s", ".1f"), ("compiling_s", "compiling s", ".1f"),
                  ("first_runs_s", "first runs s", ".1f"),
                  ("programs_loaded", "programs loaded", ".0f"),
                  ("pages", "pages", ".0f"), ("slots", "slots", ".0f"), ("chat_status", "chat"),
                  ("mean_ttft_s", f"mean TTFT s (c{args.concurrency} x {args.input})", ".2f"),
                  ("max_ttft_s", "max TTFT s", ".2f"), ("output_tok_s", "output tok/s", ",.1f"),
                  ("bad_request_status", "bad request"), ("metrics_status", "/metrics"),
                  ("tracebacks_in_log", "tracebacks"))
    rows = []
    try:
        for start in ("cold (empty compilation cache)", "restart (cache filled)"):
            row = one_start(args, cache_dir, os.path.join(logs, f"serve_{len(rows)}.log"))
            rows.append(dict(row, start=start))
            print(f"{start}: {row}", flush=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    given = f", serve flags {' '.join(args.serve_flag)}" if args.serve_flag else ", every serve default"
    print("\n" + header(f"bench_serve_start: model={args.model} seed={args.seed}{given}", devices=False))
    print(table.header())
    for row in rows:
        print(table.add(**row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    if args.csv:
        table.write_csv(args.csv)


if __name__ == "__main__":
    main()
