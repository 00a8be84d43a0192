"""Built-in Kimi chat format (used when the checkpoint ships no jinja `chat_template`).

Follows spec section 8 and Moonshot's Kimi-K2-Thinking / K2.5 templates:

    [tools]   <|im_system|>tool_declare<|im_middle|>{tools json}<|im_end|>     (first, once)
    message   <|im_{role}|>{name}<|im_middle|>{content}<|im_end|>
              role token: user -> <|im_user|>, assistant -> <|im_assistant|>, any other role
              (system, tool, ...) -> <|im_system|>; name = message["name"] or the role
    assistant <think>{reasoning}</think>{content}[tool-call section]
              reasoning is kept only for assistant messages after the last assistant message
              without tool calls (the tool-call loop in progress) and only when thinking=True;
              earlier ones render an empty <think></think> (Kimi drops old reasoning)
    tool call <|tool_calls_section_begin|>(<|tool_call_begin|>{id}<|tool_call_argument_begin|>
              {arguments}<|tool_call_end|>)*<|tool_calls_section_end|>; id = tool_calls[i].id
              (functions.NAME:IDX), or functions.NAME:{running index} when missing
    tool      content is prefixed with "## Return of {tool_call_id}\\n"
    image     <|media_begin|>image<|media_content|><|media_pad|><|media_end|> then "\\n"
              (the newline is what the K2-Thinking / K2.5 templates emit after each image)
    prompt    <|im_assistant|>assistant<|im_middle|>, plus <think></think> when thinking=False

No default system message is added: K2-Instruct/K2-Thinking templates inject one, but that is
the checkpoint template's business (rendered through jinja when present); a model-neutral
renderer should not put words in the prompt. Tool JSON is key-sorted and compact
(separators=(",", ":"), ensure_ascii=False), as in K2.5's template and Kimi's deep_sort_dict.

The renderer returns parts: ("special", canonical spec name) or ("text", str). Tokenizing
parts encodes text runs with special-token parsing off, so user content can never smuggle
in a control token, while giving the same ids as encoding the joined string whenever the
content holds no special-token strings.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

IMAGE_PART_TYPES = ("image", "image_url")

Part = tuple[str, str]  # ("special", "<|im_end|>") or ("text", "...")


def deep_sort(obj: Any) -> Any:
    """Sort dict keys recursively (Kimi's `deep_sort_dict`, applied to tools before rendering)."""
    if isinstance(obj, dict):
        return {k: deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, (list, tuple)):
        return [deep_sort(v) for v in obj]
    return obj


def reasoning_of(message: dict) -> str:
    """The message's reasoning text; same field names transformers aliases."""
    for key in ("reasoning_content", "reasoning", "thinking"):
        val = message.get(key)
        if val is not None:
            return str(val)
    return ""


class _Parts(list):
    def special(self, name: str) -> None:
        self.append(("special", name))

    def text(self, s: str) -> None:
        if s:
            self.append(("text", s))


def _render_content(out: _Parts, content: Any) -> None:
    if content is None:
        return
    if isinstance(content, str):
        out.text(content)
        return
    for part in content:
        if isinstance(part, str):
            out.text(part)
            continue
        ptype = part.get("type")
        if ptype in IMAGE_PART_TYPES or (ptype is None and ("image" in part or "image_url" in part)):
            out.special("<|media_begin|>")
            out.text("image")
            out.special("<|media_content|>")
            out.special("<|media_pad|>")
            out.special("<|media_end|>")
            out.text("\n")
        elif ptype == "text" or (ptype is None and "text" in part):
            out.text(part.get("text") or "")
        else:
            raise ValueError(f"unsupported content part type {ptype!r}")


def _header(out: _Parts, message: dict) -> None:
    role = message["role"]
    token = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}.get(role, "<|im_system|>")
    out.special(token)
    out.text(message.get("name") or role)
    out.special("<|im_middle|>")


def _tool_call_fields(call: dict) -> tuple[str | None, str, Any]:
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    return call.get("id"), fn["name"], fn.get("arguments", {})


def render_chat(
    messages: Iterable[dict],
    tools: list | None = None,
    add_generation_prompt: bool = True,
    thinking: bool = True,
) -> list[Part]:
    """Render an OpenAI-style conversation into Kimi parts (see module docstring)."""
    messages = list(messages)
    out = _Parts()
    if tools:
        out.special("<|im_system|>")
        out.text("tool_declare")
        out.special("<|im_middle|>")
        out.text(json.dumps(deep_sort(tools), ensure_ascii=False, separators=(",", ":")))
        out.special("<|im_end|>")

    # History = up to the last assistant message without tool calls; reasoning after it is kept.
    last_plain = -1
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant" and not messages[i].get("tool_calls"):
            last_plain = i
            break

    call_counter = 0
    pending_ids: list[str] = []  # calls not yet answered, for tool messages without tool_call_id
    for i, msg in enumerate(messages):
        role = msg["role"]
        _header(out, msg)
        if role == "assistant":
            out.special("<think>")
            if thinking and i > last_plain:
                out.text(reasoning_of(msg))
            out.special("</think>")
            _render_content(out, msg.get("content"))
            if msg.get("tool_calls"):
                out.special("<|tool_calls_section_begin|>")
                for call in msg["tool_calls"]:
                    cid, name, args = _tool_call_fields(call)
                    if not cid:
                        cid = f"functions.{name}:{call_counter}"
                    call_counter += 1
                    pending_ids.append(cid)
                    out.special("<|tool_call_begin|>")
                    out.text(cid)
                    out.special("<|tool_call_argument_begin|>")
                    out.text(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
                    out.special("<|tool_call_end|>")
                out.special("<|tool_calls_section_end|>")
        elif role == "tool":
            cid = msg.get("tool_call_id")
            if cid is None:
                if not pending_ids:
                    raise ValueError("tool message without tool_call_id and no pending tool call")
                cid = pending_ids[0]
            if cid in pending_ids:
                pending_ids.remove(cid)
            out.text(f"## Return of {cid}\n")
            _render_content(out, msg.get("content"))
        else:
            _render_content(out, msg.get("content"))
        out.special("<|im_end|>")

    if add_generation_prompt:
        out.special("<|im_assistant|>")
        out.text("assistant")
        out.special("<|im_middle|>")
        if not thinking:
            out.special("<think>")
            out.special("</think>")
    return list(out)
