"""The Responses API (/v1/responses) and the Anthropic Messages API (/v1/messages) on the tiny model's
server (Kimi's chat format), driven by the official `openai` and `anthropic` clients: streamed and
whole answers, reasoning, forced tool calls and their results sent back (the next prompt is checked
against the local renderer's prompt of the chat conversation it must be), previous_response_id, the
stored-response routes, error shapes, the x-api-key header. Scripted outputs (k3jax_test_script) make
a random-weight model write exactly the ids under test."""
import json

import anthropic
import httpx
import openai
import pytest

from tests.support.server_fixture import API_KEY, AUTH
from tests.support.server_fixture import assert_openai_error as _assert_openai_error

pytestmark = pytest.mark.integration

MODEL = "tiny-random"
NO_THINK = {"effort": "none"}           # Responses: Kimi's template with thinking off
TOOLS_R = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
TOOLS_A = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS_R]
TOOLS_CHAT = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["parameters"]}} for t in TOOLS_R]
USER = "Weather in Paris?"


def _script(tok, parts):
    ids = []
    for part in parts:
        ids += [tok.special_ids[part]] if part in tok.special_ids else tok.encode(part)
    return ids


def _prompt_len(tok, messages, tools=None, thinking=True):
    return len(tok.apply_chat_template(messages, tools=tools, thinking=thinking, tokenize=True))


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def _anthropic_error(r, status, needle=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"], body
    if needle is not None:
        assert needle in body["error"]["message"], body
    return body["error"]


# ---- Responses API ---------------------------------------------------------------------------------

def test_responses_reasoning_text_stream_and_usage(client, tok):
    script = _script(tok, ["Thinking hard", "</think>", "The answer.", "<|im_end|>"])
    kw = dict(model=MODEL, input=USER, max_output_tokens=40, extra_body={"k3jax_test_script": script})
    r = client.responses.create(**kw)
    assert r.status == "completed" and r.output_text == "The answer."
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Thinking hard"
    u = r.usage
    assert u.input_tokens == _prompt_len(tok, [{"role": "user", "content": USER}])
    assert u.output_tokens == len(script)
    assert u.output_tokens_details.reasoning_tokens == len(tok.encode("Thinking hard")) + 1   # + </think>
    assert u.total_tokens == u.input_tokens + u.output_tokens

    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types[2:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Thinking hard"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "The answer."
    assert [e.text for e in events if e.type == "response.output_text.done"] == ["The answer."]
    assert types.count("response.output_item.done") == 2
    assert final.output_text == "The answer." and [o.type for o in final.output] == ["reasoning", "message"]
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.output_tokens_details.reasoning_tokens) \
        == (u.input_tokens, u.output_tokens, u.output_tokens_details.reasoning_tokens)


def test_responses_forced_tool_call_round_trip(client, tok):
    """tool_choice names the tool: the call comes back as a function_call item (streamed: its argument
    deltas); sent back with its output, the next prompt holds the call and the result in Kimi's format."""
    args = '{"city": "Paris"}'
    script = _script(tok, [args, "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_end|>"])
    kw = dict(model=MODEL, input=USER, tools=TOOLS_R, tool_choice={"type": "function", "name": "get_weather"},
              reasoning=NO_THINK, max_output_tokens=60, extra_body={"k3jax_test_script": script})
    r = client.responses.create(**kw)
    (call,) = r.output
    assert (call.type, call.call_id, call.name, call.arguments) == \
        ("function_call", "functions.get_weather:0", "get_weather", args)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == args
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [args]
    assert [(o.call_id, o.arguments) for o in final.output] == [(call.call_id, args)]

    answer = _script(tok, ["Sunny.", "<|im_end|>"])
    again = client.responses.create(
        model=MODEL, tools=TOOLS_R, reasoning=NO_THINK, max_output_tokens=20, store=False,
        input=[{"role": "user", "content": USER}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        extra_body={"k3jax_test_script": answer})
    assert again.output_text == "Sunny."
    expected = [{"role": "user", "content": USER},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"}]
    local = tok.apply_chat_template(expected, tools=TOOLS_CHAT, thinking=False)
    assert "## Return of functions.get_weather:0\nsunny, 21 C<|im_end|>" in local
    assert again.usage.input_tokens == _prompt_len(tok, expected, TOOLS_CHAT, thinking=False)
    with pytest.raises(openai.NotFoundError):              # store=False: nothing kept
        client.responses.retrieve(again.id)


def test_responses_previous_response_id_get_delete(client, tok, server):
    first = client.responses.create(model=MODEL, input=USER, instructions="Be brief.", reasoning=NO_THINK,
                                    max_output_tokens=20,
                                    extra_body={"k3jax_test_script": _script(tok, ["Go see.", "<|im_end|>"])})
    assert first.output_text == "Go see." and first.instructions == "Be brief."
    second = client.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=first.id,
                                     reasoning=NO_THINK, max_output_tokens=20,
                                     extra_body={"k3jax_test_script": _script(tok, ["Rain.", "<|im_end|>"])})
    # instructions are not carried over; the first turn (input and answer) is
    turn = [{"role": "user", "content": USER}, {"role": "assistant", "content": "Go see."},
            {"role": "user", "content": "And tomorrow?"}]
    assert second.usage.input_tokens == _prompt_len(tok, turn, thinking=False)
    assert second.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.usage.output_tokens) == (first.id, "Go see.", first.usage.output_tokens)
    deleted = httpx.delete(server.url + f"/v1/responses/{first.id}", headers=AUTH)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    _assert_openai_error(httpx.get(server.url + f"/v1/responses/{first.id}", headers=AUTH), 404)
    for stream in (False, True):         # a conversation through a deleted response: 404 before any byte
        r = httpx.post(server.url + "/v1/responses", headers=AUTH, json={
            "input": "x", "previous_response_id": second.id, "stream": stream, "max_output_tokens": 2})
        _assert_openai_error(r, 404, "previous_response_id", first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")


def test_responses_json_schema_format(client):
    fmt = {"type": "json_schema", "name": "answer", "schema": {"enum": ["yes", "no"]}}
    r = client.responses.create(model=MODEL, input="Yes or no?", text={"format": fmt}, max_output_tokens=12,
                                temperature=1.0, extra_body={"seed": 3})
    assert r.status == "completed" and json.loads(r.output_text) in ("yes", "no")


@pytest.mark.parametrize("body,param", [
    ({"input": 5}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS_R}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "model": "gpt-9"}, "model"),
])
def test_responses_bad_input_is_400(server, body, param):
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/responses", headers=AUTH, json={**body, "stream": stream})
        _assert_openai_error(r, 400, param)


# ---- Anthropic Messages API -----------------------------------------------------------------------

def test_messages_thinking_text_stream_and_usage(claude, tok):
    script = _script(tok, ["Thinking hard", "</think>", "The answer.", "<|im_end|>"])
    kw = dict(model=MODEL, max_tokens=40, system=[{"type": "text", "text": "Be brief."}],
              messages=[{"role": "user", "content": USER}], thinking={"type": "enabled", "budget_tokens": 1024},
              extra_headers={"anthropic-version": "2023-06-01"}, extra_body={"k3jax_test_script": script})
    m = claude.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == \
        [("thinking", "Thinking hard"), ("text", "The answer.")]
    assert (m.stop_reason, m.stop_sequence, m.role, m.model) == ("end_turn", None, "assistant", MODEL)
    prompt = _prompt_len(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt
    assert m.usage.output_tokens == len(script)
    assert m.usage.output_tokens_details.thinking_tokens == len(tok.encode("Thinking hard")) + 1

    with claude.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_start") == events.count("content_block_stop") == 2
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in m.content] and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == m.usage.output_tokens
    assert claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=kw["messages"]).input_tokens == prompt


def test_messages_forced_tool_use_round_trip(claude, tok):
    script = _script(tok, ['{"city": "Paris"}', "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_end|>"])
    kw = dict(model=MODEL, max_tokens=60, tools=TOOLS_A, tool_choice={"type": "tool", "name": "get_weather"},
              thinking={"type": "disabled"}, messages=[{"role": "user", "content": USER}],
              extra_body={"k3jax_test_script": script})
    m = claude.messages.create(**kw)
    (use,) = m.content
    assert (use.type, use.id, use.name, use.input, m.stop_reason) == \
        ("tool_use", "functions.get_weather:0", "get_weather", {"city": "Paris"}, "tool_use")
    with claude.messages.stream(**kw) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas == ["input_json_delta"] and final.stop_reason == "tool_use"
    assert [b.to_dict() for b in final.content] == [use.to_dict()]

    history = [{"role": "user", "content": USER}, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    answer = _script(tok, ["Sunny.", "<|im_end|>"])
    again = claude.messages.create(model=MODEL, max_tokens=20, tools=TOOLS_A, thinking={"type": "disabled"},
                                   messages=history, extra_body={"k3jax_test_script": answer})
    assert [b.text for b in again.content] == ["Sunny."] and again.stop_reason == "end_turn"
    expected = [{"role": "user", "content": USER},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"}]
    local = tok.apply_chat_template(expected, tools=TOOLS_CHAT, thinking=False)
    assert "## Return of functions.get_weather:0\nsunny, 21 C<|im_end|>" in local
    prompt = _prompt_len(tok, expected, TOOLS_CHAT, thinking=False)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt
    assert claude.messages.count_tokens(model=MODEL, tools=TOOLS_A, thinking={"type": "disabled"},
                                        messages=history).input_tokens == prompt


def test_messages_stop_sequence_and_max_tokens(claude, tok):
    script = _script(tok, ["Hello world. Bye", "<|im_end|>"])
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], thinking={"type": "disabled"},
              extra_body={"k3jax_test_script": script})
    m = claude.messages.create(max_tokens=40, stop_sequences=["world"], **kw)
    assert ([b.text for b in m.content], m.stop_reason, m.stop_sequence) == (["Hello "], "stop_sequence", "world")
    with claude.messages.stream(max_tokens=40, stop_sequences=["world"], **kw) as stream:
        final = stream.get_final_message()
    assert ([b.text for b in final.content], final.stop_sequence) == (["Hello "], "world")
    short = claude.messages.create(max_tokens=1, **kw)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1


def test_messages_auth_and_error_shapes(server):
    url = server.url + "/v1/messages"
    ok = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    for headers in ({"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}, AUTH):
        assert httpx.post(url, json=ok, headers=headers, timeout=120).status_code == 200
    _anthropic_error(httpx.post(url, json=ok, headers={"x-api-key": "wrong"}), 401)
    _anthropic_error(httpx.post(url, json=ok), 401)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**ok)
    bad = [({k: v for k, v in ok.items() if k != "max_tokens"}, "max_tokens"),
           ({**ok, "messages": []}, "messages"),
           ({**ok, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
           ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
            "messages.0.content.0.source.type"),
           ({**ok, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages.0.content.0.type"),
           ({**ok, "messages": ok["messages"] + [{"role": "assistant", "content": "Sure"}]}, "prefill"),
           ({**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
           ({**ok, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
           ({**ok, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
           ({**ok, "temperature": 1.5}, "temperature"),
           ({**ok, "model": "claude-9"}, "claude-9")]
    for body, needle in bad:
        for stream in (False, True):
            _anthropic_error(httpx.post(url, json={**body, "stream": stream}, headers=AUTH), 400, needle)
    _anthropic_error(httpx.post(url + "/count_tokens", json={"model": MODEL}, headers=AUTH), 400, "messages")
    _anthropic_error(httpx.post(url, content=b"{", headers={**AUTH, "content-type": "application/json"}), 400)
    _anthropic_error(httpx.get(url + "/nope", headers=AUTH), 404)
    # the OpenAI routes keep their own shape
    _assert_openai_error(httpx.post(server.url + "/v1/chat/completions", json={}, headers={"x-api-key": API_KEY}), 400)


def test_images_in_both_apis(client, claude, server):
    """An input_image part and an Anthropic image block (base64 source) reach the model as chat's image part:
    the prompt counts as /tokenize counts the chat message (each image widened to its placeholder tokens)."""
    import base64
    import io

    import numpy as np
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(0).randint(0, 256, (60, 90, 3), dtype=np.uint8)).save(buf, "PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    url = "data:image/png;base64," + data
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]
    counted = httpx.post(server.url + "/tokenize", headers=AUTH, json={"messages": chat}).json()["count"]
    text_only = httpx.post(server.url + "/tokenize", headers=AUTH, json={"messages": [
        {"role": "user", "content": "What is this?"}]}).json()["count"]
    assert counted > text_only + 1
    r = client.responses.create(model=MODEL, max_output_tokens=1, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is this?"}]}])
    assert r.usage.input_tokens == counted
    m = claude.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "What is this?"}]}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!!"}}
    _anthropic_error(httpx.post(server.url + "/v1/messages", headers=AUTH, json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [bad]}]}), 400)
