"""OpenAI request bodies (pydantic) and the conversion to SamplingParams.

Unknown top-level fields are accepted and ignored (clients send vendor extras); wrong types and
out-of-range values become 400 errors naming the field. Types are strict (no "1" for 1, no false
for 0) and ranges are declared here, so the OpenAPI schema states what the server accepts.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from serving.sampling_params import MAX_LOGIT_BIAS, SamplingParams


def _json_type(v) -> str:
    """The JSON name of a value's type, for error messages (never a Python class name)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    return {int: "a number", float: "a number", str: "a string", list: "an array", dict: "an object"}.get(type(v), "a value")


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _whole_number(v):
    # JSON Schema counts 3.0 as an integer; strict mode alone would refuse it.
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) <= 2**53 else v


def Int(**bounds):
    """An integer (3.0 too) within bounds; the bounds come first so the JSON schema states them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


def Num(**bounds):
    return Annotated[float, Field(**bounds)]


_INT64 = dict(ge=-(2**53), le=2**53)      # exact in JSON (a double), and in int64
TokenId = Int(ge=0)          # the vocabulary's upper bound is set in the served schema
StopString = Annotated[str, Field(min_length=1)]
# {token id (a JSON key, so a string): bias}; ids past the vocabulary are the engine's to refuse
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,12}$")], Num(ge=-100, le=100)],
                      Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})]


class StreamOptions(_Base):
    include_usage: bool = False


class _Sampling(_Base):
    model: Optional[str] = None
    max_tokens: Optional[Int(ge=1, le=2**53)] = None
    temperature: Optional[Num(ge=0)] = None
    top_p: Optional[Num(gt=0, le=1)] = None
    top_k: Optional[Int(ge=-1, le=2**31 - 1)] = None
    min_p: Optional[Num(ge=0, le=1)] = None
    presence_penalty: Optional[Num(ge=-2, le=2)] = None
    frequency_penalty: Optional[Num(ge=-2, le=2)] = None
    repetition_penalty: Optional[Num(gt=0)] = None
    seed: Optional[Int(**_INT64)] = None
    stop: Union[None, StopString, list[StopString]] = None
    stop_token_ids: Optional[list[TokenId]] = None
    ignore_eos: bool = False
    n: Int(ge=1) = 1                       # the server's --max-n is set in the served schema
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    priority: Int(**_INT64) = 0
    logit_bias: Optional[LogitBias] = None

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        """Raises ValueError naming the bad field."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, logit_bias=_token_keys(self.logit_bias))


def _token_keys(bias: Optional[dict]) -> Optional[dict]:
    """logit_bias's JSON keys ("1234", checked by LogitBias) as token ids."""
    return {int(k): v for k, v in bias.items()} if bias else None


# ---- chat messages: typed here so a malformed shape is a 400 naming its place, never a renderer crash.
# Validated, then handed on as plain dicts (what the chat renderer and image loader read).

class ImageURL(_Base):
    url: str


class ContentPart(_Base):
    type: Optional[str] = None
    text: Optional[str] = None
    image_url: Union[None, str, ImageURL] = None
    image: Union[None, str, ImageURL] = None


class FunctionCall(_Base):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(_Base):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[None, str, list[Union[str, ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None

    # Shape checks first, so the error names what is wrong rather than every union member that failed.
    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v):
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError(f"must be a string, null or a list of content parts, got {_json_type(v)}")
        for j, part in enumerate(v):
            if not isinstance(part, (str, dict)):
                raise ValueError(f"part {j} must be an object or a string, got {_json_type(part)}")
        return v

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls_shape(cls, v):
        if v is not None and not isinstance(v, list):
            raise ValueError(f"must be a list of tool calls, got {_json_type(v)}")
        return v


class FunctionDef(_Base):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(_Base):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateKwargs(_Base):
    thinking: Optional[bool] = None


# Arguments the server itself passes to the chat template: a client may not set them.
_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "tokenize")


def _as_dicts(items):
    if items is None:
        return None
    return [x.model_dump(exclude_unset=True) if isinstance(x, BaseModel) else x for x in items]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Int(ge=1, le=2**53)] = None
    logprobs: bool = False
    top_logprobs: Optional[Int(ge=0, le=20)] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[None, Literal["none", "auto", "required"], NamedToolChoice] = None
    parallel_tool_calls: bool = True
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None

    _plain_messages = field_validator("messages", "tools", mode="after")(classmethod(lambda cls, v: _as_dicts(v)))

    @field_validator("tool_choice", "chat_template_kwargs", mode="after")
    @classmethod
    def _plain(cls, v, info):
        if isinstance(v, ChatTemplateKwargs):
            bad = sorted(k for k in v.model_extra or {} if k in _RESERVED_TEMPLATE_KWARGS)
            if bad:
                raise ValueError(f"{', '.join(bad)} cannot be set here")
        return v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    logprobs: Optional[Int(ge=0, le=20)] = None
    echo: bool = False
    suffix: Optional[str] = Field(None, max_length=0, description="not supported: null or empty")
    response_format: Optional[dict[str, Any]] = None


class TokenizeRequest(_Base):
    """Exactly one of prompt and messages."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: Optional[str] = None
    prompt: str = None                            # not Optional: null is not a value the schema offers
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = None
    add_special_tokens: bool = False

    _plain_messages = field_validator("messages", mode="after")(classmethod(lambda cls, v: _as_dicts(v)))


class DetokenizeRequest(_Base):
    model: Optional[str] = None
    tokens: list[TokenId]
