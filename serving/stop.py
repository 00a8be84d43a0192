"""Stop conditions for one sequence: EOS, stop token ids, stop strings, max_tokens.

Host side. The detokenizer hands over each new token with the text it adds; stop strings are
searched in the accumulated text, so a stop string split across several tokens is found.
Only the window that can contain a new match is searched (new text plus len(stop)-1 chars
before it), so the cost per token does not grow with the output length.

Conventions (as vLLM): a stop string or stop token (EOS included) is cut from the output
unless include_stop_str_in_output; with include, the text ends right after the stop string.
When several stop strings match, the one starting earliest wins (then the longest).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Optional, Sequence, Tuple, Union

from serving.sampling_params import SamplingParams


def find_stop_string(text: str, new_chars: int, stops: Sequence[str],
                     include: bool) -> Optional[Tuple[str, int]]:
    """Search `stops` in text whose last `new_chars` chars are new. Returns (stop, truncate_to)
    or None: text[:truncate_to] is the output to keep."""
    if not stops:
        return None
    max_len = max(len(s) for s in stops)
    lo = max(0, len(text) - new_chars - max_len + 1)
    best = None
    for s in stops:
        i = text.find(s, lo)
        if i >= 0 and (best is None or i < best[1] or (i == best[1] and len(s) > len(best[0]))):
            best = (s, i)
    if best is None:
        return None
    s, i = best
    return s, i + (len(s) if include else 0)


@dataclasses.dataclass
class StopResult:
    finish_reason: str                      # "stop" | "length"
    stop_reason: Union[None, str, int]      # matched stop string / stop token id; None for EOS/length


class StopChecker:
    """Accumulates one sequence's output text and decides when it ends.

    eos_token_ids: the model's EOS ids (ignored when params.ignore_eos). Call `append` once
    per generated token; `text` is the output so far (already truncated at a stop string);
    `finished` the StopResult or None. `stream_text()` is the part safe to stream now.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = ()):
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.stops = sorted(params.stop)      # sorted for held_tail
        self.text = ""
        self.num_tokens = 0
        self.finished: Optional[StopResult] = None

    def append(self, token_id: int, delta_text: str) -> Optional[StopResult]:
        """Add one generated token and the text it decodes to; returns the StopResult if the
        sequence ends with this token (later calls are an error)."""
        if self.finished is not None:
            raise RuntimeError("append after the sequence finished")
        self.num_tokens += 1
        include = self.params.include_stop_str_in_output
        if token_id in self.stop_ids or token_id in self.eos:
            if include:
                self.text += delta_text
            reason = token_id if token_id in self.stop_ids else None
            self.finished = StopResult("stop", reason)
            return self.finished
        self.text += delta_text
        hit = find_stop_string(self.text, len(delta_text), self.stops, include)
        if hit is not None:
            self.text = self.text[:hit[1]]
            self.finished = StopResult("stop", hit[0])
        elif self.params.max_tokens is not None and self.num_tokens >= self.params.max_tokens:
            self.finished = StopResult("length", None)
        return self.finished

    def stream_text(self) -> str:
        """Output that can be sent to a streaming client now: everything except a tail that
        could still become the start of a stop string (all of it once finished)."""
        if self.finished is not None:
            return self.text
        return self.text[:len(self.text) - held_tail(self.text, self.stops)]


def held_tail(text: str, sorted_stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that could still become the start of a stop string:
    a stream must hold those characters back until the next token decides. The stops must be
    sorted: the ones starting with a tail sit right after where the tail would be inserted, so a
    request's thousands of long stop strings cost a bisection per tail, not a scan (this runs on
    the engine's thread for every token)."""
    if not sorted_stops:
        return 0
    for k in range(min(len(text), max(map(len, sorted_stops)) - 1), 0, -1):
        tail = text[-k:]
        j = bisect.bisect_left(sorted_stops, tail)
        if j < len(sorted_stops) and sorted_stops[j].startswith(tail):
            return k
    return 0


def cut_at_stop(text: str, stop_reason, include: bool) -> str:
    """Text that was parsed out of a finished output (a chat answer without its reasoning) cut
    before the stop string the engine matched, as the engine cuts its own text."""
    if isinstance(stop_reason, str) and not include:
        i = text.find(stop_reason)
        if i >= 0:
            return text[:i]
    return text


class StopStringStream:
    """Streams such parsed text the way the engine streams its own: a tail that could begin a stop
    string is held back until later text decides, and the end is cut by `cut_at_stop`."""

    def __init__(self, stops: Sequence[str], include: bool):
        self.stops, self.include = sorted(stops), include
        self.text, self.sent = "", 0

    def feed(self, new_text: str, finished: bool = False, stop_reason=None) -> str:
        """Add parsed text; returns what may be sent now."""
        self.text += new_text
        if finished:
            end = len(cut_at_stop(self.text, stop_reason, self.include))
        else:
            end = len(self.text) - held_tail(self.text, self.stops)
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out
