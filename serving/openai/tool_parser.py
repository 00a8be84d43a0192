"""Kimi tool calls from generated token ids (spec section 8): one-shot and streaming.

    [content] <|tool_calls_section_begin|>
      (<|tool_call_begin|> functions.NAME:IDX <|tool_call_argument_begin|> {json} <|tool_call_end|>)*
    <|tool_calls_section_end|>

We parse ids, not text: every marker is one special id, so a marker can never be split
across stream deltas, a greedy pattern can never merge two calls, and no special token can
reach the content. Rules (the same in `parse_tool_calls` and `ToolCallStreamParser`):

- content = the ordinary ids outside every section (before it, or after its end), decoded
  as one text. Special ids other than the five tool markers (EOS, <|im_end|>, </think>, ...)
  are dropped everywhere. Ordinary ids inside a section but between calls are dropped.
- a call's id = its header text with all whitespace removed (models put newlines there);
  name = the id without a leading "functions.", up to the last ":" (whole id if no ":").
- a call ends at <|tool_call_end|> (complete=True) or, malformed, at the next
  <|tool_call_begin|>, at a section marker, or at the end of the output (complete=False).
  A header never followed by <|tool_call_argument_begin|> has arguments "".
- <|tool_call_begin|> outside a section opens one implicitly.
- a call whose id is empty is dropped; index counts the kept calls from 0.
- arguments are kept exactly as generated; json_valid says whether they parse as a JSON
  object (the server decides what to do with invalid ones).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

from k3jax.tokenizer import IncrementalDetokenizer
from serving.openai import k3_parser
from serving.openai.deltas import Delta, DeltaList, TokenStreamParser, ToolCall, is_json_object  # noqa: F401 (re-exported)

class Markers:
    """The five tool-call marker ids of a KimiTokenizer."""

    def __init__(self, tok):
        self.section_begin = tok.id_of("<|tool_calls_section_begin|>")
        self.section_end = tok.id_of("<|tool_calls_section_end|>")
        self.call_begin = tok.id_of("<|tool_call_begin|>")
        self.arg_begin = tok.id_of("<|tool_call_argument_begin|>")
        self.call_end = tok.id_of("<|tool_call_end|>")


def split_call_id(header_text: str) -> tuple[str, str]:
    """Header text between call-begin and argument-begin -> (id, name)."""
    cid = "".join(header_text.split())
    name = cid[len("functions."):] if cid.startswith("functions.") else cid
    if ":" in name:
        name = name[: name.rindex(":")]
    return cid, name


def tool_call_to_openai(call: ToolCall) -> dict:
    """ToolCall -> an OpenAI `message.tool_calls[i]` dict."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def forced_tool_prefix(tok, name: Optional[str] = None, prompt_ids=()) -> list[int]:
    """Ids to append to the prompt so generation starts inside a tool call.

    name=None (tool_choice "required"): section-begin + call-begin; the model writes the
    header. name given (named tool_choice): also `functions.{name}:0` + argument-begin, so
    the model writes only the arguments. Feed the same ids to the stream parser before the
    generated ids (it then knows it is inside a call; with a name it emits the header delta).
    A K3-format tokenizer: k3_parser.forced_tool_prefix (it needs the prompt's open channel).
    """
    if getattr(tok, "message_format", "kimi") == "k3":
        return k3_parser.forced_tool_prefix(tok, name, prompt_ids)
    m = Markers(tok)
    ids = [m.section_begin, m.call_begin]
    if name is not None:
        ids += tok.encode(f"functions.{name}:0") + [m.arg_begin]
    return ids


# ---- one-shot ---------------------------------------------------------------------------


@dataclasses.dataclass
class _RawCall:
    header: list = dataclasses.field(default_factory=list)
    args: list = dataclasses.field(default_factory=list)
    has_args: bool = False
    complete: bool = False


def parse_tool_calls(tok, token_ids: Iterable[int]) -> tuple[str, list[ToolCall]]:
    """Generated ids [T] -> (content text, tool calls). See the module docstring for the rules."""
    m = Markers(tok)
    content: list[int] = []
    raws: list[_RawCall] = []
    cur: Optional[_RawCall] = None
    in_section = False
    for t in map(int, token_ids):
        if t in (m.section_begin, m.section_end, m.call_begin):
            if cur is not None:
                raws.append(cur)
                cur = None
            if t == m.call_begin:
                cur, in_section = _RawCall(), True
            else:
                in_section = t == m.section_begin
        elif t == m.call_end:
            if cur is not None:
                cur.complete = True
                raws.append(cur)
                cur = None
        elif t == m.arg_begin:
            if cur is not None:
                cur.has_args = True
        elif tok.is_special(t):
            continue
        elif cur is not None:
            (cur.args if cur.has_args else cur.header).append(t)
        elif not in_section:
            content.append(t)
    if cur is not None:
        raws.append(cur)
    calls: list[ToolCall] = []
    for raw in raws:
        cid, name = split_call_id(tok.decode(raw.header))
        if not cid:
            continue
        args = tok.decode(raw.args)
        calls.append(ToolCall(cid, name, args, len(calls), raw.complete, is_json_object(args)))
    return tok.decode(content), calls


# ---- streaming --------------------------------------------------------------------------


class ToolCallStreamParser(TokenStreamParser):
    """Streaming version of parse_tool_calls: feed each step's new ids, get OpenAI deltas.

    Deltas: {"content": str}; {"tool_calls": [{"index", "id", "type": "function",
    "function": {"name", "arguments": ""}}]} once a call's header is complete; then
    {"tool_calls": [{"index", "function": {"arguments": str}}]}. Text is cut only at whole
    UTF-8 characters. For every split of the ids into feed() calls, the concatenated deltas
    equal parse_tool_calls(all ids), and `tool_calls` equals its call list after finish().
    """

    def __init__(self, tok):
        self._tok = tok
        self._m = Markers(tok)
        self._content = IncrementalDetokenizer(tok)
        self._in_section = False
        self._in_call = False
        self._header: Optional[list] = None       # header ids while the header is open
        self._cur: Optional[ToolCall] = None      # the kept call receiving arguments
        self._args: Optional[IncrementalDetokenizer] = None
        self._arg_parts: list[str] = []
        self._done = False
        self.tool_calls: list[ToolCall] = []

    def finish(self) -> list[Delta]:
        """End of output: close an open call, flush held bytes."""
        if self._done:
            return []
        out = DeltaList()
        self._close(out, complete=False)
        out.text("content", self._content.flush())
        self._done = True
        return list(out)

    def _step(self, t: int, out: DeltaList) -> None:
        m = self._m
        if t in (m.section_begin, m.section_end, m.call_begin):
            self._close(out, complete=False)
            if t == m.call_begin:
                self._in_call = self._in_section = True
                self._header = []
            else:
                self._in_section = t == m.section_begin
        elif t == m.call_end:
            self._close(out, complete=True)
        elif t == m.arg_begin:
            if self._header is not None:
                self._end_header(out)
        elif self._tok.is_special(t):
            return
        elif self._header is not None:
            self._header.append(t)
        elif self._in_call:
            if self._cur is not None:
                s = self._args.push(t)
                self._arg_parts.append(s)
                out.arguments(self._cur.index, s)
        elif not self._in_section:
            out.text("content", self._content.push(t))

    def _end_header(self, out: DeltaList) -> None:
        cid, name = split_call_id(self._tok.decode(self._header))
        self._header = None
        if not cid:
            return  # dropped call: its arguments are ignored
        self._cur = ToolCall(cid, name, "", len(self.tool_calls), complete=False, json_valid=False)
        self.tool_calls.append(self._cur)
        self._args = IncrementalDetokenizer(self._tok)
        self._arg_parts = []
        out.header(self._cur)

    def _close(self, out: DeltaList, complete: bool) -> None:
        if not self._in_call:
            return
        if self._header is not None:
            self._end_header(out)
        if self._cur is not None:
            s = self._args.flush()
            out.arguments(self._cur.index, s)
            self._cur.arguments = "".join(self._arg_parts) + s
            self._cur.complete = complete
            self._cur.json_valid = is_json_object(self._cur.arguments)
        self._in_call = False
        self._cur = self._args = None
        self._arg_parts = []


def merge_deltas(deltas: Iterable[Delta]) -> Optional[Delta]:
    """Several deltas of one step -> one OpenAI delta (None if empty).

    Text fields are concatenated; tool-call fragments of the same index are merged (a header
    fragment keeps its id/type/name). Per-field accumulation gives the same result as
    accumulating the unmerged deltas.
    """
    merged: dict = {}
    calls: dict[int, dict] = {}
    for d in deltas:
        for key, val in d.items():
            if key != "tool_calls":
                merged[key] = merged.get(key, "") + val
                continue
            for frag in val:
                have = calls.get(frag["index"])
                if have is None:
                    calls[frag["index"]] = {**frag, "function": dict(frag["function"])}
                else:
                    for k, v in frag.items():
                        if k == "function":
                            fn = have["function"]
                            fn["arguments"] = fn.get("arguments", "") + v.get("arguments", "")
                            if "name" in v:
                                fn.setdefault("name", v["name"])
                        elif k != "index":
                            have.setdefault(k, v)
    if calls:
        merged["tool_calls"] = list(calls.values())
    return merged or None
