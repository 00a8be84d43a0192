"""llguidance grammar (lark) for Kimi (K2 / Kimi Linear) tool calls under tool_choice "required".

The forced prefix (tool_parser.forced_tool_prefix) ends the prompt with
`<|tool_calls_section_begin|><|tool_call_begin|>`; from there this grammar admits only calls of
the offered tools, the arguments of each valid for that tool's `parameters` schema:

    functions.NAME:IDX<|tool_call_argument_begin|>{ARGUMENTS JSON}<|tool_call_end|>
    (<|tool_call_begin|> another call)* <|tool_calls_section_end|>          then a stop token

one call only when parallel_tool_calls is false. Markers are matched by id (`<[id]>`), so no
text can produce one. Arguments follow json.dumps' layout (`{"k": "v", "n": 1}`, Kimi's own):
free whitespace would let a model that does not know the tool pad the call forever.
"""
from __future__ import annotations

import copy
import json

from serving.openai.tool_parser import Markers
from serving.structured import NO_ARGUMENTS, tool_functions

# the layout of json.dumps(arguments), as Kimi writes them
_ARGUMENT_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)   # a lark string literal


def required_call_grammar(tok, tools, parallel: bool = True) -> str:
    """Lark grammar of what follows forced_tool_prefix(tok, None): one call (or several, parallel) of
    any offered tool, then the section end. ValueError for malformed tools."""
    m = Markers(tok)
    fns = tool_functions(tools)
    rules, calls = [], []
    for i, fn in enumerate(fns):
        schema = fn.get("parameters") if fn.get("parameters") is not None else NO_ARGUMENTS
        if not isinstance(schema, dict):
            raise ValueError(f"tools: parameters of {fn['name']!r} must be a JSON schema object")
        schema = copy.deepcopy(schema)
        # lenient (unknown keywords ignored) unless the tool is strict, as for a named tool choice
        schema["x-guidance"] = {**_ARGUMENT_LAYOUT, "lenient": fn.get("strict") is not True}
        rules.append(f"args{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        head = _lit(f"functions.{fn['name']}:")
        calls.append(f"{head} INDEX <[{m.arg_begin}]> args{i} <[{m.call_end}]>")
    rules.append("call: " + " | ".join(calls))
    more = f" (<[{m.call_begin}]> call)*" if parallel else ""
    rules.append(f"start: call{more} <[{m.section_end}]>")
    rules.append("INDEX: /0|[1-9][0-9]{0,5}/")
    return "\n".join(rules) + "\n"
