"""The Responses and Messages APIs' conversions, without a server, in both of the model's formats
(Kimi's template and K3's tagged format, the tiny tokenizer's two spellings): what the model writes
(its own renderer's ids for an assistant message) comes back as ordered output items / content blocks,
and those items sent back with a tool result render exactly the prompt of the chat conversation they
stand for. Also the response store's bounds."""
import json

import pytest

from k3jax.tokenizer import KimiTokenizer
from serving.openai import anthropic_messages as am
from serving.openai import responses as rs
from serving.openai.chat import Plan
from serving.openai.generation import ServerState
from serving.openai.response_store import MissingResponse, ResponseStore
from serving.openai.turn import TurnEnd, TurnParser

USER = [{"role": "user", "content": "Weather in Oslo?"}]
TOOLS_CHAT = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOLS_R = [{"type": "function", "name": "get_weather", "parameters": TOOLS_CHAT[0]["function"]["parameters"]}]
TOOLS_A = [{"name": "get_weather", "input_schema": TOOLS_CHAT[0]["function"]["parameters"]}]
ARGS = {"city": "Oslo"}
# the call id each format gives the model's first call, and how its result renders
FORMATS = {"kimi": ("functions.get_weather:0", "## Return of functions.get_weather:0\nsunny<|im_end|>",
                    "</think>"),
           "k3": ("get_weather:0", 'role="tool" tool="get_weather" index="1"<|sep|>sunny<|close|>message<|sep|>',
                  "<|close|>think<|sep|>")}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def fmt(request):
    tok = KimiTokenizer.tiny(request.param)
    state = ServerState(engine=None, tokenizer=tok, model_name="m", max_model_len=8192, metrics=None)
    return request.param, tok, state


def _reply(tok, message):
    """The ids the model writes for `message` after the prompt of USER (its renderer's own)."""
    p = tok.apply_chat_template(USER, tools=TOOLS_CHAT, tokenize=True)
    full = tok.apply_chat_template(USER + [message], tools=TOOLS_CHAT, add_generation_prompt=False, tokenize=True)
    assert full[:len(p)] == p
    return full[len(p):]


def _turn(state, chat_req, ids):
    """Events and reasoning-token count of `ids` generated for chat_req, fed one id at a time."""
    plan = Plan(state, chat_req)
    p = TurnParser(plan, state.tokenizer)
    events = list(p.first)
    for k, t in enumerate(ids):
        events += p.feed([t], final=k == len(ids) - 1)
    return events + p.finish(None), p.reasoning_tokens


def _said(tok):
    return {"role": "assistant", "reasoning_content": "Hm.", "content": "Ok.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]}


def _reasoning_ids(tok, ids, closing):
    """How many ids the reasoning takes, its closing tag included (found by decoding, not parsing)."""
    return next(k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]).endswith(closing))


def test_responses_output_items_and_tool_round_trip(fmt):
    name, tok, state = fmt
    call_id, rendered_result, closing = FORMATS[name]
    ids = _reply(tok, _said(tok))
    req = rs.ResponsesRequest.model_validate({"input": USER[0]["content"], "tools": TOOLS_R})
    chat_req, added = rs.to_chat(state, req, [])
    assert Plan(state, chat_req).prompt == tok.apply_chat_template(USER, tools=TOOLS_CHAT, tokenize=True)
    events, reasoning = _turn(state, chat_req, ids)
    assert reasoning == _reasoning_ids(tok, ids, closing)

    store = ResponseStore(8, 60.0)
    run = rs._Run(state, store, req, added, "resp_1")
    sse = [s for e in events for s in run.out.feed(e)]
    end = TurnEnd("stop", None, 10, len(ids), reasoning, 0, [])
    resp, closing_events = run.finish(end)
    types = [json.loads(s.split("data: ", 1)[1])["type"] for s in sse + closing_events]
    opened = ["response.output_item.added", "response.content_part.added"]
    closed = ["response.content_part.done", "response.output_item.done"]
    deltas = [t for t in types if t.endswith(".delta")]
    assert [t for t in types if not t.endswith(".delta")] == (
        opened + ["response.reasoning_text.done"] + closed + opened + ["response.output_text.done"] + closed
        + ["response.output_item.added", "response.function_call_arguments.done", "response.output_item.done"])
    assert set(deltas) <= {"response.reasoning_text.delta", "response.output_text.delta",
                           "response.function_call_arguments.delta"} and deltas
    items = resp["output"]
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Hm."}]
    assert items[1]["content"][0]["text"] == "Ok."
    assert (items[2]["call_id"], items[2]["name"], json.loads(items[2]["arguments"])) == (call_id, "get_weather", ARGS)
    assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": reasoning}

    # the tool's result, sent back by previous_response_id (the stored turn) or with the items themselves
    result = {"type": "function_call_output", "call_id": call_id, "output": "sunny"}
    expected = USER + [{"role": "assistant", "reasoning_content": "Hm.", "content": "Ok.", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": items[2]["arguments"]}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    want = tok.apply_chat_template(expected, tools=TOOLS_CHAT, tokenize=True)
    assert rendered_result in tok.decode(want)
    nxt = rs.ResponsesRequest.model_validate({"input": [result], "tools": TOOLS_R, "previous_response_id": "resp_1"})
    assert Plan(state, rs.to_chat(state, nxt, store.conversation("resp_1"))[0]).prompt == want
    full = rs.ResponsesRequest.model_validate({"input": USER + items + [result], "tools": TOOLS_R})
    assert Plan(state, rs.to_chat(state, full, [])[0]).prompt == want


def test_messages_blocks_and_tool_round_trip(fmt):
    name, tok, state = fmt
    call_id, rendered_result, closing = FORMATS[name]
    ids = _reply(tok, _said(tok))
    req = am.MessagesRequest.model_validate({"model": "m", "max_tokens": 50, "messages": USER, "tools": TOOLS_A,
                                             "system": [{"type": "text", "text": "Be brief."}]})
    chat_req = am.to_chat(state, req, req.max_tokens, req)
    system = [{"role": "system", "content": "Be brief."}]
    assert Plan(state, chat_req).prompt == tok.apply_chat_template(system + USER, tools=TOOLS_CHAT, tokenize=True)
    events, reasoning = _turn(state, chat_req, ids)
    blocks = am._Blocks()
    sse = [s for e in events for s in blocks.feed(e)] + blocks.close()
    kinds = [json.loads(s.split("data: ", 1)[1]) for s in sse]
    assert [k["type"] for k in kinds if k["type"] != "content_block_delta"] == ["content_block_start",
                                                                                  "content_block_stop"] * 3
    assert [k["delta"]["type"] for k in kinds if k["type"] == "content_block_delta"][-1] == "input_json_delta"
    assert blocks.blocks == [{"type": "thinking", "thinking": "Hm.", "signature": ""}, {"type": "text", "text": "Ok."},
                             {"type": "tool_use", "id": call_id, "name": "get_weather", "input": ARGS}]
    end = TurnEnd("stop", None, 10, len(ids), reasoning, 0, [])
    assert am._stop(end, [], blocks.blocks) == ("tool_use", None)

    nxt = am.MessagesRequest.model_validate({"model": "m", "max_tokens": 50, "tools": TOOLS_A, "system": "Be brief.",
                                             "messages": USER + [
                                                 {"role": "assistant", "content": blocks.blocks},
                                                 {"role": "user", "content": [
                                                     {"type": "tool_result", "tool_use_id": call_id, "content": "sunny"}]}]})
    expected = system + USER + [
        {"role": "assistant", "reasoning_content": "Hm.", "content": "Ok.", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    want = tok.apply_chat_template(expected, tools=TOOLS_CHAT, tokenize=True)
    assert rendered_result in tok.decode(want)
    assert Plan(state, am.to_chat(state, nxt, nxt.max_tokens, nxt)).prompt == want


def test_messages_call_with_invalid_arguments_is_text():
    """Kimi's format carries arguments as written: a call whose arguments are not a JSON object cannot be a
    tool_use block and comes back as text (K3's typed argument elements always make an object)."""
    tok = KimiTokenizer.tiny()
    state = ServerState(engine=None, tokenizer=tok, model_name="m", max_model_len=8192, metrics=None)
    ids = _reply(tok, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]})
    req = am.MessagesRequest.model_validate({"model": "m", "max_tokens": 50, "messages": USER, "tools": TOOLS_A,
                                             "thinking": {"type": "disabled"}})
    chat_req = am.to_chat(state, req, req.max_tokens, req)
    plan = Plan(state, chat_req)
    # thinking disabled: the prompt ends with the empty <think></think>, the reply with the call only
    p = TurnParser(plan, tok)
    reply = ids[ids.index(tok.id_of("</think>")) + 1:]
    events = p.feed(reply, final=True) + p.finish(None)
    blocks = am._Blocks()
    for e in events:
        blocks.feed(e)
    assert blocks.blocks == [{"type": "text", "text": "get_weather({oops)"}]
    assert am._stop(TurnEnd("stop", None, 1, 1, 0, 0, []), [], blocks.blocks) == ("end_turn", None)


def test_reasoning_effort_and_thinking_options(fmt):
    name, tok, state = fmt
    off = rs.to_chat(state, rs.ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "none"}}), [])[0]
    on = rs.to_chat(state, rs.ResponsesRequest.model_validate({"input": "hi"}), [])[0]
    disabled = am.to_chat(state, am.MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}}), 5)
    plain = [{"role": "user", "content": "hi"}]
    assert Plan(state, off).prompt == Plan(state, disabled).prompt == tok.apply_chat_template(
        plain, tokenize=True, thinking=False)
    assert Plan(state, on).prompt == tok.apply_chat_template(plain, tokenize=True)
    if name == "k3":        # OpenAI's efforts onto K3's three
        high = rs.to_chat(state, rs.ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "medium"}}),
                          [])[0]
        assert Plan(state, high).prompt == tok.apply_chat_template(plain, tokenize=True, thinking_effort="high")
        assert Plan(state, high).prompt != Plan(state, on).prompt


def test_response_store_bounds_and_chains():
    now = [0.0]
    store = ResponseStore(3, ttl_s=10.0, clock=lambda: now[0])
    msg = lambda s: [{"role": "user", "content": s}]      # noqa: E731
    store.put("a", {"id": "a"}, msg("a"), None)
    store.put("b", {"id": "b"}, msg("b"), "a")
    store.put("x", {"id": "x"}, msg("x"), None)
    assert [m["content"] for m in store.conversation("b")] == ["a", "b"]   # touches a and b: x is oldest
    store.put("c", {"id": "c"}, msg("c"), "b")
    with pytest.raises(MissingResponse):
        store.get("x")
    assert [m["content"] for m in store.conversation("c")] == ["a", "b", "c"]
    assert store.delete("a") and not store.delete("a")
    with pytest.raises(MissingResponse) as e:       # a chain through a dropped response names it
        store.conversation("c")
    assert e.value.rid == "a"
    now[0] = 5.0
    store.get("c")
    now[0] = 12.0                                    # b unused for 12 s, c for 7 s
    assert len(store) == 1 and store.get("c").response == {"id": "c"}
    now[0] = 30.0
    assert len(store) == 0
    off = ResponseStore(0, 10.0)
    off.put("a", {}, [], None)
    assert len(off) == 0


def test_reasoning_tokens_of_a_model_that_opens_its_own_think():
    """A model whose answer starts as content (thinks_by_default off) and writes <think> itself: the reasoning
    count takes both markers and the text between them, nothing after."""
    tok = KimiTokenizer.tiny()
    state = ServerState(engine=None, tokenizer=tok, model_name="m", max_model_len=8192, metrics=None,
                        thinks_by_default=False)
    req = rs.ResponsesRequest.model_validate({"input": "hi"})
    ids = [tok.id_of("<think>")] + tok.encode("Hm, let me see.") + [tok.id_of("</think>")] + tok.encode("Ok.")
    events, reasoning = _turn(state, rs.to_chat(state, req, [])[0], ids + [tok.id_of("<|im_end|>")])
    assert reasoning == len(tok.encode("Hm, let me see.")) + 2
    runs = []
    for kind, text in events:            # (fed one id at a time: one event per id)
        if runs and runs[-1][0] == kind:
            runs[-1][1] += text
        else:
            runs.append([kind, text])
    assert runs == [["reasoning", "Hm, let me see."], ["text", "Ok."]]


@pytest.mark.parametrize("api, tool, param, message", [
    (am, {"name": "f"}, "tools.0.input_schema", "expected a JSON schema object, got null"),
    (am, {"name": "f", "input_schema": []}, "tools.0.input_schema", "expected a JSON schema object, got an array"),
    (am, {"name": 3, "input_schema": {}}, "tools.0.name", "expected a string, got a number"),
    (am, {"type": "web_search", "name": "f", "input_schema": {}}, "tools.0.type", "only client tools"),
    (rs, {"type": "function", "name": "f", "parameters": "x"}, "tools.0.parameters",
     "expected a JSON schema object, got a string"),
    (rs, {"type": "function", "name": "f", "description": 1}, "tools.0.description", "expected a string, got a number"),
    (rs, {"type": "file_search"}, "tools.0.type", "only function tools"),
    (rs, "f", "tools.0", "expected a tool object, got a string"),
])
def test_tool_definitions_refused_name_their_field(api, tool, param, message):
    with pytest.raises(Exception) as e:
        api._tools([tool])
    err = e.value.body()["error"]
    assert (e.value.status, err["param"]) == (400, param) and err["message"].startswith(f"{param}: {message}")


def test_tool_definitions_become_chat_function_tools():
    schema = TOOLS_CHAT[0]["function"]["parameters"]
    assert am._tools([{"name": "f", "description": "d", "input_schema": schema}]) == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": schema}}]
    assert rs._tools([{"type": "function", "name": "f"}, {"type": "function", "name": "g", "parameters": schema}]) == [
        {"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "g", "parameters": schema}}]
    assert am._tools(None) is None and rs._tools(None) is None
