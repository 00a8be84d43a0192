"""Kimi K3's tagged message format (spec 8b): conversation -> segments -> token ids.

K3 ships no Jinja template; its checkpoint renders chats in Python. Everything is built from
four special tokens and ordinary text:

    element   <|open|>TAG key="value" ...<|sep|> body <|close|>TAG<|sep|>
    message   <|open|>message role="user"[ name="N"]<|sep|>CONTENT<|close|>message<|sep|><|end_of_msg|>
    assistant message role="assistant": [think element] response element [tools element]
    tools     <|open|>tools<|sep|> (call tool="NAME" index="i": argument key="K" type="T" elements)
              <|close|>tools<|sep|>; string values raw, other values as JSON; arguments that are
              not a JSON object go whole into one `json type="object"` element
    tool      message role="tool" tool="NAME" index="i" (i counts the results after an assistant
              message from 1; a run of results is first put in call order by tool_call_id)
    system    internal messages carry type=: tool-declare, thinking-effort, tool-choice,
              response-format
    prompt    <|open|>message role="assistant"<|sep|><|open|>think<|sep|> (thinking on) or
              ...<|open|>response<|sep|> (off)

Token ids must equal the checkpoint tokenizer's, which encodes segment by segment: structural
tokens and image prompts with special-token parsing on ("control" segments), every other
piece (tag names, each attribute's ` key`, `="`, value and `"`, message text) on its own
with special-token parsing off. Encoding the joined string instead would merge BPE tokens
across those cuts, and would let message text smuggle in a control token.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Optional

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"


@dataclasses.dataclass(frozen=True)
class Segment:
    text: str
    control: bool = False   # encode with special-token parsing on


def image_prompt(size: Optional[tuple] = None) -> str:
    """What K3's processor writes for one image, with one <|media_pad|> (the engine widens it to
    the image's token count): `<|media_begin|>image {w}x{h}<|media_content|>...<|media_end|>`,
    w x h being the image's original size."""
    label = "image" if size is None else f"image {int(size[0])}x{int(size[1])}"
    return f"<|media_begin|>{label}<|media_content|><|media_pad|><|media_end|>"


def escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def deep_sort(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def value_type(value: Any) -> str:
    """The `type` attribute of a tool-call argument."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def value_text(value: Any) -> str:
    # strings go raw; everything else as JSON with the default (spaced) separators, as K3 does
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def parse_value(text: str, type_: str) -> Any:
    """Inverse of value_text for an argument of type `type_` (bad JSON stays text)."""
    if type_ == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class Writer(list):
    """Segments being built, plus the images' prompts to substitute in order.

    images_in_text: a `<|kimi_image_placeholder|>` typed in message text takes the next image
    prompt, as in K3's public renderer (for trusted text only: a client could open image slots).
    Off, images come from image parts only and the typed placeholder stays text."""

    def __init__(self, image_prompts: Optional[list], images_in_text: bool = False):
        super().__init__()
        self.image_prompts = image_prompts
        self.images_in_text = images_in_text
        self.images_used = 0

    def control(self, s: str) -> None:
        if s:
            self.append(Segment(s, True))

    def text(self, s: Any) -> None:
        s = str(s)
        if s:
            self.append(Segment(s, False))

    def image(self) -> None:
        if self.image_prompts is None:
            self.control(IMAGE_PLACEHOLDER)
            return
        if self.images_used >= len(self.image_prompts):
            raise ValueError("more images in the conversation than image prompts")
        self.control(self.image_prompts[self.images_used])
        self.images_used += 1

    def text_with_images(self, s: Any) -> None:
        # a placeholder typed in text becomes an image only when asked and the caller supplies prompts
        s = str(s)
        if not self.images_in_text or self.image_prompts is None or IMAGE_PLACEHOLDER not in s:
            self.text(s)
            return
        pieces = s.split(IMAGE_PLACEHOLDER)
        for i, piece in enumerate(pieces):
            self.text(piece)
            if i < len(pieces) - 1:
                self.image()

    def open(self, tag: str, attrs: Iterable[tuple] = ()) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:
            self.text(f" {key}")
            self.text('="')
            self.text(escape_attr(value))
            self.text('"')
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def content(self, content: Any) -> None:
        if content is None:
            return
        if isinstance(content, str):
            self.text_with_images(content)
            return
        for part in content:
            if isinstance(part, str):
                self.text_with_images(part)
            elif part.get("type") in ("image", "image_url") or (part.get("type") is None and
                                                               ("image" in part or "image_url" in part)):
                self.image()
            else:
                self.text_with_images(part.get("text") or "")

    def system_message(self, type_: str, body: str, strip: bool = True) -> None:
        self.open("message", [("role", "system"), ("type", type_)])
        self.text(body.strip() if strip else body)
        self.close("message")
        self.control(END_OF_MSG)


def _tool_declaration(out: Writer, tools: Any, dynamic: bool = False) -> None:
    if dynamic:   # a system message carrying `tools` extends the toolset mid-conversation
        head = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                "You have access to all existing and extended tools.\nHere are the specs for the extended tools.")
    else:
        head = "# Tools\nHere are the available tools, described in JSONSchema."
    out.system_message("tool-declare", f"{head}\n\n```json\n{compact_json(tools)}\n```", strip=False)


def call_arguments(call: dict) -> tuple[dict, Optional[str]]:
    """A tool call's arguments -> (object, None), or ({}, raw text) for text that is not JSON."""
    fn = call.get("function", call)
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if args is None:
        return {}, None
    if isinstance(args, dict):
        return args, None
    if not isinstance(args, str):
        raise TypeError("tool call arguments must be an object or a JSON object string")
    if not args.strip():
        return {}, None
    try:
        parsed = json.loads(args)
    except ValueError:
        return {}, args
    if not isinstance(parsed, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return parsed, None


def _call_name(call: dict) -> Any:
    fn = call.get("function")
    return fn.get("name") if isinstance(fn, dict) else call.get("name")


def order_tool_results(messages: list) -> list:
    """Put each run of tool messages in the order of the preceding assistant's tool_calls,
    matching tool_call_id to the call id; the matched call's name becomes the result's tool
    name. A run with any unmatched result is left as it is."""
    out: list = []
    positions: dict = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if not isinstance(m, dict) or m.get("role") != "tool":
            if isinstance(m, dict) and m.get("role") == "assistant":
                positions = {}
                for pos, call in enumerate(m.get("tool_calls") or [], start=1):
                    if isinstance(call, dict) and call.get("id") is not None:
                        positions.setdefault(str(call["id"]), (pos, _call_name(call)))
            out.append(m)
            i += 1
            continue
        run = []
        while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
            run.append(messages[i])
            i += 1
        keys = [r.get("tool_call_id", r.get("id")) for r in run]
        found = [positions.get(str(k)) if k is not None else None for k in keys]
        if any(f is None for f in found):
            out.extend(run)
            continue
        for (pos, name), _, r in sorted(zip(found, range(len(run)), run), key=lambda x: (x[0][0], x[1])):
            if name is None:
                out.append(r)
            else:
                r = dict(r, tool=name)
                if "name" in r:
                    r["name"] = name
                out.append(r)
    return out


def response_schema(response_format: Any) -> Any:
    """The JSON schema inside an OpenAI response_format (None if it has none)."""
    if not isinstance(response_format, dict):
        return None
    js = response_format.get("json_schema")
    if isinstance(js, dict):
        return js.get("schema", js.get("json_schema", js))
    return js


def thinking_options(thinking: Optional[bool] = None, enable_thinking: Optional[bool] = None,
                     reasoning_effort: Optional[str] = None, thinking_effort: Optional[str] = None
                     ) -> tuple[bool, str]:
    """(thinking on?, effort) from the request's spellings; reasoning_effort="none" turns it off."""
    if thinking is None:
        thinking = True if enable_thinking is None else bool(enable_thinking)
    if reasoning_effort == "none":
        thinking = False
    elif thinking_effort is None and reasoning_effort is not None:
        thinking_effort = reasoning_effort
    effort = DEFAULT_THINKING_EFFORT if thinking_effort is None else thinking_effort
    if effort not in THINKING_EFFORTS:
        raise ValueError(f"Kimi K3 supports thinking_effort values {', '.join(THINKING_EFFORTS)}, not {effort!r}")
    return thinking, effort


def render(messages: list, tools: Optional[list] = None, *, add_generation_prompt: bool = True,
           thinking: Optional[bool] = None, enable_thinking: Optional[bool] = None,
           reasoning_effort: Optional[str] = None, thinking_effort: Optional[str] = None,
           tool_choice: Any = None, response_format: Any = None, image_prompts: Optional[list] = None,
           images_in_text: bool = False) -> list[Segment]:
    """OpenAI-style conversation -> K3 segments (see the module docstring).

    image_prompts: one string per image in order (image_prompt(size)); None leaves K3's
    `<|kimi_image_placeholder|>` text in their place. images_in_text: see Writer. tool_choice:
    "required" / "none" add K3's tool-choice message (a named choice is enforced by decoding, not by the prompt).
    """
    thinking, effort = thinking_options(thinking, enable_thinking, reasoning_effort, thinking_effort)
    messages = order_tool_results(list(messages))
    out = Writer(image_prompts, images_in_text)
    if tools:
        _tool_declaration(out, deep_sort(tools))
    if thinking:
        out.system_message("thinking-effort", (
            "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
            "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={effort}`."))

    calls: Optional[list] = None   # the last assistant message's tool_calls
    results = 0                    # tool results since it
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m["role"]
        if role == "system" and m.get("tools"):
            _tool_declaration(out, deep_sort(m["tools"]), dynamic=True)
        elif role in ("user", "system", "developer"):
            # K3 has no developer role: its instructions are the system's
            attrs = [("role", "user" if role == "user" else "system")]
            if m.get("name"):
                attrs.append(("name", m["name"]))
            out.open("message", attrs)
            out.content(m.get("content"))
            out.close("message")
            out.control(END_OF_MSG)
        elif role == "tool":
            results += 1
            name = m.get("tool", m.get("name"))
            if name is None and calls is not None and results <= len(calls):
                name = _call_name(calls[results - 1])
            if name is None:
                raise ValueError("a tool message needs a tool name: give `name`, or a tool_call_id "
                                 "matching a call of the preceding assistant message")
            out.open("message", [("role", "tool"), ("tool", name), ("index", results)])
            out.content(m.get("content"))
            out.close("message")
            out.control(END_OF_MSG)
        elif role == "assistant":
            calls, results = m.get("tool_calls"), 0
            attrs = [("role", "assistant")]
            if m.get("name"):
                attrs.append(("name", m["name"]))
            out.open("message", attrs)
            _assistant_body(out, m, thinking)
            out.close("message")
            out.control(END_OF_MSG)
        else:
            raise ValueError(f"unsupported role {role!r}")

    if tool_choice == "required":
        out.system_message("tool-choice", "The system is invoked with `tool_choice=required`.\n"
                                          "You MUST call tools in the next message.")
    elif tool_choice == "none":
        out.system_message("tool-choice", "The system is invoked with `tool_choice=none`.\n"
                                          "You MUST NOT call any tools in the next message.")
    fmt = response_format.get("type") if isinstance(response_format, dict) else response_format
    raw_json = ("Your response must be raw JSON data without markdown code blocks (```json) or any "
                "additional formatting.")
    if fmt == "json_object":
        out.system_message("response-format", f"The system is invoked with `response_format=json_object`.\n{raw_json}")
    elif fmt == "json_schema":
        schema = compact_json(deep_sort(response_schema(response_format)))
        out.system_message("response-format", f"The system is invoked with `response_format=json_schema`.\n{raw_json}\n"
                                              f"The JSON data must match the following schema:\n```json\n{schema}\n```")
    if add_generation_prompt:
        out.open("message", [("role", "assistant")])
        out.open("think" if thinking else "response")
    if image_prompts is not None and out.images_used != len(image_prompts):
        raise ValueError(f"{len(image_prompts)} image prompts for {out.images_used} images")
    return list(out)


def _assistant_body(out: Writer, m: dict, thinking: bool) -> None:
    if thinking:   # the think channel is always there in thinking mode, even empty
        out.open("think")
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning is not None and str(reasoning).strip():
            out.text_with_images(reasoning)
        out.close("think")
    out.open("response")
    out.content(m.get("content"))
    out.close("response")
    calls = m.get("tool_calls")
    if not calls:
        return
    out.open("tools")
    for index, call in enumerate(calls, start=1):
        fn = call.get("function", call)
        out.open("call", [("tool", fn["name"]), ("index", index)])
        args, raw = call_arguments(call)
        if raw is not None:
            out.open("json", [("type", "object")])
            out.text_with_images(raw)
            out.close("json")
        else:
            for key, value in args.items():
                out.open("argument", [("key", key), ("type", value_type(value))])
                out.text_with_images(value_text(value))
                out.close("argument")
        out.close("call")
    out.close("tools")


def join(segments: Iterable[Segment]) -> str:
    return "".join(s.text for s in segments)


def encode(tok, segments: Iterable[Segment]) -> list[int]:
    """Segments -> ids, each segment encoded on its own (see the module docstring)."""
    ids: list[int] = []
    for s in segments:
        ids.extend(tok.encode(s.text, allow_special=s.control))
    return ids
