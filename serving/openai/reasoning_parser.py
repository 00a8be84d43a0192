"""Kimi reasoning (`<think>...</think>`) from generated token ids, one-shot and streaming,
plus the composition reasoning -> tool calls that the server runs on every output.

Where the output starts is the caller's knowledge of the prompt, passed as thinking_started
(use `thinking_started_from_prompt`):

- True (default; thinking on: the prompt ends with `<|im_assistant|>assistant<|im_middle|>`
  or with `<think>`): the output starts inside reasoning. A leading `<think>` is optional.
  Reasoning ends at `</think>` or at the tool-call section (`<|tool_calls_section_begin|>`,
  or a bare `<|tool_call_begin|>`). If neither comes, everything is reasoning (the output was
  cut off while thinking) and the content is empty.
- False (a model that writes its tags explicitly and may skip thinking): the output starts
  as content; a `<think>` id opens reasoning until `</think>` / the tool-call section.
- None (thinking off: the prompt already holds `<think></think>`): everything is content.

Why not vLLM's one-shot rule ("no tag at all -> content, text before `</think>` ->
reasoning"): it needs to see the end of the output before classifying its start, so a
stream would have to hold back the whole reasoning; its streaming parser guesses instead
and can disagree with its one-shot parser. Here the state is decided by the ids seen so
far, so streamed == one-shot for every split. After the tool-call section has begun
nothing is reasoning any more (a `<think>` there cannot tear a call apart). `<think>` /
`</think>` ids never appear in the content ids; other special ids inside reasoning are
dropped; in content they are passed on (the tool parser drops them). Text is kept as
generated (no strip), so streamed and one-shot agree.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

from k3jax.tokenizer import IncrementalDetokenizer
from serving.openai import k3_parser
from serving.openai.tool_parser import (Delta, DeltaList, Markers, ToolCall, ToolCallStreamParser,
                                        merge_deltas, parse_tool_calls)

_REASONING, _CONTENT, _TOOLS = 0, 1, 2


def _is_k3(tok) -> bool:
    # K3 speaks its tagged format (serving.openai.k3_parser); K2 / Kimi Linear the one here
    return getattr(tok, "message_format", "kimi") == "k3"


def thinking_started_from_prompt(tok, prompt_ids: Iterable[int], *, default: Optional[bool] = True
                                 ) -> Optional[bool]:
    """Prompt ids (before any forced tool prefix) -> thinking_started for the parsers.

    Ends with `</think>` (thinking disabled by the template): None; with `<think>`: True.
    Otherwise `default`: True suits Kimi's thinking models, which start thinking right after
    `<|im_middle|>`; pass False for a model that does not think (e.g. an Instruct model),
    else its whole answer would be classified as reasoning.
    A K3-format tokenizer: where its tagged output starts (k3_parser.thinking_started_from_prompt).
    """
    if _is_k3(tok):
        return k3_parser.thinking_started_from_prompt(tok, prompt_ids, default=default)
    ids = list(prompt_ids)
    if ids and int(ids[-1]) == tok.id_of("</think>"):
        return None
    if ids and int(ids[-1]) == tok.id_of("<think>"):
        return True
    return default


class _Router:
    """The id-level state machine shared by both modes: routes one id to reasoning or content."""

    def __init__(self, tok, thinking_started: Optional[bool]):
        self.tok = tok
        self.think, self.unthink = tok.id_of("<think>"), tok.id_of("</think>")
        m = Markers(tok)
        self.tool_start = (m.section_begin, m.call_begin)
        self.state = {True: _REASONING, False: _CONTENT, None: _TOOLS}[thinking_started]

    def route(self, t: int) -> Optional[bool]:
        """True: reasoning id; False: content id; None: dropped."""
        if t == self.think or t == self.unthink:
            if self.state != _TOOLS:
                self.state = _REASONING if t == self.think else _CONTENT
            return None
        if t in self.tool_start:
            self.state = _TOOLS
            return False
        if self.state == _REASONING:
            return None if self.tok.is_special(t) else True
        return False


def parse_reasoning(tok, token_ids: Iterable[int], *, thinking_started: Optional[bool] = True
                    ) -> tuple[str, list[int]]:
    """Generated ids [T] -> (reasoning text, content ids [T'] for the tool-call parser)."""
    router = _Router(tok, thinking_started)
    reasoning: list[int] = []
    content: list[int] = []
    for t in map(int, token_ids):
        r = router.route(t)
        if r is not None:
            (reasoning if r else content).append(t)
    return tok.decode(reasoning), content


class ReasoningStreamParser:
    """Streaming parse_reasoning. For every split of the ids into feed() calls, the streamed
    reasoning equals the one-shot reasoning and the passed-on content ids are the same.

    feed(ids) -> [{"reasoning_content": s} / {"content": s}] decodes the content itself
    (special ids skipped); feed_ids(ids) -> (reasoning deltas, content ids) hands the content
    ids on instead (to a ToolCallStreamParser). Use one of the two per parser, then finish().
    """

    def __init__(self, tok, *, thinking_started: Optional[bool] = True):
        self._tok = tok
        self._router = _Router(tok, thinking_started)
        self._reasoning = IncrementalDetokenizer(tok)
        self._content = IncrementalDetokenizer(tok, skip_special=True)
        self._done = False

    @property
    def in_reasoning(self) -> bool:
        return self._router.state == _REASONING

    def feed_ids(self, token_ids: Iterable[int]) -> tuple[list[Delta], list[int]]:
        """New ids [n] -> (reasoning deltas, content ids [n'])."""
        if self._done:
            raise RuntimeError("feed after finish()")
        out = DeltaList()
        content: list[int] = []
        for t in map(int, token_ids):
            r = self._router.route(t)
            if r:
                out.text("reasoning_content", self._reasoning.push(t))
            elif r is not None:
                content.append(t)
        return list(out), content

    def feed(self, token_ids: Iterable[int]) -> list[Delta]:
        """New ids [n] -> reasoning and content deltas (content decoded here)."""
        out = DeltaList()
        deltas, content = self.feed_ids(token_ids)
        out.extend(deltas)
        out.text("content", self._content.push_many(content))
        return list(out)

    def finish(self) -> list[Delta]:
        """End of output: flush held bytes of both texts."""
        if self._done:
            return []
        out = DeltaList()
        out.text("reasoning_content", self._reasoning.flush())
        out.text("content", self._content.flush())
        self._done = True
        return list(out)


# ---- composition: reasoning -> tool calls ------------------------------------------------


@dataclasses.dataclass
class ParsedOutput:
    reasoning: str
    content: str
    tool_calls: list


def parse_output(tok, token_ids: Iterable[int], *, thinking_started: Optional[bool] = True,
                 tools: bool = True, first_call_number: int = 0) -> ParsedOutput:
    """Generated ids [T] -> reasoning, content, tool calls (tools=False: no tool parsing,
    the content is the content ids decoded with special ids skipped).

    first_call_number: tool calls earlier in the conversation (K3 call ids count from it)."""
    if _is_k3(tok):
        p = k3_parser.K3OutputParser(tok, thinking_started=thinking_started, tools=tools,
                                     first_call_number=first_call_number)
        merged = merge_deltas(p.feed(token_ids) + p.finish()) or {}
        return ParsedOutput(merged.get("reasoning_content", ""), merged.get("content", ""), p.tool_calls)
    reasoning, content_ids = parse_reasoning(tok, token_ids, thinking_started=thinking_started)
    if not tools:
        return ParsedOutput(reasoning, tok.decode(content_ids, skip_special=True), [])
    content, calls = parse_tool_calls(tok, content_ids)
    return ParsedOutput(reasoning, content, calls)


class OutputStreamParser:
    """Streaming parse_output: ReasoningStreamParser feeding a ToolCallStreamParser.

    feed(ids) / finish() -> OpenAI deltas ({"reasoning_content"}, {"content"}, {"tool_calls"});
    `tool_calls` is the final list after finish(). For a forced tool call, feed the
    forced_tool_prefix ids first.
    """

    def __init__(self, tok, *, thinking_started: Optional[bool] = True, tools: bool = True,
                 first_call_number: int = 0):
        self._k3 = k3_parser.K3OutputParser(tok, thinking_started=thinking_started, tools=tools,
                                            first_call_number=first_call_number) if _is_k3(tok) else None
        if self._k3 is not None:
            return
        self._reasoning = ReasoningStreamParser(tok, thinking_started=thinking_started)
        self._tools = ToolCallStreamParser(tok) if tools else None

    @property
    def in_reasoning(self) -> bool:
        """The next ordinary id would be reasoning (counts reasoning tokens, one id fed at a time)."""
        if self._k3 is not None:
            return self._k3.in_reasoning
        return self._reasoning.in_reasoning

    @property
    def tool_calls(self) -> list[ToolCall]:
        if self._k3 is not None:
            return self._k3.tool_calls
        return self._tools.tool_calls if self._tools is not None else []

    def feed(self, token_ids: Iterable[int]) -> list[Delta]:
        if self._k3 is not None:
            return self._k3.feed(token_ids)
        if self._tools is None:
            return self._reasoning.feed(token_ids)
        deltas, content = self._reasoning.feed_ids(token_ids)
        return deltas + self._tools.feed(content)

    def finish(self) -> list[Delta]:
        if self._k3 is not None:
            return self._k3.finish()
        if self._tools is None:
            return self._reasoning.finish()
        return self._reasoning.finish() + self._tools.finish()
