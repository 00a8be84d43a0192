"""Render a checkpoint's jinja `chat_template` the way transformers' apply_chat_template does.

Same environment as transformers (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, a
`tojson` that does not HTML-escape and takes ensure_ascii/indent/separators/sort_keys,
`raise_exception`, `strftime_now`), the same reasoning-field aliases, and Kimi's tokenizer
pre-step of key-sorting `tools`. jinja2 is imported lazily: the built-in renderer needs none.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable

from k3jax.tokenizer.chat import deep_sort

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@lru_cache(maxsize=8)
def _compile(template: str):
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("rendering a checkpoint chat_template needs jinja2 (pip install jinja2)") from e

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Deep copy into plain JSON-like data so the template can't touch caller objects."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_jinja(template: str, messages: list, tools: list | None = None, add_generation_prompt: bool = True,
                 *, protect: Callable[[Any], Any] | None = None, trusted: dict | None = None, **kwargs: Any) -> str:
    """Render `template` with transformers' variables: messages, tools, add_generation_prompt, **kwargs.

    protect: applied to the caller's data (messages, tools, kwargs) once it is prepared (copied,
    reasoning aliased, tools key-sorted), before rendering: client_text.Session.protect.
    trusted: variables passed as they are (the tokenizer's bos_token, eos_token, ...).
    """
    compiled = _compile(template)
    protect = protect or (lambda data: data)
    msgs = protect([_alias_reasoning(m) for m in _plain(list(messages))])
    tools = protect(deep_sort(_plain(tools))) if tools is not None else None
    return compiled.render(messages=msgs, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                           **protect(_plain(kwargs)), **(trusted or {}))


def template_from_config(config: dict) -> str | None:
    """The default chat template in a tokenizer_config dict (a string, or HF's list of named ones)."""
    tmpl = config.get("chat_template")
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl or None
