"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens.

A request becomes a chat request and runs through chat's path (serving/openai/turn.py): `system` is
a system message; a user message's tool_result blocks become tool messages (before its other
blocks), its text and image blocks (base64 and url sources) a user message; an assistant message's
thinking blocks its reasoning_content, text its content, tool_use blocks its tool_calls (the
tool_use id is the call id, so a call the model made renders with its own id). tool_choice any / tool
/ none / auto are chat's required / named / none / auto; `thinking` enabled or disabled turns the
template's thinking on or off (omitted: the model's default; budget_tokens is accepted, not enforced).

The output is thinking, text and tool_use blocks in the order the model wrote them. A tool call whose
arguments are not a JSON object cannot be a tool_use block (its input is an object): it is returned
as a text block holding the call as written, so nothing the model wrote is lost. Errors on these
routes use Anthropic's shape ({"type": "error", "error": {"type", "message"}}), whoever raises them
(the key check, the body limit, validation), through serving/openai/anthropic_errors.py.

Not served: prefill (a conversation ending with an assistant message), document / search-result
blocks, server tools (web search, code execution, ...), citations, signatures of thinking blocks
(sent empty), cache_control (accepted; prefix caching is automatic).
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Optional, Union

from fastapi import Request
from pydantic import Field

from serving.openai.anthropic_errors import PREFIX, AnthropicErrorShape, error_body
from serving.openai.chat import Plan
from serving.openai.errors import APIError
from serving.openai.generation import ServerState
from serving.openai.protocol import Int, Num, StopString, _json_type, _Request
from serving.openai.sse import EventStreamResponse
from serving.openai.turn import Turn, bad_field, chat_request, function_tool, reasoning_effort_kwargs, string_field

_CHAT_EXTRAS = ("seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "priority",
                "k3jax_test_script")


class _MessagesBase(_Request):
    model: str
    messages: list[Any] = Field(min_length=1)
    system: Union[None, str, list[Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None


class MessagesRequest(_MessagesBase):
    max_tokens: Int(ge=1, le=2**53)
    stop_sequences: Optional[list[StopString]] = None
    temperature: Optional[Num(ge=0, le=1)] = None
    top_p: Optional[Num(gt=0, le=1)] = None
    top_k: Optional[Int(ge=0, le=2**31 - 1)] = None
    metadata: Optional[dict[str, Any]] = None
    stream: bool = False


class CountTokensRequest(_MessagesBase):
    pass


def _blocks(content, where: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_field(where, f"expected a string or a list of content blocks, got {_json_type(content)}")
    for j, b in enumerate(content):
        if not isinstance(b, dict):
            raise bad_field(f"{where}.{j}", f"expected a content block object, got {_json_type(b)}")
    return content


def _image(block: dict, where: str) -> dict:
    src = block.get("source")
    if not isinstance(src, dict):
        raise bad_field(f"{where}.source", "an image block needs a source object")
    if src.get("type") == "base64":
        media_type, data = (string_field(src, k, where + ".source") for k in ("media_type", "data"))
        url = f"data:{media_type};base64,{data}"
    elif src.get("type") == "url":
        url = string_field(src, "url", where + ".source")
    else:
        raise bad_field(f"{where}.source.type", f"expected base64 or url, got {src.get('type')!r}")
    return {"type": "image_url", "image_url": {"url": url}}


def _parts(blocks: list, where: str, allowed=("text", "image")) -> list:
    parts = []
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text" and "text" in allowed:
            parts.append({"type": "text", "text": string_field(b, "text", f"{where}.{j}")})
        elif kind == "image" and "image" in allowed:
            parts.append(_image(b, f"{where}.{j}"))
        else:
            raise bad_field(f"{where}.{j}.type", f"content block type {kind!r} is not supported here")
    return parts


def _tool_result(block: dict, where: str) -> dict:
    content = block.get("content", "")
    if isinstance(content, str):
        body: Union[str, list] = content
    else:
        parts = _parts(_blocks(content, f"{where}.content"), f"{where}.content")
        body = parts if any(p["type"] != "text" for p in parts) else "\n".join(p["text"] for p in parts)
    return {"role": "tool", "tool_call_id": string_field(block, "tool_use_id", where), "content": body}


def chat_messages(req: _MessagesBase) -> list:
    """The request's system and messages -> chat messages."""
    out = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else "\n".join(
            p["text"] for p in _parts(_blocks(req.system, "system"), "system", allowed=("text",)))
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad_field(where, f"expected a message object, got {_json_type(m)}")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad_field(f"{where}.role", f"must be user or assistant, got {role!r}")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if role == "user":
            results = [_tool_result(b, f"{where}.content.{j}") for j, b in enumerate(blocks)
                       if b.get("type") == "tool_result"]
            rest = [b for b in blocks if b.get("type") != "tool_result"]
            out += results
            if rest or not results:
                out.append({"role": "user", "content": _parts(rest, f"{where}.content")})
            continue
        msg: dict = {"role": "assistant", "content": None}
        for j, b in enumerate(blocks):
            w = f"{where}.content.{j}"
            kind = b.get("type")
            if kind == "text":
                msg["content"] = (msg["content"] or "") + string_field(b, "text", w)
            elif kind == "thinking":
                msg["reasoning_content"] = msg.get("reasoning_content", "") + string_field(b, "thinking", w)
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use":
                args = b.get("input", {})
                if not isinstance(args, dict):
                    raise bad_field(f"{w}.input", f"expected an object, got {_json_type(args)}")
                msg.setdefault("tool_calls", []).append({
                    "id": string_field(b, "id", w), "type": "function",
                    "function": {"name": string_field(b, "name", w),
                                 "arguments": json.dumps(args, ensure_ascii=False)}})
            else:
                raise bad_field(f"{w}.type", f"content block type {kind!r} is not supported in an assistant message")
        out.append(msg)
    if out and out[-1]["role"] == "assistant":
        raise bad_field(f"messages.{len(req.messages) - 1}",
                        "a conversation ending with an assistant message (prefill) is not supported")
    return out


def _tools(tools) -> Optional[list]:
    if tools is None:
        return None
    out = []
    for j, t in enumerate(tools):
        where = f"tools.{j}"
        if not isinstance(t, dict):
            raise bad_field(where, f"expected a tool object, got {_json_type(t)}")
        if t.get("type") not in (None, "custom"):
            raise bad_field(f"{where}.type",
                            f"only client tools (name, input_schema) are served here, not {t['type']!r}")
        out.append(function_tool(t, where, "input_schema", schema_required=True))
    return out


def _tool_choice(choice: Optional[dict]):
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": string_field(choice, "name", "tool_choice")}}
    raise bad_field("tool_choice.type", f"expected auto, any, tool or none, got {kind!r}")


def _thinking(thinking: Optional[dict]) -> Optional[bool]:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if kind in ("enabled", "adaptive", "between_tools"):
        budget = thinking.get("budget_tokens")
        if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise bad_field("thinking.budget_tokens", "expected a positive integer")
        return True
    raise bad_field("thinking.type", f"expected enabled, disabled or adaptive, got {kind!r}")


def _output_config(tok, config: Optional[dict]) -> tuple[Optional[dict], dict]:
    """output_config -> (chat response_format, chat extras for its effort)."""
    if not config:
        return None, {}
    effort = config.get("effort")
    if effort not in (None, "low", "medium", "high", "xhigh", "max"):
        raise bad_field("output_config.effort", f"expected low, medium, high, xhigh or max, got {effort!r}")
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_field("output_config.format", "expected {\"type\": \"json_schema\", \"schema\": {...}}")
        fmt = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return fmt, reasoning_effort_kwargs(tok, effort)[1]


def to_chat(state: ServerState, req: _MessagesBase, max_tokens: int, sampling: Optional[MessagesRequest] = None):
    extra = req.model_extra or {}
    thinking = _thinking(req.thinking)
    fmt, effort = _output_config(state.tokenizer, req.output_config)
    body = {"model": req.model, "messages": chat_messages(req), "max_tokens": max_tokens,
            "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice), "response_format": fmt,
            "chat_template_kwargs": {"thinking": thinking} if thinking is not None else None,
            **{k: extra[k] for k in _CHAT_EXTRAS if k in extra}, **effort}
    if req.tool_choice and req.tool_choice.get("disable_parallel_tool_use"):
        body["parallel_tool_calls"] = False
    if sampling is not None:
        body.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                    stop=sampling.stop_sequences)
    return chat_request({k: v for k, v in body.items() if v is not None})


# ---- output ----------------------------------------------------------------------------------------

def _sse(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _call_input(call) -> Optional[dict]:
    if not call.json_valid:
        return None
    return json.loads(call.arguments)


class _Blocks:
    """Turn events -> content blocks, and the stream's events. Thinking and text blocks stream as written;
    a tool_use block is sent whole when its call has closed (it must parse as an object)."""

    def __init__(self):
        self.blocks: list = []
        self._cur: Optional[dict] = None      # the open thinking or text block

    def feed(self, e: tuple) -> list:
        kind = e[0]
        if kind in ("reasoning", "text"):
            want = "thinking" if kind == "reasoning" else "text"
            out = [] if self._cur is not None and self._cur["type"] == want else self.close() + self._open(want)
            self._cur[want] += e[1]
            delta = {"type": "thinking_delta", "thinking": e[1]} if want == "thinking" else \
                {"type": "text_delta", "text": e[1]}
            return out + [_sse({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})]
        if kind == "call_done":
            call = e[1]
            args = _call_input(call)
            if args is None:    # not a JSON object: the call as written, as text
                return self.feed(("text", f"{call.name}({call.arguments})"))
            out = self.close()
            self.blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": args})
            i = len(self.blocks) - 1
            return out + [
                _sse({"type": "content_block_start", "index": i,
                      "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}}),
                _sse({"type": "content_block_delta", "index": i,
                      "delta": {"type": "input_json_delta", "partial_json": json.dumps(args, ensure_ascii=False)}}),
                _sse({"type": "content_block_stop", "index": i})]
        return []

    def _open(self, kind: str) -> list:
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
            {"type": "text", "text": ""}
        self.blocks.append(block)
        self._cur = block
        return [_sse({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})]

    def close(self) -> list:
        if self._cur is None:
            return []
        self._cur = None
        return [_sse({"type": "content_block_stop", "index": len(self.blocks) - 1})]


def _stop(end, stops: list, blocks: list) -> tuple[str, Optional[str]]:
    if end.finish_reason == "length":
        return "max_tokens", None
    if isinstance(end.stop_reason, str) and end.stop_reason in stops:
        return "stop_sequence", end.stop_reason
    if any(b["type"] == "tool_use" for b in blocks):
        return "tool_use", None
    return "end_turn", None


def _usage(end) -> dict:
    return {"input_tokens": end.prompt_tokens - end.cached_tokens, "output_tokens": end.output_tokens,
            "cache_read_input_tokens": end.cached_tokens, "cache_creation_input_tokens": 0,
            "output_tokens_details": {"thinking_tokens": end.reasoning_tokens}}


class _Run:
    def __init__(self, state: ServerState, req: MessagesRequest):
        self.state, self.req, self.mid = state, req, f"msg_{uuid.uuid4().hex}"
        self.out = _Blocks()

    def message(self, stop_reason=None, stop_sequence=None, usage=None) -> dict:
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.state.model_name,
                "content": self.out.blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage or {"input_tokens": 0, "output_tokens": 0}}

    async def whole(self, chat_req) -> dict:
        turn = await Turn.start(self.state, chat_req, self.mid)
        try:
            async for e in turn.events():
                if e[0] == "end":
                    self.out.close()
                    end = e[1]
                    return self.message(*_stop(end, self.req.stop_sequences or [], self.out.blocks), _usage(end))
                self.out.feed(e)
        finally:
            turn.close()
        raise APIError(500, "the generation ended without a result", type_="server_error")

    async def stream(self, turn: Turn):
        start = self.message(usage={"input_tokens": turn.plan.num_prompt_tokens, "output_tokens": 0})
        yield _sse({"type": "message_start", "message": {**start, "content": []}})
        yield _sse({"type": "ping"})
        try:
            async for e in turn.events():
                if e[0] == "end":
                    end = e[1]
                    for s in self.out.close():
                        yield s
                    reason, seq = _stop(end, self.req.stop_sequences or [], self.out.blocks)
                    yield _sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                "usage": _usage(end)})
                    yield _sse({"type": "message_stop"})
                    return
                for s in self.out.feed(e):
                    yield s
        except APIError as e:
            yield _sse(error_body(e.status, e.message))


def add_routes(app, state: ServerState, *, until_disconnect, check) -> None:
    """POST /v1/messages and /v1/messages/count_tokens, and the error-shape middleware of their paths.
    `check(state, chat_request)`: the server's checks of a generation request; `until_disconnect(raw,
    coro)`: a whole response aborted when its client leaves."""
    app.add_middleware(AnthropicErrorShape)

    @app.post(PREFIX, include_in_schema=False)
    async def create_message(req: MessagesRequest, raw: Request):
        chat_req = to_chat(state, req, req.max_tokens, req)
        check(state, chat_req)
        run = _Run(state, req)
        if not req.stream:
            return await until_disconnect(raw, run.whole(chat_req))
        turn = await Turn.start(state, chat_req, run.mid)     # refusals are a 4xx before the first byte
        return EventStreamResponse(run.stream(turn), turn.streams, send_timeout=state.stream_send_timeout)

    @app.post(PREFIX + "/count_tokens", include_in_schema=False)
    async def count_tokens(req: CountTokensRequest):
        chat_req = to_chat(state, req, 1)
        check(state, chat_req)
        plan = await asyncio.to_thread(Plan, state, chat_req)
        return {"input_tokens": plan.num_prompt_tokens}
