"""/health latency while hostile requests run: large bodies and slow clients (one table).

  python -m benchmarks.bench_health_under_load [--model tiny] [--slow-connections 1000] [--csv PATH] [-- SERVE FLAGS]

Starts `python -m k3jax.serve` (--no-warmup, every other setting at its default unless given after --),
then for each scenario sends the request (or opens the connections) while another thread probes
GET /health on a fresh connection every 10 ms, and reports the request's status and seconds and the
probes' p50 / p99 / max latency. Scenarios: the large requests of a denial-of-service report (a
29.8 MiB /tokenize prompt, /detokenize of 10M ids, a 5M-id completion prompt, 200,000 chat messages;
all under the 32 MiB body limit, all refused for the context), the largest that still fit (real
tokenizing / detokenizing work), and slow clients: connections that send half a request and then a
byte a second (the header deadline closes them).
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from benchmarks.bench_disagg import free_port, wait_ready
from benchmarks.harness import Table, add_csv_argument, header


def post_raw(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, body, {"content-type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()


class HealthProbe:
    """GET /health on a fresh connection every `period` seconds until stopped: the latencies."""

    def __init__(self, port: int, period: float = 0.01):
        self.port, self.period, self.latencies, self.failures = port, period, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                c.request("GET", "/health")
                ok = c.getresponse().status == 200
                c.close()
            except OSError:
                ok = False
            dt = time.perf_counter() - t0
            if ok:
                self.latencies.append(dt)
            else:
                self.failures += 1
            self._stop.wait(max(0.0, self.period - dt))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def stats(self) -> dict:
        lat = np.array(self.latencies) * 1000
        if not len(lat):
            return {"probes": 0, "failed": self.failures}
        return {"probes": len(lat), "failed": self.failures, "p50_ms": float(np.percentile(lat, 50)),
                "p99_ms": float(np.percentile(lat, 99)), "max_ms": float(lat.max())}


def large_requests(port: int, max_model_len: int, max_chars: int):
    """(name, path, body bytes) of each large-request scenario."""
    msg = json.dumps({"role": "user", "content": "hi"})
    yield "/tokenize 29.8 MiB prompt", "/tokenize", json.dumps({"prompt": "a" * int(29.8 * 2**20)}).encode()
    yield "/detokenize 10M ids", "/detokenize", b'{"tokens": [' + b",".join([b"0"] * 10_000_000) + b"]}"
    yield "/v1/completions 5M-id prompt", "/v1/completions", \
        b'{"max_tokens": 1, "prompt": [' + b",".join([b"1"] * 5_000_000) + b"]}"
    yield "/v1/chat/completions 200,000 messages", "/v1/chat/completions", \
        ('{"max_tokens": 1, "messages": [' + ",".join([msg] * 200_000) + "]}").encode()
    words = ("lorem ipsum dolor sit amet " * (max_chars // 27 + 1))[:max_chars]
    yield f"/tokenize {len(words):,}-character prompt (fits the cheap limit)", "/tokenize", \
        json.dumps({"prompt": words}).encode()
    yield f"/detokenize {max_model_len:,} ids (fits)", "/detokenize", \
        json.dumps({"tokens": [i % 700 for i in range(max_model_len)]}).encode()
    yield f"/tokenize {max_model_len - 1:,} messages (fits the cheap limit)", "/tokenize", \
        ('{"messages": [' + ",".join([msg] * (max_model_len - 1)) + "]}").encode()


def slow_clients(port: int, n: int, seconds: float) -> dict:
    """n connections that send half a request, then a byte a second: how many the server closed."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.setblocking(False)
        socks.append(s)
    closed = set()
    deadline = time.time() + seconds
    while time.time() < deadline and len(closed) < n:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                if s.recv(65536) == b"":
                    closed.add(i)
                    continue
            except BlockingIOError:
                pass
            except OSError:
                closed.add(i)
                continue
            try:
                s.send(b"X")
            except OSError:
                closed.add(i)
        time.sleep(1.0)
    for s in socks:
        s.close()
    return {"closed": len(closed)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--slow-connections", type=int, default=1000)
    ap.add_argument("--slow-seconds", type=float, default=40.0,
                    help="how long the slow clients trickle (past the server's --header-timeout, 20 s by default)")
    ap.add_argument("--server-pythonpath", default=None,
                    help="PYTHONPATH of the server process (another checkout, e.g. to measure a baseline)")
    add_csv_argument(ap)
    ap.add_argument("serve_flags", nargs="*", help="after --: more `k3jax.serve` flags")
    args = ap.parse_args()

    port = free_port()
    log_path = f"/tmp/bench_health_under_load_{port}.log"
    cmd = [sys.executable, "-m", "k3jax.serve", "--model", args.model, "--port", str(port), "--no-warmup",
           "--log-level", "warning", *args.serve_flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.server_pythonpath:
        env["PYTHONPATH"] = args.server_pythonpath
    # (-m puts the working directory first on the path: run in the server's checkout)
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env,
                            cwd=args.server_pythonpath or None)
    try:
        wait_ready(port, proc, log_path, timeout=900)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("GET", "/v1/models")
        max_model_len = json.loads(c.getresponse().read())["data"][0]["max_model_len"]
        from k3jax.api import load_model                 # the cheap limit's characters: the served tokenizer's
        from serving.openai.request_body import max_token_chars
        max_chars = max_model_len * max_token_chars(load_model(args.model).tokenizer)

        print(header("bench_health_under_load", devices=False))
        print(f"server: {' '.join(cmd[1:])} (max_model_len {max_model_len}"
              f"{', PYTHONPATH ' + args.server_pythonpath if args.server_pythonpath else ''})"
              f"\nload average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
        table = Table(("scenario", "scenario"), ("status", "status"), ("seconds", "request s", ".2f"),
                      ("probes", "/health probes"), ("failed", "failed"), ("p50_ms", "p50 ms", ".1f"),
                      ("p99_ms", "p99 ms", ".1f"), ("max_ms", "max ms", ".1f"))
        print(table.header())
        with HealthProbe(port) as probe:         # nothing running: the baseline
            time.sleep(3)
        print(table.add(scenario="idle", status=None, seconds=None, **probe.stats()), flush=True)
        for name, path, body in large_requests(port, max_model_len, max_chars):
            with HealthProbe(port) as probe:
                t0 = time.perf_counter()
                status, _ = post_raw(port, path, body)
                seconds = time.perf_counter() - t0
            print(table.add(scenario=f"{name} ({len(body) / 2**20:.1f} MiB)", status=status, seconds=seconds,
                            **probe.stats()), flush=True)
        if args.slow_connections:
            # the clients in a process of their own: their loop would otherwise hold this one's GIL from the probe
            with HealthProbe(port) as probe, multiprocessing.get_context("spawn").Pool(1) as pool:
                t0 = time.perf_counter()
                closed = pool.apply(slow_clients, (port, args.slow_connections, args.slow_seconds))["closed"]
                seconds = time.perf_counter() - t0
            print(table.add(scenario=f"{args.slow_connections} slow-header connections ({closed} closed by the "
                            "server)", status=None, seconds=seconds, **probe.stats()), flush=True)
        if args.csv:
            table.write_csv(args.csv)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
