"""Test helper: run `python -m k3jax.serve` in a subprocess on a free loopback port."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx

from tests.support import ROOT

API_KEY = "test-key"
SERVE_WITH_HOOKS = [sys.executable, "-m", "tests.support.serve_with_hooks"]      # run from ROOT
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120, **kw)


def assert_openai_error(r, status, param=None, needle=None):
    """r is an OpenAI-shaped error with this status (and param / a needle in its message); returns it."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if needle is not None:
        assert needle in err["message"], err
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, tmp_dir, *extra_args, timeout: float = 300.0, compilation_cache_dir: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp_dir, f"server-{self.port}.log")
        env = dict(os.environ, XLA_FLAGS="", PYTHONUNBUFFERED="1")
        # a small cache (16 MiB, not CPU's 256 MiB default): a CPU step's time grows with the pools'
        # size (a decode step of the tiny models: ~0.4 s at 256 MiB, ~0.08 s at 32 MiB)
        # (compilation_cache_dir: one shared by the session's servers of one model and pools, so that only the
        # first one's warm-up compiles: tests/conftest.py's xla_cache_dir)
        self.compilation_cache_dir = compilation_cache_dir or os.path.join(tmp_dir, "xla")
        # (the real server with the scripted-output hook installed: tests/support/serve_with_hooks.py)
        cmd = [*SERVE_WITH_HOOKS, "--model", "tiny-random", "--port", str(self.port), "--max-model-len", "512",
               "--api-key", API_KEY, "--compilation-cache-dir", self.compilation_cache_dir,
               "--log-level", "warning", "--cache-memory-mb", "16", *extra_args]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# Tools whose every argument is bounded (an enum, a short string, a small integer, a boolean): a model
# that writes noise (tiny-random) still ends a grammar-constrained call within a few dozen tokens.
BOUNDED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
                       "metric": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "required": ["tz"], "additionalProperties": False,
        "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}}}}}]


def chat_tool_calls(client, stream: bool, **kw) -> tuple[list, str]:
    """([(name, arguments text)], finish_reason) of a one-choice chat completion, streamed or not."""
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        return [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []], c.finish_reason
    calls, finish = {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, ["", ""])
                slot[0] += (tc.function.name or "") if tc.function else ""
                slot[1] += (tc.function.arguments or "") if tc.function else ""
    return [tuple(v) for _, v in sorted(calls.items())], finish


def assert_declared_calls(calls: list, tools: list) -> None:
    """At least one call; each names a declared tool and has JSON arguments valid for its schema."""
    import jsonschema
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in schemas, (name, calls)
        jsonschema.validate(json.loads(arguments), schemas[name])
