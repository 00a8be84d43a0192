"""What Kimi K3 generates, parsed into reasoning, content and tool calls (spec 8b).

After the prompt's `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>` the model writes

    reasoning <|close|>think<|sep|> <|open|>response<|sep|> answer <|close|>response<|sep|>
    [<|open|>tools<|sep|> <|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|> ...
     <|close|>call<|sep|> ... <|close|>tools<|sep|>] <|close|>message<|sep|><|end_of_msg|>

We parse ids, not text. `<|open|>`, `<|close|>`, `<|sep|>` are single special ids, so a tag is
exactly the ids between an open/close id and the next `<|sep|>`: it is held until complete
(a tag split over many stream deltas never leaks), and message text can never close an
element (text that spells `<|close|>argument<|sep|>` is ordinary ids). Rules, the same for
one-shot and streaming (parse_output is the stream parser fed everything at once):

- the start state comes from the prompt (thinking_started_from_prompt): inside `think`
  (True), inside `response` (None), or at message level (False).
- think text is reasoning, response text is content. Text at message level outside any
  element is content too (a model that skips the response tags), except whitespace-only
  runs between elements. Text inside tools but outside calls is kept aside; other special
  ids are dropped. The text of an element we do not know belongs to the element around it.
- an element closes at its own close tag, or implicitly: opening response / tools / think
  closes the channel that is open (a missing `<|close|>think<|sep|>`), a call outside tools
  opens tools, a new call closes an unclosed one. A close tag of an element that is not open
  is ignored. If the output ends inside think, it is all reasoning.
- a call becomes a tool call when it closes (complete when closed by its own tag). Its name is
  the unescaped `tool` attribute (a call without one is dropped); arguments are the object
  built from its argument elements (string raw, other types JSON-decoded, undecodable JSON
  kept as text), serialized as JSON, or the text of a `json` element. Its id is
  `NAME:N`, N counting the calls of the conversation from 0 (sglang's K3 ids).
- a tools channel that yields no call gives its stray text to the content instead (a model
  that wrote its call some other way must not end in an empty turn).
- with tools=False (none declared) tool calls are parsed and dropped: the channel's markup
  never reaches the content.
"""

from __future__ import annotations

import json
import re
from typing import Iterable, Optional

from k3jax.tokenizer import IncrementalDetokenizer
from k3jax.tokenizer import k3_format as fmt
from serving.openai.deltas import Delta, DeltaList, TokenStreamParser, ToolCall, is_json_object

_ATTR = re.compile(r'([\w-]+)="([^"]*)"')
_CHANNELS = ("think", "response", "tools")
_KNOWN = _CHANNELS + ("message", "call", "argument", "json")


def _tag(text: str) -> tuple[str, dict]:
    text = text.strip()
    name = text.split(None, 1)[0] if text else ""
    return name, {k: fmt.unescape_attr(v) for k, v in _ATTR.findall(text)}


def thinking_started_from_prompt(tok, prompt_ids: Iterable[int], *, default: Optional[bool] = True
                                 ) -> Optional[bool]:
    """Where the output starts: inside think (True), inside response (None), message level (False)."""
    ids = [int(t) for t in prompt_ids]
    sep, opn = tok.id_of(fmt.SEP), tok.id_of(fmt.OPEN)
    if len(ids) >= 2 and ids[-1] == sep and opn in ids:
        start = len(ids) - 1 - ids[::-1].index(opn)
        name, attrs = _tag(tok.decode(ids[start + 1:-1]))
        if name == "think":
            return True
        if name == "response":
            return None
        if name == "message":
            return False
    return default


def forced_tool_prefix(tok, name: Optional[str], prompt_ids: Iterable[int]) -> list[int]:
    """Ids that close the open channel and open the tools channel (and, with a name, its call),
    so the output is a tool call (tool_choice "required" or named)."""
    state = thinking_started_from_prompt(tok, prompt_ids, default=False)
    out = fmt.Writer(None)
    if state is True:
        out.close("think")
        out.open("response")
    if state is not False:
        out.close("response")
    out.open("tools")
    if name is not None:
        out.open("call", [("tool", name), ("index", 1)])
    return fmt.encode(tok, out)


class K3OutputParser(TokenStreamParser):
    """Streaming parser: feed(ids) / finish() -> OpenAI deltas ({"reasoning_content"}, {"content"},
    {"tool_calls"}); `tool_calls` holds the calls found so far. See the module docstring."""

    def __init__(self, tok, *, thinking_started: Optional[bool] = True, tools: bool = True,
                 first_call_number: int = 0):
        self._tok = tok
        self._open, self._close = tok.id_of(fmt.OPEN), tok.id_of(fmt.CLOSE)
        self._sep, self._eom = tok.id_of(fmt.SEP), tok.id_of(fmt.END_OF_MSG)
        self._emit_calls = tools
        self._first = first_call_number
        self._stack = {True: ["message", "think"], None: ["message", "response"], False: ["message"]}[thinking_started]
        self._reasoning = IncrementalDetokenizer(tok)
        self._content = IncrementalDetokenizer(tok)
        self._tag: Optional[list] = None      # [is_open, ids] while a tag is being read
        self._gap = ""                        # message-level whitespace waiting for text
        self._value: Optional[list] = None    # ids of the argument / json element being read
        self._call: Optional[dict] = None
        self._stray: list = []                # ids of text inside tools but outside calls
        self._calls_in_channel = 0
        self._done = False
        self.tool_calls: list[ToolCall] = []

    # ---- public -------------------------------------------------------------------------

    @property
    def in_reasoning(self) -> bool:
        """The think channel is open: the next text id would be reasoning."""
        return "think" in self._stack

    def finish(self) -> list[Delta]:
        """End of output: an unfinished tag is dropped, open elements close implicitly."""
        if self._done:
            return []
        out = DeltaList()
        self._tag = None
        self._pop_to(0, out)
        out.text("reasoning_content", self._reasoning.flush())
        out.text("content", self._content.flush())
        self._done = True
        return list(out)

    # ---- ids ----------------------------------------------------------------------------

    def _step(self, t: int, out: DeltaList) -> None:
        if t == self._open or t == self._close:
            if self._tag is not None:          # a tag never closed by <|sep|>: take it as it is
                self._end_tag(out)
            self._tag = [t == self._open, []]
        elif t == self._sep:
            if self._tag is not None:
                self._end_tag(out)
        elif t == self._eom:
            self._tag = None
            self._pop_to(0, out)
        elif self._tok.is_special(t):
            return
        elif self._tag is not None:
            self._tag[1].append(t)
        else:
            self._text(t, out)

    def _text(self, t: int, out: DeltaList) -> None:
        # an element we do not know is transparent: its text goes where the text around it goes
        where = next((n for n in reversed(self._stack) if n in _KNOWN), None)
        if where == "think":
            out.text("reasoning_content", self._reasoning.push(t))
        elif where == "response":
            out.text("content", self._content.push(t))
        elif where in ("argument", "json"):
            self._value.append(t)
        elif where == "tools":
            self._stray.append(t)
        elif where == "message":
            s = self._content.push(t)
            if (self._gap + s).strip():
                out.text("content", self._gap + s)
                self._gap = ""
            else:
                self._gap += s

    # ---- tags ---------------------------------------------------------------------------

    def _end_tag(self, out: DeltaList) -> None:
        is_open, ids = self._tag
        self._tag = None
        self._gap = ""
        name, attrs = _tag(self._tok.decode(ids))
        if is_open:
            self._open_element(name, attrs, out)
        elif name in self._stack:
            self._pop_to(len(self._stack) - 1 - self._stack[::-1].index(name), out, own=True)

    def _open_element(self, name: str, attrs: dict, out: DeltaList) -> None:
        stack = self._stack
        if name == "message":
            if not stack:
                stack.append("message")
            return
        if not stack:
            return   # after the message closed nothing is parsed
        if name in _CHANNELS:
            self._pop_to(1, out)
            stack.append(name)
            if name == "tools":
                self._calls_in_channel, self._stray = 0, []
        elif name == "call":
            if "tools" not in stack:
                self._open_element("tools", {}, out)
            self._pop_to(stack.index("tools") + 1, out)
            stack.append("call")
            self._call = {"name": attrs.get("tool", ""), "args": {}, "raw": None, "complete": True}
        elif name in ("argument", "json") and "call" in stack:
            self._pop_to(stack.index("call") + 1, out)
            stack.append(name)
            self._value = []
            self._call["key"], self._call["type"] = attrs.get("key", ""), attrs.get("type", "string")
        else:
            stack.append(name)   # an element we do not know (transparent for text)

    def _pop_to(self, depth: int, out: DeltaList, own: bool = False) -> None:
        """Close elements until `depth` are left; own: the innermost one closed by its own tag."""
        while len(self._stack) > depth:
            name = self._stack.pop()
            closed_by_tag = own and len(self._stack) == depth
            if name in ("argument", "json"):
                text = self._tok.decode(self._value or [])
                if name == "json":
                    self._call["raw"] = text
                else:
                    self._call["args"][self._call["key"]] = fmt.parse_value(text, self._call["type"])
                self._call["complete"] &= closed_by_tag
                self._value = None
            elif name == "call":
                self._call["complete"] &= closed_by_tag
                self._end_call(out)
            elif name == "tools":
                if self._calls_in_channel == 0 and self._stray:
                    out.text("content", self._tok.decode(self._stray))
                self._stray = []

    def _end_call(self, out: DeltaList) -> None:
        call, self._call = self._call, None
        if not call["name"]:
            return
        self._calls_in_channel += 1
        if not self._emit_calls:
            return
        if call["raw"] is not None:
            args = call["raw"]
        else:
            args = json.dumps(call["args"], ensure_ascii=False)
        index = len(self.tool_calls)
        tc = ToolCall(f"{call['name']}:{self._first + index}", call["name"], args, index,
                      complete=call["complete"], json_valid=is_json_object(args))
        self.tool_calls.append(tc)
        out.header(tc)
        out.arguments(index, args)


def count_tool_calls(messages) -> int:
    """Tool calls made by the assistant messages of a conversation (numbers the next ids)."""
    return sum(len(m.get("tool_calls") or []) for m in messages
               if isinstance(m, dict) and m.get("role") == "assistant")
