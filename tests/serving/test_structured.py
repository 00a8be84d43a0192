"""Structured output (serving/structured.py) on the tiny Kimi tokenizer (1024 ids, byte-level BPE).

References: random walks over the allowed tokens must decode to JSON that `jsonschema`
(when installed) and a small hand checker accept; masks are compared bit for bit with an
llguidance matcher built independently (its tiktoken tokenizer path, not our adapter);
accept() is checked against the mask for every token id.
"""
import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest

llguidance = pytest.importorskip("llguidance")

from k3jax.tokenizer import KimiTokenizer  # noqa: E402
from serving.structured import (GrammarMatcher, StructuredOutputCompiler,  # noqa: E402
                                allowed_masks, grammar_for_tool_call)

try:
    import jsonschema
except ImportError:  # the hand checker below still runs
    jsonschema = None

TOK = KimiTokenizer.tiny()
STOPS = set(TOK.stop_ids)
WORDS = (TOK.vocab_size + 31) // 32


@pytest.fixture(scope="module")
def comp():
    return StructuredOutputCompiler(TOK)


def rf(schema, strict=None):
    spec = {"name": "t", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def ids_of(mask) -> set:
    """Independent unpacking of the documented layout: bit t % 32 of word t // 32."""
    mask = np.asarray(mask)
    assert mask.dtype == np.uint32 and mask.shape == (WORDS,)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def check(value, schema):
    """Hand checker for the keywords used below (type, properties, required, enum, items,
    additionalProperties, min/max, maxLength, min/maxItems, anyOf, $ref into $defs)."""
    root = schema

    def go(v, s):
        if "$ref" in s:
            node = root
            for part in s["$ref"][2:].split("/"):
                node = node[int(part)] if isinstance(node, list) else node[part]
            return go(v, node)
        if "anyOf" in s:
            return any(go(v, sub) for sub in s["anyOf"])
        if "enum" in s and v not in s["enum"]:
            return False
        t = s.get("type")
        types = {"object": dict, "array": list, "string": str, "boolean": bool}
        if t == "integer" and not (isinstance(v, int) and not isinstance(v, bool)):
            return False
        if t == "number" and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            return False
        if t in types and not isinstance(v, types[t]):
            return False
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if v < s.get("minimum", -np.inf) or v > s.get("maximum", np.inf):
                return False
        if isinstance(v, str) and len(v) > s.get("maxLength", 1 << 30):
            return False
        if isinstance(v, list):
            if not s.get("minItems", 0) <= len(v) <= s.get("maxItems", 1 << 30):
                return False
            if "items" in s and not all(go(x, s["items"]) for x in v):
                return False
        if isinstance(v, dict):
            props = s.get("properties", {})
            if any(k not in v for k in s.get("required", [])):
                return False
            if s.get("additionalProperties") is False and any(k not in props for k in v):
                return False
            if not all(go(v[k], props[k]) for k in v if k in props):
                return False
        return True

    return go(value, schema)


def valid(value, schema) -> bool:
    ok = check(value, schema)
    if jsonschema is not None:
        assert jsonschema.Draft202012Validator(schema).is_valid(value) == ok, (value, schema)
    return ok


CLOSERS = [t for t in range(TOK.num_ordinary)
           if any(c in TOK.token_bytes(t) for c in b'"]}') and not any(c in TOK.token_bytes(t) for c in b"{[")]


def walk(matcher: GrammarMatcher, rng, explore=40, max_steps=600, schema=None):
    """Random walk over allowed tokens: uniform for `explore` steps, then biased towards
    closing tokens and stop tokens so it ends. Checks at every step that stop tokens are
    allowed exactly when the text so far is a complete valid value."""
    ids = []
    for step in range(max_steps):
        allowed = ids_of(matcher.allowed_mask())
        assert allowed, "empty mask before termination"
        text = TOK.decode(ids)
        try:
            value, parsed = json.loads(text), True
            done = schema is None or valid(value, schema)
        except json.JSONDecodeError:
            done = parsed = False
        stops_allowed = allowed & STOPS
        assert stops_allowed in (set(), STOPS), stops_allowed
        assert bool(stops_allowed) == matcher.can_end()
        if not parsed:
            assert not stops_allowed, f"stop allowed after incomplete {text!r}"
        if done and text == text.strip():
            assert stops_allowed == STOPS, f"stop not allowed after complete {text!r}"
        pool = sorted(allowed - STOPS)
        if stops_allowed and (not pool or step >= explore or rng.random() < 0.3):
            pick = int(rng.choice(sorted(stops_allowed)))
        else:
            closing = [t for t in pool if t in CLOSERS_SET] if step >= explore else []
            pick = int(rng.choice(closing or pool))
        assert matcher.accept(pick), pick
        if pick in STOPS:
            assert matcher.is_terminated()
            return TOK.decode(ids)
        assert not matcher.is_terminated()
        ids.append(pick)
    raise AssertionError(f"walk did not end in {max_steps} steps: {TOK.decode(ids)!r}")


CLOSERS_SET = set(CLOSERS)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "owner": {"type": "object", "properties": {"login": {"type": "string", "maxLength": 8},
                                                    "score": {"type": "number"}},
                  "required": ["login", "score"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 2,
                  "items": {"$ref": "#/$defs/item"}},
    },
    "required": ["id", "owner", "items"],
    "additionalProperties": False,
    "$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 5},
                                                        "qty": {"type": "integer", "minimum": 1}},
                       "required": ["sku", "qty"], "additionalProperties": False}},
}
CHOICE = {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
                    {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}},
                     "required": ["k"], "additionalProperties": False}]}


@pytest.mark.parametrize("name,schema", [("person", PERSON), ("nested", NESTED), ("anyof", CHOICE)])
def test_random_walks_validate(comp, name, schema):
    g = comp.compile(rf(schema, strict=True))
    rng = np.random.default_rng(len(name))
    texts = set()
    for _ in range(6):
        text = walk(g.matcher(), rng, schema=schema)
        value = json.loads(text)
        assert valid(value, schema), text
        texts.add(text)
    assert len(texts) > 1  # the walk really explores


def test_json_object_mode(comp):
    g = comp.compile({"type": "json_object"})
    rng = np.random.default_rng(7)
    for _ in range(6):
        value = json.loads(walk(g.matcher(), rng, explore=25))
        assert isinstance(value, dict)
    assert comp.compile({"type": "text"}) is None
    m = g.matcher()  # a top-level value other than an object is refused
    assert not m.accept(TOK.encode("[")[0]) and not m.accept(TOK.encode("1")[0])


def test_compact_whitespace():
    c = StructuredOutputCompiler(TOK, whitespace_flexible=False)
    m = c.compile(rf(PERSON)).matcher()
    assert not m.accept(TOK.encode(" ")[0])
    text = walk(m, np.random.default_rng(3), schema=PERSON)
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # drop string contents
    assert not re.search(r"\s", outside), text
    assert valid(json.loads(text), PERSON)


def reference_matcher(source):
    """llguidance matcher on a tokenizer built by its own tiktoken path (not our adapter)."""
    from llguidance.tiktoken import lltokenizer_from_encoding
    ll_tok = lltokenizer_from_encoding(TOK._enc, n_vocab=TOK.vocab_size, eos_token=list(TOK.stop_ids))
    return llguidance.LLMatcher(ll_tok, source, log_level=0)


def test_masks_are_the_library_answer(comp):
    for schema in (PERSON, NESTED):
        g = comp.compile(rf(schema))
        ref = reference_matcher(llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": True}))
        m, rng = g.matcher(), np.random.default_rng(1)
        for _ in range(120):
            want = np.frombuffer(ref.compute_bitmask(), np.uint32)[:WORDS]
            np.testing.assert_array_equal(m.allowed_mask(), want)
            pool = sorted(ids_of(want) - STOPS)
            if not pool:
                break
            t = int(rng.choice(pool))
            assert m.accept(t) and ref.consume_token(t)


def test_accept_agrees_with_mask_for_every_token(comp):
    g = comp.compile(rf(PERSON))
    m = g.matcher()
    prefixes = ['', '{"name"', '{"name": "ab', '{"name": "ab", "age": 4',
                '{"name": "ab", "age": 4, "role": "gu', '{"name":"a","age":1,"role":"user","tags":[],"active":true}']
    done = []
    for p in prefixes:
        m = g.matcher()
        for t in TOK.encode(p):
            assert m.accept(t), (p, t)
        allowed = ids_of(m.allowed_mask())
        for t in range(TOK.vocab_size):  # fresh matchers: no cached mask, validate path
            fresh = g.matcher()
            for u in TOK.encode(p):
                fresh.accept(u)
            if t % 7 == 0 or t in allowed or t >= TOK.num_ordinary:
                assert fresh.accept(t) == (t in allowed), (p, t)
        done.append(len(allowed))
    assert done[0] < 10 and done[2] > 500  # "{" / '{"' at the start, most bytes inside a string
    assert not m.accept(-1) and not m.accept(TOK.vocab_size)


def test_batched_masks_equal_single(comp):
    """allowed_masks (llguidance's parallel executor) == allowed_mask() row by row, at
    different states, with None rows, a terminated row and a wider model vocabulary."""
    c = StructuredOutputCompiler(TOK, vocab_size=TOK.vocab_size + 40)
    g, g2 = c.compile(rf(PERSON)), c.compile({"type": "json_object"})
    prefixes = ['', '{"name": "a', '{"name": "ab", "age": 4', '{"name":"a","age":1,"role":"user","tags":["x"']
    def build():
        ms = []
        for i, p in enumerate(prefixes):
            m = (g if i % 2 == 0 else g2).matcher() if i != 3 else g.matcher()
            for t in TOK.encode(p):
                assert m.accept(t), p
            ms.append(m)
        done = g2.matcher()
        for t in TOK.encode("{}") + [TOK.eos_id]:
            assert done.accept(t)
        return ms[:2] + [None, done] + ms[2:]
    batch, single = allowed_masks(build()), [None if m is None else m.allowed_mask() for m in build()]
    assert batch[2] is None and ids_of_any(batch[3]) == STOPS
    for b, s_ in zip(batch, single):
        if s_ is not None:
            np.testing.assert_array_equal(b, s_)
    assert len({ids_of_any(b).__len__() for b in batch if b is not None}) > 2  # really different states


def ids_of_any(mask) -> set:
    return set(np.flatnonzero(np.unpackbits(np.asarray(mask).view(np.uint8), bitorder="little")).tolist())


def test_disallowed_token_keeps_state(comp):
    m = comp.compile(rf(PERSON)).matcher()
    before = m.allowed_mask().copy()
    bad = TOK.encode("x")[0]
    assert bad not in ids_of(before)
    assert m.accept(bad) is False
    assert m.error == "" and not m.is_terminated()
    np.testing.assert_array_equal(m.allowed_mask(), before)
    for t in TOK.encode('{"name"'):
        assert m.accept(t)
    assert m.num_accepted == len(TOK.encode('{"name"'))


def test_stop_tokens_only_when_complete(comp):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    m = comp.compile(rf(schema)).matcher()
    for piece in ['{', '"a"', ':', ' 1']:
        for t in TOK.encode(piece):
            assert not ids_of(m.allowed_mask()) & STOPS and not m.can_end()
            assert not m.accept(TOK.eos_id)
            assert m.accept(t)
    assert not ids_of(m.allowed_mask()) & STOPS
    assert m.accept(TOK.encode("}")[0])
    assert ids_of(m.allowed_mask()) == STOPS  # nothing may follow "}" but a stop token
    for other in (TOK.bos_id, TOK.id_of("<|im_user|>"), TOK.id_of("<|tool_call_begin|>")):
        assert not m.accept(other)
    assert m.accept(TOK.im_end_id) and m.is_terminated()
    assert ids_of(m.allowed_mask()) == STOPS and m.accept(TOK.eos_id)
    assert not m.accept(TOK.encode(" ")[0])
    # a value that may end or go on: both digits and stop tokens are allowed
    m = comp.compile(rf({"type": "integer"})).matcher()
    assert m.accept(TOK.encode("12")[0]) and ids_of(m.allowed_mask()) >= STOPS | set(TOK.encode("3"))


@pytest.mark.parametrize("bad", [
    rf({"type": "foo"}), rf({"type": "integer", "minimum": 5, "maximum": 2}),
    rf({"type": "string", "pattern": "(("}), rf({"$ref": "#/$defs/missing"}), rf(False), rf([1, 2]),
    rf({"type": "object", "if": {"type": "object"}}, strict=True),
    rf({"type": "string", "format": "no-such-format"}, strict=True),
    "json", {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": "x"},
    {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
])
def test_invalid_formats_raise_value_error(comp, bad):
    with pytest.raises(ValueError, match="response_format"):
        comp.compile(bad)


def test_lenient_when_not_strict(comp):
    g = comp.compile(rf({"type": "object", "if": {"type": "object"}}))
    assert any("if" in w for w in g.warnings)
    assert comp.compile(rf(True)) is not None
    no_schema = comp.compile({"type": "json_schema", "json_schema": {"name": "x"}})
    assert isinstance(json.loads(walk(no_schema.matcher(), np.random.default_rng(0), explore=5)), dict)


def test_cache_lru_and_key_order():
    c = StructuredOutputCompiler(TOK, cache_size=2)
    a, b, d = rf(PERSON), rf(NESTED), rf({"type": "integer"})
    ga = c.compile(a)
    assert c.compile(json.loads(json.dumps(a))) is ga and c.hits == 1
    c.compile(b), c.compile(a), c.compile(d)  # b is least recent -> evicted
    assert c.compile(a) is ga and c.misses == 3
    assert c.compile(b) is not None and c.misses == 4
    # property order is part of the grammar (llguidance keeps it), so it is part of the key
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}
    ba = dict(ab, properties={"b": {"type": "integer"}, "a": {"type": "integer"}})
    for schema, first in ((ab, "a"), (ba, "b")):
        m = c.compile(rf(schema)).matcher()
        for t in TOK.encode('{"'):
            assert m.accept(t)
        assert m.accept(TOK.encode(first)[0])


def test_wider_model_vocab():
    c = StructuredOutputCompiler(TOK, vocab_size=TOK.vocab_size + 40)
    m = c.compile({"type": "json_object"}).matcher()
    mask = m.allowed_mask()
    assert mask.shape == ((TOK.vocab_size + 40 + 31) // 32,) and not mask[WORDS:].any()
    assert not m.accept(TOK.vocab_size + 3)
    with pytest.raises(ValueError, match="vocab_size"):
        StructuredOutputCompiler(TOK, vocab_size=TOK.vocab_size - 1)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"$ref": "#/$defs/unit"}},
        "required": ["city", "unit"], "additionalProperties": False,
        "$defs": {"unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "now"}},
]


def test_tool_call_arguments(comp):
    spec = grammar_for_tool_call(TOOLS, "get_weather")
    assert spec["json_schema"]["schema"] == TOOLS[0]["function"]["parameters"]
    assert spec["json_schema"]["strict"] is True
    rng = np.random.default_rng(5)
    g = comp.compile_tool_call(TOOLS, "get_weather")
    for _ in range(4):
        args = json.loads(walk(g.matcher(), rng, schema=spec["json_schema"]["schema"]))
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    assert json.loads(walk(comp.compile_tool_call(TOOLS, "now").matcher(), rng)) == {}
    # "required": any tool's arguments; $refs still resolve once nested under anyOf
    any_spec = grammar_for_tool_call(TOOLS)
    assert any_spec["json_schema"]["strict"] is False
    g = comp.compile(any_spec)
    seen = set()
    for _ in range(12):
        args = json.loads(walk(g.matcher(), rng, explore=0, schema=any_spec["json_schema"]["schema"]))
        seen.add(tuple(sorted(args)))
        assert args == {} or valid(args, TOOLS[0]["function"]["parameters"])
    assert seen == {(), ("city", "unit")}
    for bad in ([], [{"type": "function"}], [{"function": {"name": "x", "parameters": 3}}]):
        with pytest.raises(ValueError):
            grammar_for_tool_call(bad)
    with pytest.raises(ValueError, match="no tool named"):
        grammar_for_tool_call(TOOLS, "missing")


def test_masks_drive_the_sampler(comp):
    """The bit layout is the sampler's: greedy sampling on random logits under the mask
    always picks an allowed token, and the walk ends in valid JSON."""
    import jax.numpy as jnp
    from serving.sampler import build_sampling_arrays, make_key_data, sample_jit
    from serving.sampling_params import SamplingParams

    g = comp.compile(rf(PERSON))
    m, rng, ids = g.matcher(), np.random.default_rng(0), []
    params = [SamplingParams(temperature=0.0)]
    for _ in range(200):
        arrs = build_sampling_arrays(params, num_rows=1, vocab_size=TOK.vocab_size,
                                     allowed_masks=[m.allowed_mask()])
        logits = rng.normal(size=(1, TOK.vocab_size)).astype(np.float32)
        logits[0, list(STOPS)] += 4.0  # finish as soon as the grammar allows
        logits[0, CLOSERS] += 2.0
        tok, _, _ = sample_jit(jnp.asarray(logits), arrs, make_key_data(0), jnp.zeros(1, jnp.int32))
        t = int(tok[0])
        assert m.accept(t), t
        if t in STOPS:
            break
        ids.append(t)
    assert m.is_terminated() and valid(json.loads(TOK.decode(ids)), PERSON)


def test_random_walks_reach_termination(comp):
    """Random walks through a nested schema's masks always end in a terminated matcher (mask timings are
    printed for reference; they belong to benchmarks, not assertions)."""
    g = comp.compile(rf(NESTED))
    rng, times = np.random.default_rng(2), []
    for _ in range(5):
        m = g.matcher()
        while not m.is_terminated():
            t0 = time.perf_counter()
            m.allowed_mask()
            times.append(time.perf_counter() - t0)
            allowed = ids_of(m.allowed_mask())
            pool = sorted(allowed & STOPS) or (len(times) % 3 and sorted(allowed & CLOSERS_SET)) or sorted(allowed)
            assert m.accept(int(rng.choice(pool))) and len(times) < 3000
    us = np.array(times) * 1e6
    print(f"\nmask time (tiny vocab 1024, {len(us)} masks): median {np.median(us):.1f} us, "
          f"p90 {np.percentile(us, 90):.1f} us, max {us.max():.1f} us")


def test_module_imports_llguidance_lazily():
    code = "import sys, serving.structured; assert 'llguidance' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
