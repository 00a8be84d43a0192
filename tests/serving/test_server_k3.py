"""The OpenAI server on a K3-layout checkpoint (tiny weights, K3's tokenizer files): the format is
picked from the declared special names, prompts are K3's tagged format, and K3's output comes
back as reasoning_content / content / tool_calls, streamed and not. Scripted outputs
(k3jax_test_script) are built with the K3 renderer, i.e. exactly what K3 writes."""
import json

import httpx
import openai
import pytest

from tools import synthetic_k3
from k3jax.tokenizer import KimiTokenizer
from k3jax.tokenizer import k3_format as fmt
from tests.support.server_fixture import API_KEY, ServerProcess

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
                   "metric": {"type": "boolean"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}}}}}]
USER = [{"role": "user", "content": "Weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("k3ckpt"))
    synthetic_k3.write_checkpoint(d, seed=3, vision=False, tokenizer="k3")
    return d


@pytest.fixture(scope="module")
def tok(ckpt):
    return KimiTokenizer.from_file(ckpt)


@pytest.fixture(scope="module")
def server(tmp_path_factory, ckpt):
    # (decode runs ~0.3 s a token on CI's 2 cores and K3's markup is verbose: scripts stay short)
    s = ServerProcess(str(tmp_path_factory.mktemp("srvk3")), "--model", ckpt, "--served-model-name", "k3",
                      "--max-model-len", "2048", "--no-warmup")  # K3 prompts are long
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _reply(tok, message, messages=USER, tools=TOOLS, thinking=True):
    """The ids K3 writes for `message` after the prompt of `messages`."""
    p = fmt.encode(tok, fmt.render(messages, tools, thinking=thinking))
    full = fmt.encode(tok, fmt.render(messages + [message], tools, thinking=thinking, add_generation_prompt=False))
    assert full[:len(p)] == p
    return full[len(p):]


def _chat(client, **kw):
    args = dict(model="k3", messages=USER, max_tokens=300, temperature=0)
    args.update(kw)
    return client.chat.completions.create(**args)


def test_checkpoint_tokenizer_is_k3(tok, server):
    assert tok.message_format == "k3"
    r = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": USER}).json()
    assert r["tokens"] == tok.apply_chat_template(USER, tokenize=True)
    assert tok.decode(r["tokens"]).endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def test_chat_reasoning_content_and_tool_calls(client, tok):
    args = {"city": "Oslo", "days": 2}
    msg = {"role": "assistant", "reasoning_content": "Hm.", "content": "Ok.",
           "tool_calls": [{"function": {"name": "get_weather", "arguments": args}}]}
    script = _reply(tok, msg)
    # streamed
    content, reasoning, slots, finish = "", "", {}, None
    for ch in _chat(client, tools=TOOLS, stream=True, extra_body={"k3jax_test_script": script}):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        finish = ch.choices[0].finish_reason or finish
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            s = slots.setdefault(tc.index, {"id": None, "name": "", "args": ""})
            s["id"] = s["id"] or tc.id
            s["name"] += tc.function.name or ""
            s["args"] += tc.function.arguments or ""
    assert (content, reasoning, finish) == ("Ok.", "Hm.", "tool_calls")
    assert [(s["id"], s["name"], json.loads(s["args"])) for _, s in sorted(slots.items())] == \
        [("get_weather:0", "get_weather", args)]

    # round trip, not streamed: the returned call and its result make the next prompt; the next
    # call is numbered after it
    history = USER + [{"role": "assistant", "content": content, "reasoning_content": reasoning,
                       "tool_calls": [{"id": slots[0]["id"], "type": "function",
                                       "function": {"name": slots[0]["name"], "arguments": slots[0]["args"]}}]},
                      {"role": "tool", "tool_call_id": slots[0]["id"], "content": "sunny"}]
    again = _reply(tok, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_time", "arguments": {}}}]}, history)
    r = _chat(client, messages=history, tools=TOOLS, extra_body={"k3jax_test_script": again})
    c = r.choices[0]
    assert (c.message.content, c.finish_reason) == (None, "tool_calls")
    assert [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls] == [("get_time:1", "get_time", "{}")]
    local = tok.apply_chat_template(history, tools=TOOLS, tokenize=True)
    assert r.usage.prompt_tokens == len(local)
    assert 'role="tool" tool="get_weather" index="1"<|sep|>sunny' in tok.decode(local)
    assert "<|open|>think<|sep|>Hm.<|close|>think<|sep|>" in tok.decode(local)   # K3 keeps old reasoning


def test_thinking_off_and_no_tools_declared(client, tok):
    msg = {"role": "assistant", "content": "Here.", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    script = _reply(tok, msg, tools=None, thinking=False)
    r = _chat(client, extra_body={"k3jax_test_script": script, "chat_template_kwargs": {"thinking": False}})
    m = r.choices[0].message
    # no tools offered: the call is dropped, its markup never reaches the content
    assert (m.content, m.tool_calls, r.choices[0].finish_reason) == ("Here.", None, "stop")
    assert "reasoning_content" not in (m.model_extra or {}) or not m.model_extra["reasoning_content"]


def _generated_text(choice) -> str:
    return "".join(e.token for e in choice.logprobs.content)


def test_named_tool_choice_is_constrained(client, tok):
    r = _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              max_tokens=22, logprobs=True)
    c = r.choices[0]
    # random weights, yet the grammar makes the output K3's first required argument element
    assert _generated_text(c).startswith('<|open|>argument key="city" type="string"<|sep|>')
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    assert c.message.model_extra.get("reasoning_content") in (None, "")


def test_required_tool_choice_and_prompt_messages(client, tok):
    r = _chat(client, tools=TOOLS, tool_choice="required", max_tokens=12, logprobs=True)
    text = _generated_text(r.choices[0])
    assert text.startswith('<|open|>call tool="get_') and text[len('<|open|>call tool="get_'):][:4] in ("weat", "time")
    # the prompt carries K3's tool-choice message; the forced prefix closes think and opens tools
    base = tok.apply_chat_template(USER, tools=TOOLS, tokenize=True, tool_choice="required")
    assert "tool_choice=required" in tok.decode(base)
    prefix = "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
    assert r.usage.prompt_tokens == len(base) + len(tok.encode(prefix, allow_special=True))


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_calls_a_declared_tool(client, stream):
    """tool_choice "required" on random weights at temperature 0: exactly one call (parallel_tool_calls off),
    naming a declared tool with arguments valid for its schema, streamed or not."""
    from tests.support.server_fixture import BOUNDED_TOOLS, assert_declared_calls, chat_tool_calls
    calls, finish = chat_tool_calls(client, stream, model="k3", messages=USER, tools=BOUNDED_TOOLS,
                                    tool_choice="required", temperature=0, max_tokens=100, parallel_tool_calls=False)
    assert_declared_calls(calls, BOUNDED_TOOLS)
    assert finish == "tool_calls" and len(calls) == 1


def test_required_parallel_tool_calls_stream(client):
    """parallel_tool_calls on: random weights may go on calling tools until max_tokens, so the answer ends either
    with "tool_calls" or with "length" inside a call (JSON allows whitespace between tokens, so even a bounded
    call can run to max_tokens); every whole streamed call names a declared tool with valid arguments, and a
    call cut off names a declared tool."""
    from tests.support.server_fixture import BOUNDED_TOOLS, assert_declared_calls, chat_tool_calls
    calls, finish = chat_tool_calls(client, True, model="k3", messages=USER, tools=BOUNDED_TOOLS,
                                    tool_choice="required", temperature=0, max_tokens=100, parallel_tool_calls=True)
    assert finish in ("tool_calls", "length"), finish
    if finish == "tool_calls":
        assert_declared_calls(calls, BOUNDED_TOOLS)
        return
    # cut off by max_tokens: the last call may be unfinished, the ones before it are whole
    assert calls and calls[-1][0] in {t["function"]["name"] for t in BOUNDED_TOOLS}, calls
    if len(calls) > 1:
        assert_declared_calls(calls[:-1], BOUNDED_TOOLS)


def test_response_format_json_schema(client, tok):
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}},
              "additionalProperties": False}
    r = _chat(client, max_tokens=40, response_format={"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": schema}})
    c = r.choices[0]
    expected = tok.apply_chat_template(USER, tokenize=True, thinking=False,
                                       response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert r.usage.prompt_tokens == len(expected)
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content)["n"], int)


# ---- the Responses and Messages APIs in K3's format (forced calls end at once: K3 decodes slowly on CPU) ----

def _k3_call_round_trip_expected(tok):
    expected = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "get_time:0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "get_time:0", "content": "12:00"}]
    local = tok.apply_chat_template(expected, tools=TOOLS, tokenize=True)
    assert 'role="tool" tool="get_time" index="1"<|sep|>12:00<|close|>message<|sep|>' in tok.decode(local)
    return local


def test_responses_api_forced_call_and_previous_response_id(client, tok):
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    script = tok.encode("<|close|>call<|sep|>", allow_special=True)   # after the forced <|open|>call ...<|sep|>
    with client.responses.stream(model="k3", input=USER[0]["content"], tools=tools, max_output_tokens=20,
                                 tool_choice={"type": "function", "name": "get_time"},
                                 extra_body={"k3jax_test_script": script}) as stream:
        types = [e.type for e in stream]
        first = stream.get_final_response()
    (call,) = first.output
    assert (call.type, call.call_id, call.name, json.loads(call.arguments)) == ("function_call", "get_time:0", "get_time", {})
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    again = client.responses.create(model="k3", previous_response_id=first.id, tools=tools, max_output_tokens=1,
                                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert again.usage.input_tokens == len(_k3_call_round_trip_expected(tok))


def test_messages_api_forced_tool_use_round_trip(server, tok):
    import anthropic
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    script = tok.encode("<|close|>call<|sep|>", allow_special=True)
    with claude.messages.stream(model="k3", max_tokens=20, messages=USER, tools=tools,
                                tool_choice={"type": "tool", "name": "get_time"},
                                extra_body={"k3jax_test_script": script}) as stream:
        final = stream.get_final_message()
    (use,) = final.content
    assert (use.type, use.id, use.name, use.input, final.stop_reason) == ("tool_use", "get_time:0", "get_time", {}, "tool_use")
    history = USER + [{"role": "assistant", "content": [use.to_dict()]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}]}]
    want = len(_k3_call_round_trip_expected(tok))
    assert claude.messages.count_tokens(model="k3", tools=tools, messages=history).input_tokens == want
    m = claude.messages.create(model="k3", max_tokens=1, tools=tools, messages=history)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want and m.usage.output_tokens == 1
