"""Kimi tool-call parser: one-shot rules, malformed outputs, streaming == one-shot for any split.

Expected values come from how each test builds its ids (text encoded piece by piece, markers
as special ids), not from the parser. Deltas are accumulated the way an OpenAI client does.
"""

import json
import random

import pytest

from serving.openai.tool_parser import (ToolCall, ToolCallStreamParser, forced_tool_prefix, merge_deltas,
                                        parse_tool_calls, tool_call_to_openai)

from tests.support.kimi_ids import AB, CB, CE, E, EOS, IM_END, SB, SE, THINK, TOK, UNTHINK  # noqa: F401


def call_ids(header, args, end=True):
    return [CB] + E(header) + [AB] + E(args) + ([CE] if end else [])


def accumulate(deltas):
    """OpenAI-client accumulation -> (content, [(id, name, arguments)]); checks delta shapes."""
    content, calls = "", {}
    for d in deltas:
        assert d and set(d) <= {"content", "tool_calls"}, d
        content += d.get("content", "")
        for frag in d.get("tool_calls", []):
            i = frag["index"]
            if "id" in frag:  # header: exactly once, before any argument, indices in order
                assert i not in calls and i == len(calls), (i, calls)
                assert frag["type"] == "function" and frag["function"]["arguments"] == ""
                calls[i] = [frag["id"], frag["function"]["name"], ""]
            else:
                assert set(frag) == {"index", "function"} and i in calls
                assert frag["function"]["arguments"], "empty argument delta"
                calls[i][2] += frag["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())]


def stream(ids, cuts):
    p = ToolCallStreamParser(TOK)
    deltas, prev = [], 0
    for c in list(cuts) + [len(ids)]:
        deltas += p.feed(ids[prev:c])
        prev = c
    deltas += p.finish()
    return deltas, p


def as_tuples(calls):
    return [(c.id, c.name, c.arguments) for c in calls]


def check_streaming(ids, n_random=100, seed=0, valid_utf8=True):
    """Every single cut, one id per feed, and random multi-cuts all equal the one-shot parse."""
    content, calls = parse_tool_calls(TOK, ids)
    splits = [[c] for c in range(len(ids) + 1)] + [list(range(1, len(ids)))]
    rng = random.Random(seed)
    for _ in range(n_random):
        splits.append(sorted(rng.sample(range(len(ids) + 1), rng.randint(0, len(ids)))))
    for cuts in splits:
        deltas, p = stream(ids, cuts)
        assert accumulate(deltas) == (content, as_tuples(calls)), cuts
        assert p.tool_calls == calls, cuts
        for d in deltas if valid_utf8 else []:  # no partial UTF-8 character is ever emitted
            assert "\ufffd" not in json.dumps(d, ensure_ascii=False)
    return content, calls


# ---- one-shot rules ----------------------------------------------------------------------


def test_single_call():
    ids = [SB] + call_ids("functions.get_weather:0", '{"city": "Paris"}') + [SE, IM_END]
    content, calls = parse_tool_calls(TOK, ids)
    assert content == ""
    assert calls == [ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}', 0, True, True)]
    assert tool_call_to_openai(calls[0]) == {"id": "functions.get_weather:0", "type": "function",
                                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    check_streaming(ids)


def test_two_parallel_calls_never_merged():
    ids = ([SB] + call_ids("functions.get_weather:0", '{"city": "Paris"}')
           + call_ids("functions.get_time:1", '{"tz": "CET"}') + [SE])
    content, calls = parse_tool_calls(TOK, ids)
    assert content == ""
    assert as_tuples(calls) == [("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                                ("functions.get_time:1", "get_time", '{"tz": "CET"}')]
    assert [c.index for c in calls] == [0, 1]
    check_streaming(ids)


def test_content_before_and_after_section():
    ids = E("Let me check. ") + [SB] + call_ids("functions.f:0", "{}") + [SE] + E(" done") + [EOS]
    content, calls = parse_tool_calls(TOK, ids)
    assert content == "Let me check.  done"
    assert as_tuples(calls) == [("functions.f:0", "f", "{}")]
    check_streaming(ids)


def test_malformed_arguments_kept_and_reported():
    ids = ([SB] + call_ids("functions.a:0", '{"x": "unterminated') + call_ids("functions.b:1", "[1, 2]")
           + call_ids("functions.c:2", ' {"ok": true} \n') + [SE])
    _, calls = parse_tool_calls(TOK, ids)
    assert [c.arguments for c in calls] == ['{"x": "unterminated', "[1, 2]", ' {"ok": true} \n']
    assert [c.json_valid for c in calls] == [False, False, True]
    assert all(c.complete for c in calls)
    check_streaming(ids)


def test_missing_section_end_and_call_end():
    ids = E("hi") + [SB] + call_ids("functions.a:0", '{"k": 1}') + [EOS]   # no section end
    content, calls = parse_tool_calls(TOK, ids)
    assert content == "hi" and as_tuples(calls) == [("functions.a:0", "a", '{"k": 1}')] and calls[0].complete
    check_streaming(ids)
    ids = [SB] + call_ids("functions.a:0", '{"k": 1}', end=False)     # cut off inside the arguments
    _, calls = parse_tool_calls(TOK, ids)
    assert as_tuples(calls) == [("functions.a:0", "a", '{"k": 1}')] and not calls[0].complete
    check_streaming(ids)
    # a missing call end before the next call: two calls, the first incomplete
    ids = [SB] + call_ids("functions.a:0", '{"k": 1}', end=False) + call_ids("functions.b:1", "{}") + [SE]
    _, calls = parse_tool_calls(TOK, ids)
    assert as_tuples(calls) == [("functions.a:0", "a", '{"k": 1}'), ("functions.b:1", "b", "{}")]
    assert [c.complete for c in calls] == [False, True]
    check_streaming(ids)


def test_ids_with_whitespace_and_odd_prefixes():
    cases = {"\nfunctions.get_weather:0\n": ("functions.get_weather:0", "get_weather"),
             "  functions.get_weather:\n 3 ": ("functions.get_weather:3", "get_weather"),
             "get_weather:0": ("get_weather:0", "get_weather"),
             "search": ("search", "search"),
             "functions.ns.tool:2": ("functions.ns.tool:2", "ns.tool"),
             "functions.a:b:7": ("functions.a:b:7", "a:b")}
    for header, (cid, name) in cases.items():
        ids = [SB] + call_ids(header, "{}") + [SE]
        _, calls = parse_tool_calls(TOK, ids)
        assert (calls[0].id, calls[0].name) == (cid, name), header
        check_streaming(ids, n_random=10)


def test_header_edge_cases():
    # no argument-begin: arguments "", not valid JSON; empty id: dropped, later index stays dense
    ids = [SB, CB] + E("functions.noargs:0") + [CE, CB, AB] + E('{"lost": 1}') + [CE] + call_ids("functions.z:2", "{}")
    _, calls = parse_tool_calls(TOK, ids)
    assert as_tuples(calls) == [("functions.noargs:0", "noargs", ""), ("functions.z:2", "z", "{}")]
    assert [c.index for c in calls] == [0, 1] and [c.json_valid for c in calls] == [False, True]
    check_streaming(ids)
    # call begin without a section begin opens one; text between calls is dropped
    ids = E("a") + call_ids("functions.x:0", "{}") + E("\n") + call_ids("functions.y:1", "{}") + [SE] + E("b")
    content, calls = parse_tool_calls(TOK, ids)
    assert content == "ab" and [c.name for c in calls] == ["x", "y"]
    check_streaming(ids)


def test_special_tokens_never_in_content():
    reserved = TOK.num_ordinary + 100
    ids = ([THINK] + E("x") + [UNTHINK, TOK.bos_id] + E("y") + [reserved, TOK.id_of("<|im_middle|>"), AB, CE, SE]
           + E("z") + [SB] + call_ids("functions.f:0", '{"a": 1}') + [EOS, IM_END])
    content, calls = parse_tool_calls(TOK, ids)
    assert content == "xyz" and as_tuples(calls) == [("functions.f:0", "f", '{"a": 1}')]
    check_streaming(ids)


# ---- streaming and multi-byte text --------------------------------------------------------


def test_multibyte_split_across_tokens():
    text, args = "Température 東京 🎉 ok", json.dumps({"city": "東京", "emoji": "🎉😀"}, ensure_ascii=False)
    # precondition: some token of each ends inside a character
    for s in (text, args):
        assert any(_cuts_char(TOK.token_bytes(t)) for t in E(s)), s
    ids = E(text) + [SB] + call_ids("functions.weather:0", args) + [SE]
    content, calls = check_streaming(ids, n_random=300)
    assert content == text and calls[0].arguments == args and calls[0].json_valid


def test_output_cut_inside_a_character():
    """A generation stopped mid-character: the held bytes come out at finish() as U+FFFD,
    exactly as the one-shot decode gives them."""
    part = E("ok 東")[:-1]
    assert _cuts_char(TOK.token_bytes(part[-1]))
    for ids, want in ((part, ("ok \ufffd", [])),
                      ([SB] + call_ids("functions.f:0", '{"a": "東', end=False)[:-1],
                       ("", [("functions.f:0", "f", '{"a": "\ufffd')]))):
        content, calls = check_streaming(ids, valid_utf8=False)
        assert (content, as_tuples(calls)) == want


def _cuts_char(b):
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


_WORDS = ["hello", " world", "東京", "🎉", "é", " ", "\n", "{", "}", '"', ":", "Ж", "naïve", "1.5", "<|tool_call_end|>"]


def _rand_text(rng, n):
    return "".join(rng.choice(_WORDS) for _ in range(n))


def test_random_outputs_match_construction():
    """Random well-formed outputs: one-shot == what was built; streaming == one-shot."""
    rng = random.Random(1234)
    for trial in range(60):
        content = _rand_text(rng, rng.randint(0, 6))
        ids, expect = E(content), []
        if rng.random() < 0.8:
            ids.append(SB)
            for i in range(rng.randint(1, 3)):
                name = rng.choice(["get_weather", "search", "ns.tool", "f"])
                args = json.dumps({"q": _rand_text(rng, rng.randint(0, 4)), "n": rng.randint(0, 99)},
                                  ensure_ascii=rng.random() < 0.3)
                header = rng.choice(["", "\n", " "]) + f"functions.{name}:{i}" + rng.choice(["", "\n"])
                ids += call_ids(header, args)
                expect.append((f"functions.{name}:{i}", name, args))
            ids += [SE] if rng.random() < 0.7 else []
        ids += [IM_END] if rng.random() < 0.5 else []
        got_content, calls = parse_tool_calls(TOK, ids)
        assert got_content == content and as_tuples(calls) == expect, trial
        assert all(c.json_valid and c.complete for c in calls)
        check_streaming(ids, n_random=15, seed=trial)


def test_forced_prefix_and_merge():
    assert forced_tool_prefix(TOK) == [SB, CB]
    prefix = forced_tool_prefix(TOK, "get_weather")
    assert prefix == [SB, CB] + E("functions.get_weather:0") + [AB]
    p = ToolCallStreamParser(TOK)
    first = p.feed(prefix)  # the header is known before anything is generated
    assert first == [{"tool_calls": [{"index": 0, "id": "functions.get_weather:0", "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]}]
    gen = E('{"city": "東京"}') + [CE, SE, IM_END]
    steps = [p.feed(gen[i:i + 2]) for i in range(0, len(gen), 2)] + [p.finish()]
    assert parse_tool_calls(TOK, prefix + gen)[1] == p.tool_calls
    merged = [m for m in (merge_deltas(s) for s in [first] + steps) if m is not None]
    assert all(len(m.get("tool_calls", [])) <= 1 for m in merged)
    assert accumulate(merged) == ("", [("functions.get_weather:0", "get_weather", '{"city": "東京"}')])
    # merging a whole stream into one delta: header fields kept, arguments joined
    ids = E("hi ") + [SB] + call_ids("functions.a:0", '{"x": 1}') + call_ids("functions.b:1", "{}") + [SE]
    one = merge_deltas(stream(ids, range(1, len(ids)))[0])
    assert one == {"content": "hi ", "tool_calls": [
        {"index": 0, "id": "functions.a:0", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
        {"index": 1, "id": "functions.b:1", "type": "function", "function": {"name": "b", "arguments": "{}"}}]}
    assert merge_deltas([]) is None
    with pytest.raises(RuntimeError):
        p.feed([1])
