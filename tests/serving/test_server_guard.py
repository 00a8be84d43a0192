"""The server against hostile clients: slow headers and bodies, too many connections, NUL bytes in image
paths, handler exceptions, large requests beside /health.

A live server on loopback, in this process: the real app (serving.openai.app.build_app) behind uvicorn with
the protocol and limits `python -m k3jax.serve` configures from its flags (k3jax.serve.uvicorn_config), with
tiny timeouts; the engine is a stub (none of these requests reaches it), so no model loads. Bounded: every
loop has a count and a generous deadline, and states are polled, never timed."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("uvicorn")

MAX_MODEL_LEN = 512
HEADER_TIMEOUT = 0.5
BODY_TIMEOUT = 1.0


class _Engine:
    """What the app asks of an engine outside generation."""
    alive, dead_reason, stats_snapshot = True, None, {}


class LiveServer:
    def __init__(self, tmp_path, *flags):
        import uvicorn
        from k3jax import serve
        from k3jax.tokenizer import KimiTokenizer
        from tests.support.server_fixture import free_port
        from serving.image_inputs import ImageLoader, ImagePolicy
        from serving.openai.app import build_app
        from serving.openai.generation import ServerState
        from serving.openai.metrics import Metrics

        (tmp_path / "ok.png").write_bytes(b"not really a png")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = serve.parse_args(["--port", str(self.port), "--log-level", "warning", *flags])
        # an image loader without a tower: a path is refused (or read) before the tower would see it
        self.state = ServerState(engine=_Engine(), tokenizer=KimiTokenizer.tiny(), model_name="m",
                                 max_model_len=MAX_MODEL_LEN, metrics=Metrics("m"),
                                 vision=ImageLoader(None, ImagePolicy(local_dir=str(tmp_path))))
        self.app = build_app(self.state)
        config = serve.uvicorn_config(self.app, args, self.state.metrics)
        config.timeout_keep_alive = 1          # (uvicorn's own idle timer, 5 s: a shorter wait where a test sees it)
        self.server = uvicorn.Server(config)
        self.state.metrics.connections = self.server.server_state.connections
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def metric(self, reason: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("k3jax:http_connections_closed_total{") and f'reason="{reason}"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(reason)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    s = LiveServer(tmp_path_factory.mktemp("guard"), "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout",
                   str(BODY_TIMEOUT))
    yield s
    s.stop()


def _connect(live) -> socket.socket:
    return socket.create_connection(("127.0.0.1", live.port), timeout=30)


def _read_all(sock) -> bytes:
    """What the server sends until it closes the connection (bounded by the socket's timeout)."""
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _exchange(sock, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request on an open connection and its response (status, body): read by its Content-Length, so
    the connection can carry the next request."""
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        rest += chunk
    assert b"connection: close" not in head.lower(), head
    return int(head.split(b" ", 2)[1]), rest


def _status_and_error(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def test_a_trickled_header_is_closed_with_408_and_counted(live):
    before = live.metric("header_timeout")
    sock = _connect(live)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    sent = 0
    while sent < 200:       # a byte at a time: each byte must not extend the deadline
        try:
            sock.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += 1
        time.sleep(0.05)
    status, err = _status_and_error(_read_all(sock))
    assert status == 408 and err["code"] == "request_timeout" and "headers" in err["message"], err
    assert sent < 200, "the connection outlived 200 trickled bytes"
    _wait_for(lambda: live.metric("header_timeout") >= before + 1, "the header_timeout metric")


def test_a_trickled_body_is_closed_with_408(live):
    before = live.metric("body_timeout")
    sock = _connect(live)
    sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
    for _ in range(400):
        try:
            sock.sendall(b"a")
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.05)
    status, err = _status_and_error(_read_all(sock))
    assert status == 408 and "body" in err["message"], err
    _wait_for(lambda: live.metric("body_timeout") >= before + 1, "the body_timeout metric")


def test_a_body_that_ends_after_its_answer_leaves_an_idle_connection(live):
    """A request answered before its body arrived (405 here): once the body has come, the connection is an
    idle kept-alive one (closed by uvicorn's keep-alive timer), not a body that timed out."""
    before = live.metric("body_timeout")
    sock = _connect(live)
    sock.sendall(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 405"), head
    sock.sendall(b"12345")
    assert _read_all(sock).count(b"HTTP/1.1") <= 1        # the keep-alive timer closes it, silently
    assert live.metric("body_timeout") == before


def test_a_silent_connection_is_closed_without_an_answer(live):
    sock = _connect(live)
    assert _read_all(sock) == b""


def test_slow_header_clients_cannot_hold_the_server(tmp_path):
    """A few hundred connections that send half a request each, past --max-connections + the reserve (and a
    header deadline longer than the test): the ones that waited longest are closed to make room, so a
    request and /health still get through, and each close is counted."""
    s = LiveServer(tmp_path, "--max-connections", "100", "--header-timeout", "600")
    socks = []
    try:
        for _ in range(300):
            sock = _connect(s)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")    # headers never finished
            socks.append(sock)
        _wait_for(lambda: s.metric("evicted") >= 300 - 100 - 16, "connections closed to make room")
        assert len(s.server.server_state.connections) <= 100 + 16
        assert httpx.post(s.url + "/detokenize", json={"tokens": [1, 2]}, timeout=30).status_code == 200
        for _ in range(10):
            assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        assert _read_all(socks[0]) == b""          # the first flooder was closed, without an answer
    finally:
        for sock in socks:
            sock.close()
        s.stop()


def test_the_cap_answers_503_to_requests_and_serves_health(tmp_path):
    """With the cap full of connections that are answering (a request held in the worker pool), the next
    request gets a 503 and /health still gets through the reserve."""
    s = LiveServer(tmp_path, "--max-connections", "2")
    gate, entered = threading.Event(), threading.Event()
    decode = s.state.tokenizer.decode

    def held_decode(ids, **kw):
        entered.set()
        gate.wait(60)
        return decode(ids, **kw)
    s.state.tokenizer.decode = held_decode
    threads = []
    try:
        def detokenize():
            httpx.post(s.url + "/detokenize", json={"tokens": [1]}, timeout=60)
        for _ in range(2):
            threads.append(threading.Thread(target=detokenize))
            threads[-1].start()
        _wait_for(lambda: len(s.server.server_state.connections) >= 2 and entered.is_set(), "two held requests")
        r = httpx.post(s.url + "/detokenize", json={"tokens": [1]}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
        assert r.headers["connection"] == "close"
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        assert s.metric("over_limit") >= 1
    finally:
        gate.set()
        for t in threads:
            t.join(60)
        s.stop()


@pytest.mark.parametrize("url", ["ok.png\u0000.txt", "\u0000", "file:///etc/passwd%00.png"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_nul_byte_in_an_image_path_is_a_400_naming_the_part(live, path, url):
    sock = _connect(live)           # one connection: it must survive the error
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    status, body = _exchange(sock, "POST", path, json.dumps({"messages": messages}).encode())
    err = json.loads(body)["error"]
    assert status == 400 and err["param"] == "messages.0.content.1" and "NUL" in err["message"], body
    assert err["code"] == "invalid_image"
    assert _exchange(sock, "GET", "/health")[0] == 200
    sock.close()


def test_a_handler_exception_is_a_json_500_with_a_request_id(live):
    def broken(*_a, **_k):
        raise RuntimeError("boom")
    decode = live.state.tokenizer.decode
    live.state.tokenizer.decode = broken
    try:
        r = httpx.post(live.url + "/detokenize", json={"tokens": [1]}, timeout=30)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        rid = r.headers["x-request-id"]
        assert err["type"] == "server_error" and err["code"] == "internal_error" and rid in err["message"]
        assert "boom" not in r.text
        sock = _connect(live)                   # and the connection stays open
        status, body = _exchange(sock, "POST", "/detokenize", b'{"tokens": [1]}')
        assert status == 500 and json.loads(body)["error"]["code"] == "internal_error"
        assert _exchange(sock, "GET", "/health")[0] == 200
        sock.close()
    finally:
        live.state.tokenizer.decode = decode


def test_health_answers_while_a_large_request_holds_a_worker(live):
    """The request's work runs in the worker pool: held there (an event), /health must answer meanwhile."""
    gate, entered = threading.Event(), threading.Event()
    decode = live.state.tokenizer.decode

    def held_decode(ids, **kw):
        entered.set()
        assert gate.wait(60)
        return decode(ids, **kw)
    live.state.tokenizer.decode = held_decode
    result = {}
    ids = list(range(500)) * 1                   # a body over the inline limit goes to the pool anyway
    t = threading.Thread(target=lambda: result.update(r=httpx.post(live.url + "/detokenize", json={"tokens": ids},
                                                                   timeout=60)))
    try:
        t.start()
        assert entered.wait(60)
        assert httpx.get(live.url + "/health", timeout=30).status_code == 200
        assert "r" not in result
    finally:
        gate.set()
        t.join(60)
        live.state.tokenizer.decode = decode
    assert result["r"].status_code == 200 and result["r"].json()["prompt"] == decode(ids)


@pytest.mark.parametrize("path,body,param,needle", [
    ("/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}, "tokens", "513 token ids"),
    ("/tokenize", {"prompt": "a" * 200_000}, "prompt", "200000 characters are more than 512 tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * (MAX_MODEL_LEN + 1)}, "messages",
     "513 messages (each at least one token)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * (MAX_MODEL_LEN + 1)}, "messages",
     "513 messages (each at least one token)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" * 200_000}]}]},
     "messages", "200000 characters of content"),
    ("/v1/completions", {"prompt": list(range(MAX_MODEL_LEN))}, "prompt", "prompt has 512 tokens"),
    ("/v1/completions", {"prompt": [1] * 600_000}, "prompt", "more than 131072 numbers"),   # a large body: stopped while parsed
    ("/v1/completions", {"prompt": ["a", "a" * 200_000]}, "prompt", "200000 characters"),
])
def test_requests_that_cannot_fit_the_context_are_refused_before_the_work(live, path, body, param, needle):
    r = httpx.post(live.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "context_length_exceeded" and needle in err["message"], err


def test_the_yielding_parse_equals_json_loads():
    """Large bodies are parsed with per-value hooks (so other threads get the GIL): the same values."""
    from serving.openai.request_body import _loads_yielding, _TooManyNumbers
    doc = b'{"a": [1, -2, 3.5, 1e3, -0, 0.0, true, null, "x\\u00e9"], "b": {"a": 1, "a": 2}, "c": [[{}], []]}'
    assert _loads_yielding(doc, None) == json.loads(doc)
    assert _loads_yielding(doc, 8) == json.loads(doc)          # 8 numbers
    with pytest.raises(_TooManyNumbers):
        _loads_yielding(doc, 7)
