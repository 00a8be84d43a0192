"""Request state on the host, and what the engine returns for it."""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Optional

import numpy as np

from serving.prefix_cache import Hit
from serving.sampling_params import SamplingParams
from serving.stop import StopChecker


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    """One sequence being generated. `tokens` = prompt + generated so far; the model has consumed
    `num_computed` of them (one shared count for MLA pages and KDA state)."""

    request_id: str
    prompt_ids: list
    params: SamplingParams
    seed: int
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0
    extra_keys: Optional[list] = None          # per-unit extra hash keys (e.g. image hashes)
    matcher: object = None                     # structured output: allowed_mask() / accept(token)
    images: list = dataclasses.field(default_factory=list)       # serving.multimodal.ImageInput, placed
    status: Status = Status.WAITING
    output_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)     # per token: (logprob, {id: logprob})
    num_computed: int = 0
    pages: list = dataclasses.field(default_factory=list)         # block table
    slot: int = 0                               # working KDA slot (0 = none)
    hit: Optional[Hit] = None                   # prefix hit whose copy sources are still held
    hashes: list = dataclasses.field(default_factory=list)       # prompt unit hash chain
    checkpoints: list = dataclasses.field(default_factory=list)  # planned checkpoint positions
    use_cache: bool = True                      # False: never reads or writes the prefix cache (a verifier's recompute)
    wait_for: Optional[tuple] = None            # (running request, position): its prefix checkpoint this one waits for
    waited_steps: int = 0                       # schedules spent waiting for a running request's prefix
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    final_sampled: bool = False                 # its last token (max_tokens) is sampled, maybe not fetched yet
    tokens_in_flight: bool = False              # a launch of several decode steps has sampled tokens not fetched yet
                                                # (only the last one can stand for a device token in a later step)
    spec_drafts: list = dataclasses.field(default_factory=list)  # speculative drafts proposed for the next step
    spec_slots: list = dataclasses.field(default_factory=list)   # KDA slots for verification's position states
    stop: Optional[StopChecker] = None
    detok: object = None
    finish_reason: Optional[str] = None
    stop_reason: object = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    _page_array: tuple = (None, None)           # (the pages list it mirrors, int32 array)

    def page_array(self) -> np.ndarray:
        """The block table as int32 numpy, extended by the new pages only: converting a long-context
        block table from a list every step costs milliseconds. The scheduler only appends to a
        running request's list (`pages += new`) or replaces it (admission, preemption); a
        replaced list is converted afresh."""
        owner, arr = self._page_array
        pages = self.pages
        if owner is not pages or len(arr) > len(pages) or (len(arr) and arr[-1] != pages[len(arr) - 1]):
            arr = np.asarray(pages, np.int32)
        elif len(arr) < len(pages):
            arr = np.concatenate([arr, np.asarray(pages[len(arr):], np.int32)])
        self._page_array = (pages, arr)
        return arr

    @property
    def tokens(self) -> list:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list:
        """tokens[start:end] without building the whole prompt + output list (long prompts)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.remaining == 1 and bool(self.output_ids)


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    logprobs: Optional[list]
    finish_reason: Optional[str]
    stop_reason: object = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = dataclasses.field(default_factory=dict)
