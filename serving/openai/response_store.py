"""The Responses API's stored responses (previous_response_id, GET / DELETE /v1/responses/{id}).

In memory, bounded: at most `max_entries` responses, the least recently used dropped first, and none
kept longer than `ttl_s` after its last use. An entry holds its response object, the chat messages
it added to the conversation (its input and its output) and the id of the response it continued, so
a conversation is a chain of entries and a long agent loop costs memory linear in its length, not
quadratic. Using a response touches its whole chain, so a live conversation's earlier turns are never
older than its newest one and are not dropped before it.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Optional


@dataclasses.dataclass
class StoredResponse:
    response: dict
    messages: list              # chat messages this response added: its input items', then its output's
    previous: Optional[str]     # the response it continued
    used: float = 0.0


class MissingResponse(KeyError):
    """A response id (the one asked for, or one its conversation goes back through) that is not stored."""

    def __init__(self, rid: str):
        super().__init__(rid)
        self.rid = rid


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, rid: str, response: dict, messages: list, previous: Optional[str]) -> None:
        if self.max_entries <= 0:
            return
        self._expire()
        self._entries[rid] = StoredResponse(response, messages, previous, self.clock())
        self._entries.move_to_end(rid)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, rid: str) -> StoredResponse:
        """The entry (touched); MissingResponse if it is not stored."""
        self._expire()
        entry = self._entries.get(rid)
        if entry is None:
            raise MissingResponse(rid)
        self._touch(rid, entry)
        return entry

    def conversation(self, rid: str) -> list:
        """The chat messages of the conversation up to and including response `rid`, oldest first
        (every entry of the chain touched); MissingResponse naming the first id not stored."""
        self._expire()
        chain, seen, cur = [], set(), rid
        while cur is not None and cur not in seen:
            entry = self._entries.get(cur)
            if entry is None:
                raise MissingResponse(cur)
            seen.add(cur)
            chain.append((cur, entry))
            cur = entry.previous
        for key, entry in reversed(chain):      # the newest ends most recently used
            self._touch(key, entry)
        return [m for _, entry in reversed(chain) for m in entry.messages]

    def delete(self, rid: str) -> bool:
        self._expire()
        return self._entries.pop(rid, None) is not None

    def _touch(self, rid: str, entry: StoredResponse) -> None:
        entry.used = self.clock()
        self._entries.move_to_end(rid)

    def _expire(self) -> None:
        limit = self.clock() - self.ttl_s
        while self._entries:
            rid, entry = next(iter(self._entries.items()))
            if entry.used > limit:
                break
            del self._entries[rid]
