"""What the output parsers (tool_parser.py: Kimi's format; k3_parser.py: K3's) produce: tool calls and
OpenAI stream deltas, and the streaming parsers' base class."""
from __future__ import annotations

import dataclasses
import json
from typing import Iterable

Delta = dict  # one OpenAI `choices[0].delta` fragment


@dataclasses.dataclass
class ToolCall:
    id: str             # e.g. "functions.get_weather:0", returned as the OpenAI tool_call id
    name: str           # e.g. "get_weather"
    arguments: str      # JSON text as generated (final once the call is closed)
    index: int          # position among this output's calls, from 0
    complete: bool = True    # closed by <|tool_call_end|>
    json_valid: bool = True  # arguments parse as a JSON object


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class DeltaList(list):
    """Deltas of one feed; joins a text piece onto the previous delta of the same kind."""

    def text(self, key: str, s: str) -> None:
        if not s:
            return
        if self and list(self[-1]) == [key]:
            self[-1][key] += s
        else:
            self.append({key: s})

    def header(self, call: ToolCall) -> None:
        self.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": ""}}]})

    def arguments(self, index: int, s: str) -> None:
        if not s:
            return
        last = self[-1]["tool_calls"][0] if self and "tool_calls" in self[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += s
        else:
            self.append({"tool_calls": [{"index": index, "function": {"arguments": s}}]})


class TokenStreamParser:
    """Base of the streaming output parsers: feed(ids) runs the subclass's `_step(id, deltas)` per token and returns
    this feed's deltas; a parser that has finished refuses more."""
    _done = False

    def feed(self, token_ids: Iterable[int]) -> list[Delta]:
        """New ids of this step [n] -> deltas (possibly empty)."""
        if self._done:
            raise RuntimeError("feed() after finish()")
        out = DeltaList()
        for t in token_ids:
            self._step(int(t), out)
        return list(out)
