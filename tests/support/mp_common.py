"""Shared settings of the multi-process tests and their subprocesses: the tiny model's greedy run,
and `python -m k3jax.serve` started as one process of a multi-host group."""
import os
import subprocess
import sys
import time

from tests.support import ROOT

# Three sequences of different lengths in one step: prefill of all three, then decodes.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [42, 42, 42, 42, 42]]
MAX_NEW = 6
# One 16-token bucket for prefill and decode: every run compiles the step once.
GEN = dict(page_size=16, bucket_tokens=16, pages_per_seq=2)
# 8 pages / 8 slots split evenly over data*expert (<= 8); page/slot 0 stays the sink.
POOL = dict(num_pages=8, page_size=16, num_slots=8)


def run_all(cmds, env, timeout: float = 200, before_wait=None) -> list:
    """Start one subprocess per command (from the repository root: `-m tests.support.X` resolves), run before_wait() meanwhile, wait for all, assert each
    exited 0 (showing its log otherwise) and return the logs; stragglers are killed."""
    procs = [subprocess.Popen(c, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    try:
        extra = before_wait() if before_wait else None
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return logs if before_wait is None else (logs, extra)


# ---------------------------------------------------------------------- multi-host servers

# Small pools and batches: every step compiles fast on CPU.
SERVE_ARGS = ["--model", "tiny-random", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "256",
              "--cache-memory-mb", "4", "--dtype", "float32", "--log-level", "info"]
XLA_FAST = "--xla_backend_optimization_level=0"      # halves CPU compile time; same flags for every server


def serve_env(devices: int, **extra) -> dict:
    """Environment of one server process: CPU with `devices` fake devices, no inherited K3JAX_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3JAX_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {XLA_FAST}", **extra)
    return env


def group_args(coordinator: str, num_processes: int, process_id: int) -> list:
    return ["--coordinator", coordinator, "--num-processes", str(num_processes), "--process-id", str(process_id)]


def start_server(tmp_path, name, args, env, fault: str | None = None):
    """(Popen, log path) of `python -m k3jax.serve ARGS`, output to tmp_path/NAME.log; fault: a
    PROCESS:STAGE:ACTION[:SKIP] fault injected through the test hooks (tests/support/serve_with_hooks.py)."""
    path = tmp_path / f"{name}.log"
    cmd = ([sys.executable, "-m", "tests.support.serve_with_hooks", "--fault", fault] if fault else [sys.executable, "-m", "k3jax.serve"])
    with open(path, "w") as log:
        proc = subprocess.Popen([*cmd, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return proc, path


def log_tail(path, n=3000) -> str:
    text = path.read_text()
    return "\n".join(line for line in text.splitlines() if not line.startswith("[Gloo]"))[-n:]


def wait_ready(url, procs, timeout):
    """Wait for url/health to answer 200; fail early (with the log) if a process of `procs` exits."""
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p, log in procs:
            if p.poll() is not None:
                raise AssertionError(f"{log.name} exited with {p.returncode}:\n{log_tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready in {timeout}s:\n" + "\n".join(log_tail(log) for _, log in procs))


def kill_all(procs):
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
