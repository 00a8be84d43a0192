"""The OpenAI-compatible server's answers to bad and edge-case requests: OpenAI-shaped 4xx errors naming the
field, the same status streamed or not, queue and body limits (the `server` fixture of tests/conftest.py, shared
with tests/serving/test_server.py)."""
import json
import time

import httpx
import pytest

from tests.support.server_fixture import AUTH
from tests.support.server_fixture import assert_openai_error as _assert_openai_error
from tests.support.server_fixture import post as _post

pytestmark = pytest.mark.integration

# ---------------------------------------------------------------------------- regressions


@pytest.mark.parametrize("message,param,needle", [
    # Each of these was a plain-text 500 with a traceback from the chat renderer
    ({"role": "user", "content": [5, "x"]}, "messages.0.content", "part 0 must be an object or a string, got a number"),
    ({"role": "user", "content": [None]}, "messages.0.content", "part 0 must be an object or a string, got null"),
    ({"role": "assistant", "content": "x", "tool_calls": "abc"}, "messages.0.tool_calls",
     "must be a list of tool calls, got a string"),
    ({"role": "assistant", "content": "x", "tool_calls": {"id": "a"}}, "messages.0.tool_calls", "got an object"),
    ({"role": "assistant", "content": "x", "tool_calls": [5]}, "messages.0.tool_calls.0", "valid dictionary"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "messages.0.tool_calls.0.function.name",
     "Field required"),
    ({"role": "user", "content": {"type": "text", "text": "x"}}, "messages.0.content", "got an object"),
    ({"role": "user", "content": "x", "name": 5}, "messages.0.name", "valid string"),
])
def test_malformed_message_shapes_get_400(server, message, param, needle):
    for path in ("/v1/chat/completions", "/tokenize"):
        err = _assert_openai_error(_post(server, path, {"messages": [message], "max_tokens": 2}), 400, param, needle)
        assert "ContentPart" not in err["message"] and "ToolCall" not in err["message"]


@pytest.mark.parametrize("body,param,needle", [
    ({"tools": [{"type": "function", "function": "get_weather"}]}, "tools.0.function", "valid dictionary"),
    ({"tools": [{"type": "function", "function": {"name": "a"}}], "tool_choice": {"type": "function", "function": "a"}},
     "tool_choice.function", "valid dictionary"),
    # item 7: these named Python functions and arguments ("apply_chat_template() got multiple values ...")
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "tokenize cannot be set here"),
    ({"chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs", "takes only 'thinking', not 'foo'"),
    ({"chat_template_kwargs": {"thinking": "maybe"}}, "chat_template_kwargs.thinking", "valid boolean"),
])
def test_malformed_tools_and_template_kwargs_get_400(server, body, param, needle):
    err = _assert_openai_error(_post(server, "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **body}),
                               400, param, needle)
    assert "apply_chat_template" not in err["message"] and "()" not in err["message"]


@pytest.mark.parametrize("path,body,status,param,needle,code", [
    # With stream=true these were HTTP 200 plus an error event
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12}, 400, "max_tokens",
     "exceed the context", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [5, 10**9], "max_tokens": 2}, 400, "prompt", "out of range", "invalid_prompt"),
    ("/v1/completions", {"prompt": [[5, 6], [7, 10**9]], "max_tokens": 2}, 400, "prompt", "out of range",
     "invalid_prompt"),
    # 150 choices on a server with --max-waiting 100 never fit its queue: a 400, not a 429 (no retry can succeed)
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "n": 150}, 400, "n",
     "n: 150 sequences, more than the server queues (100)", "too_many_choices"),
    ("/v1/completions", {"prompt": [[5, 6], [7, 8]], "max_tokens": 2, "n": 60}, 400, "n",
     "n x prompts: 60 x 2 = 120 sequences, more than the server queues (100)", "too_many_choices"),
    ("/v1/completions", {"prompt": ["x"] * 101, "max_tokens": 2}, 400, "prompt", "prompt: 101 sequences, more than",
     "too_many_choices"),
    # issue: 5000 prompts in one request ran for 112 s (--max-prompts-per-request, 256 by default)
    ("/v1/completions", {"prompt": ["x"] * 5000, "max_tokens": 2}, 400, "prompt", "at most 256 prompts per request, got 5000",
     "too_many_prompts"),
    ("/v1/completions", {"prompt": [[5]] * 257, "max_tokens": 2}, 400, "prompt", "at most 256 prompts", "too_many_prompts"),
])
def test_engine_refusals_are_the_same_status_with_and_without_streaming(server, path, body, status, param, needle,
                                                                        code):
    for stream in (False, True):
        err = _assert_openai_error(_post(server, path, {**body, "stream": stream}), status, param, needle)
        assert err["code"] == code
    deadline = time.time() + 30            # the choices admitted before the refusal are aborted, not left running
    while time.time() < deadline and (server.metric("k3jax:num_requests_running")
                                      + server.metric("k3jax:num_requests_waiting")) > 0:
        time.sleep(0.2)
    assert server.metric("k3jax:num_requests_running") + server.metric("k3jax:num_requests_waiting") == 0


@pytest.mark.parametrize("path,body,param,needle", [
    # pydantic's union tags ("constrained-str") leaked into param, and "not a string" hid the real fault
    ("/v1/completions", {"prompt": [5, -1]}, "prompt.1", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": []}, "prompt", "at least 1 item"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, "stop.1", "at least 1 character"),
    # a named tool's bad parameters schema was blamed on response_format
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": {
        "type": "function", "function": {"name": "f"}}, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, "tools", "parameters of 'f'"),
    # OpenAI refuses top_logprobs without logprobs: true; it was accepted (and no logprobs came back)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "logprobs must be set to true if top_logprobs is used"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0, "logprobs": False},
     "top_logprobs", "logprobs must be set to true"),
    # a test script that is not a list was a 500 (TypeError)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "k3jax_test_script": 5},
     "k3jax_test_script", "list of token ids"),
])
def test_refusals_name_the_field_at_fault(server, path, body, param, needle):
    _assert_openai_error(_post(server, path, {**body, "max_tokens": 2}), 400, param, needle)


def test_full_queue_gets_429_with_and_without_streaming(server):
    """100 choices fill the queue of --max-waiting 100 (16 run, 84 wait): 50 more do not fit now, a 429."""
    body = {"prompt": [3, 4], "max_tokens": 480, "n": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()                 # (held: a dropped line iterator closes the connection)
        assert next(lines).startswith("data:")
        for stream in (False, True):
            err = _assert_openai_error(_post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "n": 50,
                                                                         "stream": stream}), 429, None, "server busy")
            assert err["code"] == "queue_full"
    deadline = time.time() + 30
    while time.time() < deadline and (server.metric("k3jax:num_requests_running")
                                      + server.metric("k3jax:num_requests_waiting")) > 0:
        time.sleep(0.2)


def test_served_schema_states_the_prompt_cap_and_the_logprobs_rule(server):
    schema = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    lists = [a for a in schema["CompletionRequest"]["properties"]["prompt"]["anyOf"] if a["type"] == "array"]
    assert [a.get("maxItems") for a in lists] == [256, None, 256]        # prompts (strings, id lists); ids: no cap
    chat = schema["ChatCompletionRequest"]
    assert chat["if"]["required"] == ["top_logprobs"] and chat["then"]["properties"]["logprobs"] == {"const": True}


# A lone UTF-16 surrogate in any string that reaches the tokenizer: a 400 naming it (the strings pydantic checked
# with constraints got "unable to parse raw data as a unicode string", the others were silently replaced by U+FFFD).
_MSG = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a\udc00"]}, "prompt.1"),
    ("/v1/completions", {"prompt": "ok", "stop": ["x", "\ud800"]}, "stop.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [_MSG, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": '{"q": "\ud800"}'}}]}]}, "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {"messages": [_MSG, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {"k\ud800": 1}}}]}]}, "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {"messages": [_MSG], "tools": [{"type": "function", "function": {
        "name": "f", "description": "\udfff"}}]}, "tools.0.function.description"),
    ("/v1/chat/completions", {"messages": [_MSG], "stop": "\ud800"}, "stop"),
    ("/v1/chat/completions", {"messages": [_MSG], "reasoning_effort": "\ud800"}, "reasoning_effort"),   # a vendor extra
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
])
def test_lone_surrogates_get_400_naming_the_field(server, path, body, param):
    raw = json.dumps({**body, "max_tokens": 2})          # a lone surrogate goes out as the escape \ud800
    for stream in ((False, True) if path != "/tokenize" else (None,)):
        content = raw if stream is None else raw[:-1] + f', "stream": {json.dumps(stream)}}}'
        r = httpx.post(server.url + path, content=content.encode(), headers={**AUTH, "content-type": "application/json"})
        err = _assert_openai_error(r, 400, param, "not valid Unicode: ")
        assert err["code"] == "invalid_unicode" and "surrogate" in err["message"], err


def test_paired_surrogates_are_one_character(server):
    pair = httpx.post(server.url + "/tokenize", content=b'{"prompt": "a\\ud83d\\ude00"}',
                      headers={**AUTH, "content-type": "application/json"})
    assert pair.status_code == 200 and pair.json() == _post(server, "/tokenize", {"prompt": "a\U0001F600"}).json()


@pytest.mark.parametrize("n", [1000, 201, 100000])
def test_n_above_the_cap_gets_400(server, n):
    # n=1000 once ran for 44 s, n=100000 got a 429
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"})):
        for stream in (False, True):
            _assert_openai_error(_post(server, path, {**body, "n": n, "max_tokens": 1, "stream": stream}), 400, "n",
                                 "at most 200 choices")


def test_n_at_the_cap_is_served(server):
    r = _post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1, "n": 100, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"]) == 100


def test_oversized_body_gets_413_quickly_and_health_stays_fast(server):
    """A 100 MB body took 13.8 s to refuse and held /health for 12.5 s."""
    import threading
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (100 << 20) + b'"}]}'
    health = []

    def probe():
        t0 = time.perf_counter()
        httpx.get(server.url + "/health", timeout=60)
        health.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    th = threading.Thread(target=probe)
    th.start()
    r = httpx.post(server.url + "/v1/chat/completions", content=big, timeout=60,
                   headers={**AUTH, "content-type": "application/json"})
    elapsed = time.perf_counter() - t0
    th.join()
    err = _assert_openai_error(r, 413)
    assert err["code"] == "request_too_large" and "33554432 bytes" in err["message"]
    assert elapsed < 5 and health[0] < 2, (elapsed, health)

    def chunks():                           # no Content-Length: counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"a" * (1 << 20)
        yield b'"}]}'
    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={**AUTH, "content-type": "application/json"})
    assert _assert_openai_error(r, 413)["code"] == "request_too_large"
    assert httpx.get(server.url + "/health").status_code == 200




@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": None, "stream": None,
                              "logprobs": None, "parallel_tool_calls": None}),
    ("/v1/completions", {"prompt": "x", "n": None, "stream": None, "echo": None}),
])
def test_explicit_null_means_the_default(server, path, body):
    """OpenAI documents these fields as nullable: null is the default (one choice, not streamed, no
    logprobs, no echo), the same answer as leaving them out."""
    body = {**body, "max_tokens": 3, "temperature": 0}
    with_nulls = _post(server, path, body)
    assert with_nulls.status_code == 200, with_nulls.text
    without = _post(server, path, {k: v for k, v in body.items() if v is not None})
    a, b = with_nulls.json(), without.json()
    assert len(a["choices"]) == 1 and a["choices"][0].get("logprobs") is None
    key = "message" if "messages" in body else "text"
    assert a["choices"][0][key] == b["choices"][0][key]
    schema = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=60).json()["components"]["schemas"]
    props = schema["ChatCompletionRequest" if "messages" in body else "CompletionRequest"]["properties"]
    for name in (k for k, v in body.items() if v is None):
        assert {"type": "null"} in props[name]["anyOf"], (name, props[name])


def test_prompt_over_max_model_len_is_a_400_naming_both_numbers(server):
    """The tiny server runs with --max-model-len 512."""
    err = _assert_openai_error(_post(server, "/v1/completions", {"prompt": list(range(1, 601)), "max_tokens": 1}),
                               400, "prompt")
    assert "600" in err["message"] and "512" in err["message"], err
    messages = [{"role": "user", "content": "word " * 700}]
    err = _assert_openai_error(_post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}), 400)
    assert "512" in err["message"] and "tokens" in err["message"], err


@pytest.mark.parametrize("body,needle", [
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "not valid UTF-8"),
    (b'{"prompt": [' + b"1" * 5000 + b'], "max_tokens": 2}', "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nests too deep"),
    (b'{"prompt": "a\x01b", "max_tokens": 2}', "Invalid control character at character"),
])
def test_unparsable_bodies_are_400s_that_say_why(server, body, needle):
    """Bodies the JSON parser refuses: one 400 naming the reason, code invalid_json (was FastAPI's bare
    'There was an error parsing the body' with code null, or 'at at character')."""
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=120,
                   headers={**AUTH, "content-type": "application/json"})
    err = _assert_openai_error(r, 400, needle=needle)
    assert err["code"] == "invalid_json" and "at at" not in err["message"], err


def test_empty_model_name_is_refused(server):
    err = _assert_openai_error(_post(server, "/v1/completions", {"model": "", "prompt": "x", "max_tokens": 2}),
                               400, "model", "not be empty")
    assert err["code"] == "model_not_found"
