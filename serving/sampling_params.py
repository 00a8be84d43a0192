"""Per-request sampling parameters (OpenAI / vLLM compatible names) with validation.

Host side only. `serving.sampler.build_sampling_arrays` turns a batch of these into the
device-side `SamplingArrays` pytree.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence, Union

# Temperatures below this are treated as greedy (same threshold as vLLM).
GREEDY_EPS = 1e-5
# logit_bias entries per request (OpenAI's limit was 300): the sampler takes them as one fixed-width array
MAX_LOGIT_BIAS = 300


def _bad(field: str, msg: str) -> ValueError:
    return ValueError(f"{field}: {msg}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request.

    Off values: temperature 0 = greedy; top_k 0 (or -1) = off; top_p 1 = off; min_p 0 = off;
    repetition_penalty 1 = off; presence/frequency_penalty 0 = off.
    Penalties (see sampler.apply_penalties): repetition applies to prompt + output tokens,
    presence/frequency to output tokens only (as in vLLM).
    seed: None = the engine draws one per request; with a seed, the same seed at the same
    generated-token index gives the same token whatever the batch around it.
    max_tokens: None = until the context limit. logprobs: None = none; k >= 0 = the sampled
    token's logprob plus the k most likely (raw distribution).
    stop: strings that end generation (matched on detokenized text, see serving.stop);
    stop_token_ids: token ids that end generation; ignore_eos: keep going past EOS.
    include_stop_str_in_output: keep the matched stop string / stop token text in the output.
    logit_bias: {token id: bias in [-100, 100]} added to the logits before penalties and sampling
    (OpenAI's; at most MAX_LOGIT_BIAS entries); logprobs stay those of the raw distribution.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = None
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    logit_bias: Optional[Mapping[int, float]] = None

    def __post_init__(self):
        # Normalise containers first so validation sees one form.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self.logit_bias = {} if self.logit_bias is None else dict(self.logit_bias)
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0  # vLLM / HF spell "off" as -1
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", f"must be an int >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise _bad(name, f"must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _bad("top_k", f"must be an int >= 0 (or -1 for off), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise _bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", f"must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", f"must be an int >= 1 or None, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", f"stop strings must be non-empty str, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise _bad("stop_token_ids", f"must be ints >= 0, got {t!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise _bad("logprobs", f"must be an int >= 0 or None, got {self.logprobs!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for t, b in self.logit_bias.items():
            if not _is_int(t) or t < 0:
                raise _bad("logit_bias", f"keys must be token ids (ints >= 0), got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise _bad("logit_bias", f"biases must be numbers in [-100, 100], got {b!r} for token {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def for_child(self, index: int) -> "SamplingParams":
        """Params of the index-th of n parallel samples: n=1, seed+index (vLLM's rule) so
        seeded siblings differ but stay reproducible."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)
