"""OpenAI request bodies (pydantic) and the conversion to SamplingParams.

Unknown top-level fields are accepted and ignored (clients send vendor extras); wrong types and
out-of-range values become 400 errors naming the field.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from serving.sampling_params import SamplingParams


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Base):
    include_usage: bool = False


class _Sampling(_Base):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    priority: int = 0

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        """Raises ValueError naming the bad field."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs)


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[None, Literal["none", "auto", "required"], dict[str, Any]] = None
    parallel_tool_calls: bool = True
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None


class TokenizeRequest(_Base):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_special_tokens: bool = False


class DetokenizeRequest(_Base):
    model: Optional[str] = None
    tokens: list[int]
