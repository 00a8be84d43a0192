"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (longest n first). No model; useful where the output repeats its context
(code edits, quoting, tool results echoed back, agent loops)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class NgramDrafter:
    """propose(tokens, k): up to k drafts continuing `tokens` (the prompt and the accepted output).

    max_n / min_n: the longest and shortest suffix matched; search_window: only the last this many
    tokens are searched (the cost is one vectorised scan of the window per n)."""

    kind = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 2, search_window: int = 8192):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n, self.window = max_n, min_n, search_window

    def propose(self, tokens: Sequence[int], k: int) -> list:
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        hay = np.asarray(tokens[-self.window:], np.int64)
        L = len(hay)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            at = self._latest(hay, n)
            if at is not None:
                return hay[at + n:at + n + k].tolist()
        return []

    @staticmethod
    def _latest(hay: np.ndarray, n: int) -> Optional[int]:
        """Start of the latest occurrence of hay's last n tokens that ends before them (some token follows)."""
        L = len(hay)
        suffix = hay[L - n:]
        starts = L - n                                  # candidate starts 0 .. L - n - 1
        if starts <= 0:
            return None
        match = np.ones(starts, bool)
        for i in range(n):
            match &= hay[i:i + starts] == suffix[i]
        hits = np.flatnonzero(match)
        return int(hits[-1]) if len(hits) else None
