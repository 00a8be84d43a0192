"""llguidance grammars (lark) for K3 tool calls: the typed `argument` elements of spec 8b.

A forced tool call in K3's format (tool_choice named or "required") ends the prompt inside the
tools channel (k3_parser.forced_tool_prefix); from there this grammar admits only well-formed
calls of the offered tools, each argument element carrying its schema key and a type
attribute that matches its value:

    <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>

VALUE is raw text for a string (its enum / const when the schema has one, as many characters
as its minLength / maxLength allow), and JSON in json.dumps' layout checked against the
property's schema for the other types. Structural tokens are matched by id
(`<[id]>`), so argument text can never produce one. Properties come in schema order; the
required ones must be there. After the calls: `<|close|>tools<|sep|>`, optionally
`<|close|>message<|sep|>`, then a stop token.
"""
from __future__ import annotations

import json
from typing import Optional

from k3jax.tokenizer import k3_format as fmt

# Non-string values in json.dumps' layout (`[1, 2]`, `{"a": 1}`), as K3 writes them: free whitespace
# would let a model that does not know the tool pad a value forever.
_VALUE_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_JSON_TYPES = {"number": "number", "integer": "number", "boolean": "boolean", "null": "null",
               "object": "object", "array": "array", "string": "string"}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)   # a lark string literal


class _Lark:
    def __init__(self, tok):
        self.o, self.c, self.s = (f"<[{tok.id_of(t)}]>" for t in (fmt.OPEN, fmt.CLOSE, fmt.SEP))
        self.rules: list[str] = []

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def close(self, tag: str) -> str:
        return f'{self.c} {_lit(tag)} {self.s}'


def _value_alternatives(prop: dict, defs: dict) -> list[tuple[str, str]]:
    """(type attribute, lark value expression) pairs a property admits."""
    types = prop.get("type")
    if types is None:
        types = ["string", "number", "boolean", "null", "object", "array"]
    elif isinstance(types, str):
        types = [types]
    elif not isinstance(types, list):
        raise ValueError(f"a property's type must be a string or a list of them, got {json.dumps(types)[:100]}")
    out = []
    for t in types:
        attr = _JSON_TYPES.get(t) if isinstance(t, str) else None
        if attr is None:
            continue
        if attr == "string":
            if "enum" in prop and not isinstance(prop["enum"], list):
                raise ValueError(f"a property's enum must be a list, got {json.dumps(prop['enum'])[:100]}")
            values = prop.get("enum") if "enum" in prop else ([prop["const"]] if "const" in prop else None)
            if values is not None:
                strings = [v for v in values if isinstance(v, str)]
                if strings:
                    out.append(("string", "(" + " | ".join(_lit(v) for v in strings) + ")"))
                continue
            out.append(("string", _string_value(prop)))
        else:
            schema = {k: v for k, v in prop.items() if k not in ("description", "title", "type")}
            schema["type"] = t
            schema.update(defs)
            schema["x-guidance"] = _VALUE_LAYOUT
            out.append((attr, f"%json {json.dumps(schema, ensure_ascii=False)}"))
    if not out:
        raise ValueError(f"no K3 argument type fits the schema {json.dumps(prop)[:200]}")
    return out


_MAX_COUNTED_LENGTH = 4096   # longer bounds are left to the client (a counted repetition this long is costly)


def _string_value(prop: dict) -> str:
    """A raw string value: any text, or as many characters as minLength / maxLength allow."""
    lo, hi = prop.get("minLength"), prop.get("maxLength")
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in (lo, hi)):
        raise ValueError(f"minLength / maxLength must be non-negative integers, got {json.dumps(prop)[:200]}")
    if (lo is None and hi is None) or max(lo or 0, hi or 0) > _MAX_COUNTED_LENGTH:
        return "STRING_VALUE"
    return f"/(.|\\n){{{lo or 0},{'' if hi is None else hi}}}/"


def _arguments_rule(g: _Lark, fn: dict, tag: str) -> str:
    params = fn.get("parameters") or {}
    properties = params.get("properties") or {} if isinstance(params, dict) else None
    required = params.get("required") or [] if isinstance(params, dict) else None
    # The shapes read here (a malformed one was a 500); llguidance checks the rest of the schema.
    if not isinstance(properties, dict) or not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"tools: parameters of {fn.get('name')!r} must be a JSON schema object whose properties is an "
                         "object and required a list of names")
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    parts = []
    for i, (key, prop) in enumerate(properties.items()):
        alts = []
        for type_attr, value in _value_alternatives(prop if isinstance(prop, dict) else {}, defs):
            head = f'argument key="{fmt.escape_attr(key)}" type="{type_attr}"'
            alts.append(f"{g.o} {_lit(head)} {g.s} {value} {g.close('argument')}")
        name = g.rule(f"{tag}_arg{i}", " | ".join(alts))
        parts.append(name if key in required else f"{name}?")
    return g.rule(f"{tag}_args", " ".join(parts) if parts else '""')


def tool_call_grammar(tok, tools: list, name: Optional[str] = None, parallel: bool = True) -> str:
    """Lark grammar for what follows k3_parser.forced_tool_prefix(tok, name, ...): the arguments
    and the close of the named call, or (name None) one call of any offered tool, or several when
    `parallel` (parallel_tool_calls)."""
    fns = [t.get("function") for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name][:1]
        if not fns:
            raise ValueError(f"tool_choice: no tool named {name!r} in tools")
    if not fns:
        raise ValueError("tools: expected a non-empty list of function tools")
    g = _Lark(tok)
    end = f"{g.close('tools')} ({g.close('message')})?"
    if name is not None:
        args = _arguments_rule(g, fns[0], "t0")
        g.rule("start", f"{args} {g.close('call')} {end}")
    else:
        calls = []
        for i, fn in enumerate(fns):
            args = _arguments_rule(g, fn, f"t{i}")
            head = f'call tool="{fmt.escape_attr(fn["name"])}" index="'
            calls.append(f'{g.o} {_lit(head)} INDEX "\\"" {g.s} {args} {g.close("call")}')
        g.rule("call", " | ".join(calls))
        g.rule("start", f"call{'+' if parallel else ''} {end}")
        g.rules.append("INDEX: /[1-9][0-9]{0,5}/")
    g.rules.append("STRING_VALUE: /(.|\\n)*/")
    return "\n".join(g.rules) + "\n"
