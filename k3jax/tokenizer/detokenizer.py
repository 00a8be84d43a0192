"""Streaming detokenization that never cuts a UTF-8 character.

A byte-level BPE token can end in the middle of a character (an emoji or a CJK character
spread over two or three tokens). We feed each token's bytes into Python's incremental
UTF-8 decoder (errors="replace"): it holds an incomplete trailing sequence until the next
bytes complete it, and replaces truly invalid bytes exactly as the one-shot
`bytes.decode("utf-8", "replace")` that `KimiTokenizer.decode` uses. So the concatenation
of everything `push` and `flush` return equals `decode(all ids)`, and valid text never
produces U+FFFD mid-stream.
"""

from __future__ import annotations

import codecs
from typing import Iterable


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas.

    Args:
      tok: a KimiTokenizer.
      skip_special: drop special ids (same rule as `tok.decode(ids, skip_special=True)`).
    """

    def __init__(self, tok, *, skip_special: bool = False):
        self._tok = tok
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token id; return the new text that is safe to emit (may be "")."""
        token_id = int(token_id)
        if self._skip_special and self._tok.is_special(token_id):
            return ""
        return self._decoder.decode(self._tok.token_bytes(token_id), final=False)

    def push_many(self, token_ids: Iterable[int]) -> str:
        """Add several ids at once; return the concatenated new text."""
        return "".join(self.push(t) for t in token_ids)

    @property
    def pending_bytes(self) -> int:
        """How many bytes are held back waiting for the rest of a character."""
        return len(self._decoder.getstate()[0])

    def flush(self) -> str:
        """End of stream: emit held bytes (U+FFFD for an unfinished character) and reset."""
        out = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return out
