"""One generated assistant turn as ordered output events, for the APIs that answer in typed items
(the Responses API, the Anthropic Messages API).

Their modules convert a request into a ChatCompletionRequest; from there it is chat's own path:
chat.Plan renders the prompt (Kimi's template or K3's tagged format) and sets tool choice,
structured output and sampling, the engine generates, and chat's output parser splits the ids into
reasoning, answer text and tool calls. What this module adds is order: events come in the order the
model wrote them, so an API opens one output item per run of one kind, streamed or not (a whole
response is its stream's events collected, so the two cannot disagree).

Events (tuples):
  ("reasoning", text)        reasoning text (Kimi's <think> ... </think>, K3's think channel)
  ("text", text)             answer text, held back while it could begin a stop string, cut at one
  ("call", index, id, name)  a tool call's header
  ("args", index, text)      a piece of that call's arguments
  ("call_done", ToolCall)    the call has closed: its final arguments, json_valid
  ("end", TurnEnd)           last
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Optional

from pydantic import ValidationError

from serving.openai.chat import Plan
from serving.openai.errors import APIError, bad_request
from serving.openai.generation import ServerState, admit_choices, stream_choices
from serving.openai.protocol import ChatCompletionRequest, _json_type
from serving.stop import StopStringStream


def chat_request(body: dict) -> ChatCompletionRequest:
    """A chat request built by an API's converter; a value the chat request refuses (a vendor extra of
    the wrong type) is a 400 naming it."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()) if isinstance(x, (str, int)))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise bad_request(f"{loc}: {msg}" if loc else msg, param=loc or None) from None



# ---- request fields, for the converters ---------------------------------------------------------

def bad_field(where: str, message: str, code: Optional[str] = None) -> APIError:
    """A 400 naming the request field at `where` (a dotted path, also the error's param)."""
    return bad_request(f"{where}: {message}", param=where, code=code)


def string_field(obj: dict, key: str, where: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise bad_field(f"{where}.{key}", f"expected a string, got {_json_type(v)}")
    return v


def function_tool(tool: dict, where: str, schema_key: str, schema_required: bool) -> dict:
    """A client tool (name, description, its JSON schema under schema_key) -> a chat function tool."""
    fn = {"name": string_field(tool, "name", where)}
    if tool.get("description") is not None:
        fn["description"] = string_field(tool, "description", where)
    schema = tool.get(schema_key)
    if schema is not None or schema_required:
        if not isinstance(schema, dict):
            raise bad_field(f"{where}.{schema_key}", f"expected a JSON schema object, got {_json_type(schema)}")
        fn["parameters"] = schema
    return {"type": "function", "function": fn}

@dataclasses.dataclass
class TurnEnd:
    finish_reason: Optional[str]      # "stop" (EOS, stop string or stop id) or "length"
    stop_reason: object               # the matched stop string / stop token id; None for EOS and length
    prompt_tokens: int                # images counted at their placeholder count
    output_tokens: int
    reasoning_tokens: int             # ids generated inside the reasoning channel, its markers included
    cached_tokens: int
    tool_calls: list                  # every closed call (tool_parser.ToolCall)


class TurnParser:
    """Generated ids -> ordered events (the module docstring), one id at a time through chat's stream parser."""

    def __init__(self, plan: Plan, tok):
        self._p, first = plan.stream_parser(tok)   # (a forced call's prefix is not counted as output)
        self._text = StopStringStream(plan.params.stop, plan.params.include_stop_str_in_output)
        self._open: Optional[int] = None          # the call whose arguments may still grow
        self._final = (False, None)
        self.reasoning_tokens = 0
        self.first = self._events(first)

    def feed(self, token_ids, final: bool = False, stop_reason=None) -> list:
        """final: the ids of the output that finished (answer text in them is cut at the stop string the
        engine matched, as the engine cut its own text)."""
        self._final = (final, stop_reason)
        out = []
        for t in token_ids:
            before = self._p.in_reasoning
            deltas = self._p.feed([t])
            if before or self._p.in_reasoning:
                self.reasoning_tokens += 1
            out += self._events(deltas)
        return out

    def finish(self, stop_reason) -> list:
        out = self._events(self._p.finish()) + self._close_call()
        tail = self._text.feed("", True, stop_reason)
        if tail:
            out.append(("text", tail))
        return out

    @property
    def tool_calls(self) -> list:
        return self._p.tool_calls

    def _close_call(self) -> list:
        if self._open is None:
            return []
        call, self._open = self._p.tool_calls[self._open], None
        return [("call_done", call)]

    def _events(self, deltas) -> list:
        out = []
        for d in deltas:
            for key, val in d.items():
                if key == "reasoning_content":
                    out += self._close_call()
                    out.append(("reasoning", val))
                elif key == "content":
                    out += self._close_call()
                    s = self._text.feed(val, *self._final)
                    if s:
                        out.append(("text", s))
                elif key == "tool_calls":
                    for frag in val:
                        fn = frag.get("function") or {}
                        if "id" in frag:         # a header: the call before it has closed
                            out += self._close_call()
                            self._open = frag["index"]
                            out.append(("call", frag["index"], frag["id"], fn.get("name", "")))
                        if fn.get("arguments"):
                            out.append(("args", frag["index"], fn["arguments"]))
        return out


class Turn:
    """A converted request, planned and admitted: its refusals (bad conversation, context, full queue) are
    raised by `start`, before a stream sends its first byte."""

    def __init__(self, state: ServerState, plan: Plan, streams: list, request_id: str):
        self.state, self.plan, self.streams, self.request_id = state, plan, streams, request_id

    @classmethod
    async def start(cls, state: ServerState, req: ChatCompletionRequest, request_id: str) -> "Turn":
        # rendering, tokenizing and image decoding are CPU work: off the event loop, as chat does
        plan = await asyncio.to_thread(Plan, state, req)
        streams = await admit_choices(state, plan.prompt, plan.params, request_id, plan.matcher_factory,
                                      req.priority, images=plan.images)
        return cls(state, plan, streams, request_id)

    async def events(self) -> AsyncIterator[tuple]:
        """The turn's events; engine errors are raised as APIError."""
        parser = TurnParser(self.plan, self.state.tokenizer)
        for e in parser.first:
            yield e
        async for _, out in stream_choices(self.state, self.plan.prompt, self.plan.params, self.request_id,
                                           images=self.plan.images, streams=self.streams):
            comp = out.outputs[0]
            for e in parser.feed(out.metrics.get("new_token_ids", ()), out.finished, comp.stop_reason):
                yield e
            if out.finished:
                for e in parser.finish(comp.stop_reason):
                    yield e
                yield ("end", TurnEnd(comp.finish_reason, comp.stop_reason, self.plan.num_prompt_tokens,
                                      len(comp.token_ids), parser.reasoning_tokens, out.num_cached_tokens,
                                      list(parser.tool_calls)))

    def close(self):
        for s in self.streams:
            s.close()


def reasoning_effort_kwargs(tok, effort: Optional[str]) -> tuple[dict, dict]:
    """An OpenAI reasoning effort (none, minimal, low, medium, high, xhigh) -> (chat_template_kwargs,
    chat request extras). K3 takes its own efforts (low, high, max; "none" turns thinking off); Kimi's
    template only turns thinking off."""
    if effort is None:
        return {}, {}
    if getattr(tok, "message_format", "kimi") == "k3":
        k3 = {"none": "none", "minimal": "low", "low": "low", "medium": "high", "high": "high",
              "xhigh": "max", "max": "max"}[effort]
        return {}, {"reasoning_effort": k3}
    return ({"thinking": False}, {}) if effort == "none" else ({}, {})
