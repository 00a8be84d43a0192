"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A request becomes a chat request and runs through chat's path (serving/openai/turn.py): `instructions`
is a system message, then the stored conversation of `previous_response_id`, then the input items
as chat messages (a run of reasoning / assistant message / function_call items is one assistant
message with reasoning_content and tool_calls, a function_call_output a tool message answering its
call_id). The model's output comes back as output items in the order it wrote them: reasoning
(reasoning_text content), message (output_text) and function_call items, whose call_id is the id
the model gave the call, so sending it back renders the model's own call id.

Not served: built-in tools (web search, file search, computer use, MCP, custom tools), background
mode, truncation "auto", item references, file inputs, logprobs, reasoning summaries.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from fastapi import Request

from serving.openai.errors import APIError
from serving.openai.generation import ServerState
from serving.openai.protocol import Int, Num, _Base, _json_type, _Request
from serving.openai.response_store import MissingResponse, ResponseStore
from serving.openai.sse import EventStreamResponse
from serving.openai.turn import Turn, bad_field, chat_request, function_tool, reasoning_effort_kwargs, string_field

# chat sampling fields a Responses request may carry as vendor extras (n and logprobs stay chat's own)
_CHAT_EXTRAS = ("seed", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "logit_bias", "stop", "ignore_eos", "priority", "k3jax_test_script")


class ReasoningConfig(_Base):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[str] = None


class TextConfig(_Base):
    format: Optional[dict[str, Any]] = None
    verbosity: Optional[str] = None


class ResponsesRequest(_Request):
    model: Optional[str] = None
    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[None, Literal["none", "auto", "required"], dict[str, Any]] = None
    parallel_tool_calls: bool = True
    reasoning: Optional[ReasoningConfig] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[Int(ge=1, le=2**53)] = None
    temperature: Optional[Num(ge=0, le=2)] = None
    top_p: Optional[Num(gt=0, le=1)] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["disabled", "auto"]] = None
    background: Optional[bool] = None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input items -> chat messages ----------------------------------------------------------------

def _user_content(content, where: str):
    """A message's content (a string or input parts) -> chat content (a string or chat parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, f"expected a string or a list of content parts, got {_json_type(content)}")
    parts = []
    for j, p in enumerate(content):
        w = f"{where}.{j}"
        if not isinstance(p, dict):
            raise bad_field(w, f"expected a content part object, got {_json_type(p)}")
        kind = p.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": string_field(p, "text", w)})
        elif kind == "refusal":
            parts.append({"type": "text", "text": string_field(p, "refusal", w)})
        elif kind == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str) or not url:
                raise bad_field(f"{w}.image_url", "an input_image needs image_url (a URL or data URL; file_id is "
                                                 "not supported)", code="invalid_image")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise bad_field(f"{w}.type", f"content part type {kind!r} is not supported (input_text, input_image, "
                                        "output_text)")
    return parts


def _text_of(content) -> str:
    """Chat content that must be text (an assistant message's) -> one string."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p.get("type") == "text")


def input_messages(items) -> list:
    """Input items (or a previous response's output items) -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list = []
    pending: Optional[dict] = None     # the assistant message being assembled from consecutive items

    def assistant(fresh: bool = False) -> dict:
        nonlocal pending
        if pending is None or fresh:
            flush()
            pending = {"role": "assistant", "content": None}
        return pending

    def flush():
        nonlocal pending
        if pending is not None:
            out.append(pending)
            pending = None

    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_field(where, f"expected an input item object, got {_json_type(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_field(f"{where}.role", f"must be one of user, assistant, system, developer, got {role!r}")
            content = _user_content(item.get("content"), f"{where}.content")
            if role == "assistant":
                if isinstance(content, list) and any(p["type"] != "text" for p in content):
                    raise bad_field(f"{where}.content", "an assistant message holds text only")
                a = assistant(fresh=pending is not None and bool(pending.get("tool_calls")))
                a["content"] = (a["content"] or "") + _text_of(content)
            else:
                flush()
                out.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": string_field(item, "call_id", where), "type": "function",
                    "function": {"name": string_field(item, "name", where),
                                 "arguments": string_field(item, "arguments", where)}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = string_field(item, "call_id", where)
            output = item.get("output")
            content = output if isinstance(output, str) else _user_content(output, f"{where}.output")
            flush()
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise bad_field(f"{where}.content", "expected a list of reasoning_text parts")
            a = assistant(fresh=pending is not None and (pending["content"] is not None or "tool_calls" in pending))
            a["reasoning_content"] = a.get("reasoning_content", "") + "".join(p["text"] for p in parts)
        else:
            raise bad_field(f"{where}.type", f"input item type {kind!r} is not supported (message, function_call, "
                                            "function_call_output, reasoning)")
    flush()
    return out


def _tools(tools) -> Optional[list]:
    if tools is None:
        return None
    out = []
    for j, t in enumerate(tools):
        where = f"tools.{j}"
        if not isinstance(t, dict):
            raise bad_field(where, f"expected a tool object, got {_json_type(t)}")
        if t.get("type") != "function":
            raise bad_field(f"{where}.type", f"only function tools are served here, not {t.get('type')!r}",
                           code="unsupported_tool")
        out.append(function_tool(t, where, "parameters", schema_required=False))
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_field("tool_choice", "expected none, auto, required or {\"type\": \"function\", \"name\": ...}",
                   code="invalid_tool_choice")


def _response_format(text: Optional[TextConfig]) -> Optional[dict]:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_field("text.format.schema", "a json_schema format needs a schema object")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "response", "schema": fmt["schema"], "strict": fmt.get("strict")}}
    raise bad_field("text.format.type", f"expected text, json_object or json_schema, got {fmt.get('type')!r}")


def to_chat(state: ServerState, req: ResponsesRequest, history: list):
    """(the chat request, the chat messages this request adds to its conversation)."""
    if req.background:
        raise bad_field("background", "background responses are not supported")
    if req.truncation == "auto":
        raise bad_field("truncation", "only \"disabled\" is supported: a conversation over the context is a 400")
    added = input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history + added
    if not messages:
        raise bad_field("input", "no input: give at least one input item")
    extra = req.model_extra or {}
    kwargs, extras = reasoning_effort_kwargs(state.tokenizer, req.reasoning.effort if req.reasoning else None)
    if isinstance(extra.get("chat_template_kwargs"), dict):
        kwargs = {**extra["chat_template_kwargs"], **kwargs}
    body = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "user": req.user,
            "parallel_tool_calls": req.parallel_tool_calls, "tools": _tools(req.tools),
            "tool_choice": _tool_choice(req.tool_choice), "response_format": _response_format(req.text),
            "chat_template_kwargs": kwargs or None,
            **{k: extra[k] for k in _CHAT_EXTRAS if k in extra}, **extras}
    return chat_request({k: v for k, v in body.items() if v is not None}), added


# ---- output: turn events -> items and typed stream events -----------------------------------------

def _sse(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Output:
    """Turn events -> output items, and the stream's typed events (numbered by sequence_number)."""

    def __init__(self):
        self.items: list = []
        self.seq = 0
        self._cur: Optional[dict] = None     # the open reasoning or message item
        self._calls: dict = {}               # open call's tool index -> output position

    def ev(self, type_: str, **fields) -> str:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _sse(data)

    def feed(self, e: tuple) -> list:
        kind = e[0]
        if kind in ("reasoning", "text"):
            want = "reasoning" if kind == "reasoning" else "message"
            out = [] if self._cur is not None and self._cur["type"] == want else self._close() + self._open(want)
            item, pos = self._cur, len(self.items) - 1
            item["content"][0]["text"] += e[1]
            if want == "reasoning":
                out.append(self.ev("response.reasoning_text.delta", item_id=item["id"], output_index=pos,
                                   content_index=0, delta=e[1]))
            else:
                out.append(self.ev("response.output_text.delta", item_id=item["id"], output_index=pos,
                                   content_index=0, delta=e[1], logprobs=[]))
            return out
        if kind == "call":
            out = self._close()
            item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": e[2],
                    "name": e[3], "arguments": ""}
            self.items.append(item)
            self._calls[e[1]] = pos = len(self.items) - 1
            return out + [self.ev("response.output_item.added", output_index=pos, item=item)]
        if kind == "args":
            pos = self._calls[e[1]]
            item = self.items[pos]
            item["arguments"] += e[2]
            return [self.ev("response.function_call_arguments.delta", item_id=item["id"], output_index=pos,
                            delta=e[2])]
        if kind == "call_done":
            call = e[1]
            pos = self._calls.pop(call.index)
            item = self.items[pos]
            item["arguments"], item["status"] = call.arguments, "completed" if call.complete else "incomplete"
            return [self.ev("response.function_call_arguments.done", item_id=item["id"], output_index=pos,
                            name=item["name"], arguments=item["arguments"]),
                    self.ev("response.output_item.done", output_index=pos, item=item)]
        return []

    def end(self, incomplete: bool) -> list:
        return self._close("incomplete" if incomplete else "completed")

    def _open(self, kind: str) -> list:
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self._cur = item
        pos = len(self.items) - 1
        out = [self.ev("response.output_item.added", output_index=pos, item=item)]
        item["content"].append(part)
        out.append(self.ev("response.content_part.added", item_id=item["id"], output_index=pos, content_index=0,
                           part=part))
        return out

    def _close(self, status: str = "completed") -> list:
        item, self._cur = self._cur, None
        if item is None:
            return []
        pos = self.items.index(item)
        part = item["content"][0]
        item["status"] = status
        if item["type"] == "reasoning":
            done = self.ev("response.reasoning_text.done", item_id=item["id"], output_index=pos, content_index=0,
                           text=part["text"])
        else:
            done = self.ev("response.output_text.done", item_id=item["id"], output_index=pos, content_index=0,
                           text=part["text"], logprobs=[])
        return [done, self.ev("response.content_part.done", item_id=item["id"], output_index=pos, content_index=0,
                              part=part),
                self.ev("response.output_item.done", output_index=pos, item=item)]


class _Run:
    """One request's response object, from its turn's events; stored when done if the request asks."""

    def __init__(self, state: ServerState, store: ResponseStore, req: ResponsesRequest, added: list, rid: str):
        self.state, self.store, self.req, self.added, self.rid = state, store, req, added, rid
        self.created = int(time.time())
        self.out = _Output()

    def response(self, status: str, usage: Optional[dict] = None, error: Optional[dict] = None) -> dict:
        req = self.req
        fmt = (req.text.format if req.text is not None else None) or {"type": "text"}
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata or {}, "model": self.state.model_name, "output": self.out.items,
                "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
                "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
                "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
                "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": usage,
                "user": req.user}

    def finish(self, end) -> tuple[dict, list]:
        """(the final response, the closing events)."""
        incomplete = end.finish_reason == "length"
        events = self.out.end(incomplete)
        usage = {"input_tokens": end.prompt_tokens, "input_tokens_details": {"cached_tokens": end.cached_tokens},
                 "output_tokens": end.output_tokens,
                 "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
                 "total_tokens": end.prompt_tokens + end.output_tokens}
        resp = self.response("incomplete" if incomplete else "completed", usage)
        if self.req.store:
            said = input_messages(self.out.items) or [{"role": "assistant", "content": ""}]
            self.store.put(self.rid, resp, self.added + said, self.req.previous_response_id)
        return resp, events

    async def whole(self, chat_req) -> dict:
        turn = await Turn.start(self.state, chat_req, self.rid)
        try:
            async for e in turn.events():
                if e[0] == "end":
                    return self.finish(e[1])[0]
                self.out.feed(e)
        finally:
            turn.close()
        raise APIError(500, "the generation ended without a result", type_="server_error")

    async def stream(self, turn: Turn):
        out = self.out
        yield out.ev("response.created", response=self.response("in_progress"))
        yield out.ev("response.in_progress", response=self.response("in_progress"))
        try:
            async for e in turn.events():
                if e[0] == "end":
                    resp, events = self.finish(e[1])
                    for s in events:
                        yield s
                    yield out.ev(f"response.{resp['status']}", response=resp)
                    return
                for s in out.feed(e):
                    yield s
        except APIError as e:
            yield out.ev("error", code=e.code or e.type, message=e.message, param=e.param)
            yield out.ev("response.failed", response=self.response(
                "failed", error={"code": e.code or e.type, "message": e.message}))


def _not_found(rid: str, param: Optional[str] = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(404, f"{what} with id {rid!r} not found.", type_="invalid_request_error", param=param,
                    code="previous_response_not_found" if param else "response_not_found")


def add_routes(app, state: ServerState, *, until_disconnect, check) -> None:
    """POST /v1/responses, GET / DELETE /v1/responses/{id}. `check(state, chat_request)`: the server's
    checks of a generation request (model name, ...); `until_disconnect(raw, coro)`: a whole response
    aborted when its client leaves."""
    store = ResponseStore(state.response_store_size, state.response_store_ttl_s)
    app.state.response_store = store

    @app.post("/v1/responses", include_in_schema=False)
    async def create_response(req: ResponsesRequest, raw: Request):
        history = []
        if req.previous_response_id is not None:
            try:
                history = store.conversation(req.previous_response_id)
            except MissingResponse as e:
                raise _not_found(e.rid, "previous_response_id") from None
        chat_req, added = to_chat(state, req, history)
        check(state, chat_req)
        run = _Run(state, store, req, added, _id("resp"))
        if not req.stream:
            return await until_disconnect(raw, run.whole(chat_req))
        turn = await Turn.start(state, chat_req, run.rid)      # refusals are a 4xx before the first byte
        return EventStreamResponse(run.stream(turn), turn.streams, send_timeout=state.stream_send_timeout)

    @app.get("/v1/responses/{response_id}", include_in_schema=False)
    async def get_response(response_id: str):
        try:
            return store.get(response_id).response
        except MissingResponse:
            raise _not_found(response_id) from None

    @app.delete("/v1/responses/{response_id}", include_in_schema=False)
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
