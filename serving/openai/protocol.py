"""OpenAI request bodies (pydantic) and the conversion to SamplingParams.

Unknown top-level fields are accepted and ignored (clients send vendor extras); wrong types and
out-of-range values become 400 errors naming the field. Types are strict (no "1" for 1, no false
for 0) and ranges are declared here, so the OpenAPI schema states what the server accepts.
Every string of a request body (keys and vendor extras included) must be valid Unicode: a lone
UTF-16 surrogate ("\\ud800" unpaired in the JSON) is a 400 naming where it is (code invalid_unicode),
as OpenAI refuses it, rather than text the tokenizer would silently replace.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

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


def field_error(kind: str, field: str, message: str) -> PydanticCustomError:
    """A validation error about `field` (a dotted path below the model that raises it): the server's
    400 names it as the param (serving.openai.app.validation_error), and `kind` is the error code."""
    return PydanticCustomError(kind, message, {"field": field})


_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset((int, float, bool, type(None)))


def _find_surrogate(text: str, window: int = 1 << 20):
    # a window at a time: one regex call holds the GIL (a 15M-character search: ~0.2 s), and validation
    # runs in a worker thread beside the event loop
    for start in range(0, len(text), window):
        m = _SURROGATE.search(text, start, start + window)
        if m:
            return m
    return None


def lone_surrogate(body) -> Optional[tuple[str, str]]:
    """(dotted path, what) of the first string in a JSON value holding a lone UTF-16 surrogate, or None.
    (json.loads keeps an unpaired "\\ud800" as such; a pair becomes one code point.) Iterative: the
    body may nest as deep as the JSON parser allows."""
    stack = [((), body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            m = None if v.isascii() else _find_surrogate(v)
            if m:
                return ".".join(map(str, path)), f"a lone UTF-16 surrogate \\u{ord(m.group()):04x} at character {m.start()}"
        elif isinstance(v, dict):
            for k, item in reversed(v.items()):
                if isinstance(k, str) and not k.isascii() and _SURROGATE.search(k):
                    return ".".join(map(str, path)), f"the key {ascii(k)} holds a lone UTF-16 surrogate"
                stack.append(((*path, k), item))
        elif isinstance(v, list) and not _SCALARS.issuperset(map(type, v)):   # (token id lists: at C speed)
            stack.extend(((*path, i), item) for i, item in reversed(list(enumerate(v))))
    return None


class _Request(_Base):
    """A whole request body: checked once for invalid Unicode before its fields are validated.

    Fields named in `_null_means_default` are ones OpenAI documents as nullable: an explicit null
    there is the field's default (their types admit null, so the served schema says so too)."""

    _null_means_default: ClassVar[frozenset] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body):
        bad = lone_surrogate(body)
        if bad is not None:
            raise field_error("invalid_unicode", bad[0], f"not valid Unicode: {bad[1]}")
        if isinstance(body, dict) and cls._null_means_default:
            body = {k: v for k, v in body.items() if not (v is None and k in cls._null_means_default)}
        return body


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


class _Sampling(_Request):
    _null_means_default: ClassVar[frozenset] = frozenset({"n", "stream"})
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
    n: Optional[Int(ge=1)] = 1             # the server's --max-n is set in the served schema
    stream: Optional[bool] = False
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


# Arguments the server or the tokenizer passes to the chat template: a client may not set them (K3's
# image_prompts and a jinja template's bos_token are markup: rendered as special tokens).
_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "tokenize", "image_prompts",
                             "images_in_text", "bos_token", "eos_token", "unk_token", "pad_token")


def _as_dicts(items):
    if items is None:
        return None
    return [x.model_dump(exclude_unset=True) if isinstance(x, BaseModel) else x for x in items]


# OpenAI's rule, in the schema too: top_logprobs (not null) needs logprobs: true.
_TOP_LOGPROBS_NEEDS_LOGPROBS = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra=_TOP_LOGPROBS_NEEDS_LOGPROBS)
    messages: list[ChatMessage] = Field(min_length=1)
    _null_means_default: ClassVar[frozenset] = frozenset({"n", "stream", "logprobs", "parallel_tool_calls"})
    max_completion_tokens: Optional[Int(ge=1, le=2**53)] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Int(ge=0, le=20)] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[None, Literal["none", "auto", "required"], NamedToolChoice] = None
    parallel_tool_calls: Optional[bool] = True
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

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("logprobs_required", "top_logprobs", "logprobs must be set to true if top_logprobs is used")
        return self


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    _null_means_default: ClassVar[frozenset] = frozenset({"n", "stream", "echo"})
    logprobs: Optional[Int(ge=0, le=20)] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = Field(None, max_length=0, description="not supported: null or empty")
    response_format: Optional[dict[str, Any]] = None

    @property
    def num_prompts(self) -> int:
        p = self.prompt
        return 1 if isinstance(p, str) or isinstance(p[0], int) else len(p)


class TokenizeRequest(_Request):
    """Exactly one of prompt and messages."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: Optional[str] = None
    prompt: str = None                            # not Optional: null is not a value the schema offers
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = None
    add_special_tokens: bool = False

    _plain_messages = field_validator("messages", mode="after")(classmethod(lambda cls, v: _as_dicts(v)))


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[TokenId]
