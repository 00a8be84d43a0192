"""Structured output: OpenAI `response_format` (and tool arguments) as per-step token bitmasks.

Backed by llguidance (https://github.com/guidance-ai/llguidance), imported lazily: the GPU
image may lack it and only requests that ask for structured output need it.

    compiler = StructuredOutputCompiler(tokenizer)          # one per tokenizer
    grammar = compiler.compile({"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}})
    m = grammar.matcher()                                   # one per request
    mask = m.allowed_mask()     # uint32 [ceil(V/32)], bit t % 32 of word t // 32 = token t allowed
    m.accept(token_id)          # advance with the sampled token

Stop tokens (tokenizer.stop_ids: [EOS], <|im_end|>, [EOT]) are allowed only where the value
is complete; accepting one terminates the matcher. Masks are exactly llguidance's answer
(copied, then cut or zero-padded to the model's vocabulary width).

Schemas: `strict: true` rejects keywords llguidance cannot enforce (400 for the client);
otherwise they are ignored (lenient, reported in `Grammar.warnings`). Whitespace between
JSON tokens is free by default (as vLLM's default); `whitespace_flexible=False` forces
compact JSON.
"""
from __future__ import annotations

import collections
import copy
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

DEFAULT_CACHE_SIZE = 64
ANY_OBJECT = {"type": "object"}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # the server maps this to a clear 400/500, not a crash at startup
        raise RuntimeError("structured output needs the 'llguidance' package (pip install llguidance)") from e
    return llguidance


class _TokenizerAdapter:
    """The duck type llguidance.TokenizerWrapper reads: token bytes, special ids, an encoder."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = list(range(tokenizer.num_ordinary, tokenizer.vocab_size))

    def __call__(self, data: bytes) -> list[int]:
        # llguidance hands over valid UTF-8 (it tokenizes a ragged tail greedily itself)
        text = data.decode("utf-8", errors="replace") if isinstance(data, (bytes, bytearray)) else data
        return self._tok.encode(text)


def build_ll_tokenizer(tokenizer, slices=None):
    """llguidance.LLTokenizer for a KimiTokenizer: ordinary ids by their bytes, the 256
    special ids marked special (grammar text never matches them), tokenizer.stop_ids as the
    end tokens. Costs ~1 s for the real 164k vocabulary: build once per tokenizer."""
    llg = _llguidance()
    return llg.LLTokenizer(llg.TokenizerWrapper(_TokenizerAdapter(tokenizer)), n_vocab=tokenizer.vocab_size,
                           eos_token=list(tokenizer.stop_ids), slices=slices)


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar, shared by all requests with the same response_format.

    kind: "json_object" | "json_schema"; source: llguidance grammar text; warnings: what a
    lenient compile ignored; vocab_size: the mask width in tokens (model vocabulary)."""

    kind: str
    source: str
    warnings: tuple
    vocab_size: int
    stop_ids: tuple
    tokenizer_vocab_size: int
    _template: Any = field(repr=False)

    def matcher(self) -> "GrammarMatcher":
        """A fresh matcher at the start of the grammar (a cheap copy of the compiled one)."""
        return GrammarMatcher(self)


class GrammarMatcher:
    """Per-request grammar state. Not thread-safe (the engine step loop drives it).

    Invariant: accept(t) succeeds exactly for the tokens set in allowed_mask()."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._m = grammar._template.deep_copy()
        self._words = (grammar.vocab_size + 31) // 32
        self._stop = frozenset(grammar.stop_ids)
        self._terminated = False
        self._mask: Optional[np.ndarray] = None  # cache for the current state
        self.num_accepted = 0

    @property
    def error(self) -> str:
        """llguidance's error message ('' when fine); a matcher in error is terminated."""
        return self._m.get_error() if self._m.is_error() else ""

    def is_terminated(self) -> bool:
        """True once a stop token was accepted (or the matcher failed): generation must end."""
        return self._terminated or self._m.is_error()

    def can_end(self) -> bool:
        """True when the text so far is a complete value (a stop token is allowed now)."""
        return not self._m.is_error() and self._m.is_accepting()

    def allowed_mask(self) -> np.ndarray:
        """uint32 [ceil(vocab_size / 32)] bitmask of the tokens allowed next (read-only view;
        valid until the next accept). After termination only the stop tokens are set."""
        if self._mask is None:
            if self.is_terminated():
                words = np.zeros(self._words, np.uint32)
                for t in self._stop:
                    words[t >> 5] |= np.uint32(1 << (t & 31))
                self._set_mask(words)
            else:
                self._set_mask(np.frombuffer(self._m.compute_bitmask(), np.uint32))
        return self._mask

    def _set_mask(self, lib: np.ndarray) -> None:
        """Cache the library's words, cut or zero-padded to the model's vocabulary width."""
        words = np.zeros(self._words, np.uint32)
        n = min(self._words, lib.size)
        words[:n] = lib[:n]
        tail = self.grammar.vocab_size & 31  # clear bits past the vocabulary
        if tail and n == self._words:
            words[-1] &= np.uint32((1 << tail) - 1)
        words.flags.writeable = False
        self._mask = words

    def _allowed(self, t: int) -> bool:
        if self._mask is not None:
            return bool((int(self._mask[t >> 5]) >> (t & 31)) & 1)
        if self.is_terminated():
            return t in self._stop
        if t in self._stop:
            return self._m.is_accepting()
        return self._m.validate_tokens([t]) == 1  # checks without moving the state

    def accept(self, token_id: int) -> bool:
        """Advance over one sampled token. Returns False (state unchanged) if the token is not
        allowed here. A stop token terminates the matcher; accepting a stop token again after
        that is a no-op that returns True."""
        t = int(token_id)
        if not 0 <= t < self.grammar.vocab_size or not self._allowed(t):
            return False
        if self._terminated:
            return True
        self._mask = None
        if t in self._stop:
            self._terminated = True
            self.num_accepted += 1
            return True
        ok = self._m.consume_token(t)
        self.num_accepted += ok
        return bool(ok)


def _schema_of(response_format) -> tuple[str, Any, bool]:
    """OpenAI response_format -> (kind, schema, strict); kind "text" means no constraint."""
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format: expected an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return "text", None, False
    if kind == "json_object":
        return kind, ANY_OBJECT, False
    if kind != "json_schema":
        raise ValueError(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema: expected an object with 'name' and 'schema'")
    schema = spec.get("schema", ANY_OBJECT)  # OpenAI makes `schema` optional
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"response_format.json_schema.strict: expected a boolean, got {strict!r}")
    return kind, schema, bool(strict)


class StructuredOutputCompiler:
    """Compiles response formats for one tokenizer; keeps the last `cache_size` grammars (LRU).

    tokenizer: KimiTokenizer. vocab_size: mask width in tokens (the model's logits width,
    >= tokenizer.vocab_size; ids past the tokenizer are never allowed). whitespace_flexible:
    allow any JSON whitespace between tokens (False: compact `{"a":1,"b":2}` only).
    Thread-safe: compile() may be called from request handlers concurrently."""

    def __init__(self, tokenizer, *, vocab_size: Optional[int] = None, cache_size: int = DEFAULT_CACHE_SIZE,
                 whitespace_flexible: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size or tokenizer.vocab_size)
        if self.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size: {self.vocab_size} < tokenizer vocabulary {tokenizer.vocab_size}")
        self.stop_ids = tuple(int(t) for t in tokenizer.stop_ids)
        self.whitespace_flexible = bool(whitespace_flexible)
        self.cache_size = int(cache_size)
        self.ll_tokenizer = build_ll_tokenizer(tokenizer)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, response_format: dict) -> Optional[Grammar]:
        """OpenAI response_format -> Grammar, or None for {"type": "text"}.

        {"type": "json_object"}: any JSON object. {"type": "json_schema", "json_schema":
        {"name", "schema", "strict"}}: a value valid for the schema (a missing schema means
        any object). Raises ValueError (message fit for a 400 reply) on a malformed
        response_format or a schema llguidance rejects (invalid, unsatisfiable, or with
        unsupported keywords when strict)."""
        kind, schema, strict = _schema_of(response_format)
        if kind == "text":
            return None
        return self.compile_json_schema(schema, strict=strict, kind=kind)

    def compile_json_schema(self, schema, *, strict: bool = False, kind: str = "json_schema") -> Grammar:
        """JSON schema (dict or bool) -> Grammar. See compile()."""
        if schema is True:
            schema = {}
        if schema is False:
            raise ValueError("response_format: the schema `false` accepts no value")
        if not isinstance(schema, dict):
            raise ValueError(f"response_format: a JSON schema must be an object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema, ensure_ascii=False)  # key order matters: properties keep it
        except (TypeError, ValueError) as e:
            raise ValueError(f"response_format: schema is not JSON: {e}") from None
        return self._cached((kind, text, strict), lambda: self._build(kind, schema, strict))

    def _cached(self, key, build) -> Grammar:
        """The LRU-cached grammar of `key`, built outside the lock (llguidance drops the GIL there)."""
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return g
            self.misses += 1
        g = build()
        with self._lock:
            self._cache[key] = g
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return g

    def compile_lark(self, source: str, kind: str = "lark") -> Grammar:
        """llguidance lark grammar text -> Grammar (cached like schemas); ValueError if invalid.
        Used for formats that are not one JSON value, e.g. K3's tagged tool calls."""
        return self._cached((kind, source, None), lambda: self._build_lark(kind, source))

    def _build_lark(self, kind: str, source: str) -> Grammar:
        llg = _llguidance()
        try:
            grammar = llg.LLMatcher.grammar_from_lark(source)
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid grammar: {e}") from None
        return self._grammar(kind, grammar, "invalid grammar")

    def compile_tool_call(self, tools, name: Optional[str] = None) -> Grammar:
        """Grammar for the arguments JSON of a tool call (see grammar_for_tool_call)."""
        return self.compile(grammar_for_tool_call(tools, name))

    def _build(self, kind: str, schema: dict, strict: bool) -> Grammar:
        llg = _llguidance()
        options = {"whitespace_flexible": self.whitespace_flexible, "lenient": not strict}
        try:
            source = llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as e:
            raise ValueError(f"response_format: invalid JSON schema: {e}") from None
        return self._grammar(kind, source, "response_format: invalid JSON schema")

    def _grammar(self, kind: str, source: str, error: str) -> Grammar:
        """Grammar of llguidance grammar text; ValueError(`error`: ...) when llguidance refuses it."""
        m = _llguidance().LLMatcher(self.ll_tokenizer, source, log_level=0)
        if m.is_error():
            raise ValueError(f"{error}: {m.get_error().strip()}")
        return Grammar(kind, source, tuple(m.get_grammar_warnings()), self.vocab_size, self.stop_ids,
                       self.tokenizer.vocab_size, m)


_executor = None
_executor_lock = threading.Lock()


def allowed_masks(matchers) -> list:
    """allowed_mask() of many matchers (None entries give None), the pending ones computed
    in parallel by llguidance's thread pool (it drops the GIL): for a batch step with many
    constrained rows on a large vocabulary. Same masks as calling allowed_mask() on each.
    All matchers must come from compilers of one tokenizer (one engine)."""
    global _executor
    pending = [m for m in matchers if m is not None and m._mask is None and not m.is_terminated()]
    if len(pending) > 1:
        llg = _llguidance()
        with _executor_lock:
            if _executor is None:
                _executor = llg.LLExecutor()
        width = (pending[0].grammar.tokenizer_vocab_size + 31) // 32  # llguidance's mask width
        buf = np.zeros((len(pending), width), np.int32)
        _executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(pending)], buf.ctypes.data,
                                          width * 4, len(pending))
        for m, row in zip(pending, buf.view(np.uint32)):
            m._set_mask(row)
    return [None if m is None else m.allowed_mask() for m in matchers]


# ------------------------------------------------------------------ tools

def tool_functions(tools) -> list[dict]:
    """The `function` objects of OpenAI tools; ValueError naming a malformed tool."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError("tools: expected a non-empty list of tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        out.append(fn)
    return out


def _rebase_refs(schema, prefix: str):
    """Copy of `schema` with local "$ref": "#/..." pointers moved under `prefix` (a JSON
    pointer), so a schema keeps resolving its own $defs once nested in a bigger one."""
    if isinstance(schema, dict):
        return {k: (prefix + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else
                    _rebase_refs(v, prefix)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(v, prefix) for v in schema]
    return schema


def grammar_for_tool_call(tools, name: Optional[str] = None) -> dict:
    """response_format for the ARGUMENTS text of a tool call, for StructuredOutputCompiler.compile.

    tools: OpenAI tools ([{"type": "function", "function": {"name", "parameters", "strict"}}]).
    name: the tool to call (tool_choice named); None (tool_choice "required") allows the
    arguments of any listed tool (anyOf their parameter schemas). A tool without
    `parameters` takes none: arguments must be `{}`. strict is true only if every chosen
    tool says so. Raises ValueError for malformed tools or an unknown name."""
    fns = tool_functions(tools)
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice: no tool named {name!r} in tools")
        fns = fns[:1]
    schemas = [copy.deepcopy(f.get("parameters")) if f.get("parameters") is not None else NO_ARGUMENTS for f in fns]
    for f, s in zip(fns, schemas):
        if not isinstance(s, dict):
            raise ValueError(f"tools: parameters of {f['name']!r} must be a JSON schema object")
    if len(schemas) == 1:
        schema = schemas[0]
    else:
        schema = {"anyOf": [_rebase_refs(s, f"#/anyOf/{i}") for i, s in enumerate(schemas)]}
    strict = all(f.get("strict") is True for f in fns)
    label = fns[0]["name"] if len(fns) == 1 else "any_tool"
    return {"type": "json_schema", "json_schema": {"name": f"{label}_arguments", "schema": schema, "strict": strict}}
