"""Kimi reasoning parser and reasoning -> tool-call composition: rules per thinking mode,
streaming == one-shot for any split. Expected values come from how the ids are built."""

import json
import random

import pytest

from serving.openai.reasoning_parser import (OutputStreamParser, ReasoningStreamParser, parse_output,
                                             parse_reasoning, thinking_started_from_prompt)
from serving.openai.tool_parser import forced_tool_prefix

from tests.support.kimi_ids import AB, CB, CE, E, EOS, IM_END, SB, SE, THINK, TOK, UNTHINK  # noqa: F401


def call_ids(header, args):
    return [CB] + E(header) + [AB] + E(args) + [CE]


def accumulate(deltas):
    """OpenAI-client accumulation -> (reasoning, content, [(id, name, arguments)])."""
    out = {"reasoning_content": "", "content": ""}
    calls = {}
    for d in deltas:
        assert d and set(d) <= {"reasoning_content", "content", "tool_calls"}, d
        for key in ("reasoning_content", "content"):
            out[key] += d.get(key, "")
        for frag in d.get("tool_calls", []):
            if "id" in frag:
                assert frag["index"] == len(calls)
                calls[frag["index"]] = [frag["id"], frag["function"]["name"], ""]
            else:
                calls[frag["index"]][2] += frag["function"]["arguments"]
    return out["reasoning_content"], out["content"], [tuple(c) for _, c in sorted(calls.items())]


def splits(n, n_random, seed):
    rng = random.Random(seed)
    out = [[c] for c in range(n + 1)] + [list(range(1, n))]
    out += [sorted(rng.sample(range(n + 1), rng.randint(0, n))) for _ in range(n_random)]
    return out


def feed_all(parser, ids, cuts):
    deltas, prev = [], 0
    for c in list(cuts) + [len(ids)]:
        deltas += parser.feed(ids[prev:c])
        prev = c
    return deltas + parser.finish()


def check_streaming(ids, thinking_started=True, n_random=60, seed=0):
    """ReasoningStreamParser and OutputStreamParser equal the one-shot parsers for every split."""
    reasoning, content_ids = parse_reasoning(TOK, ids, thinking_started=thinking_started)
    plain = TOK.decode(content_ids, skip_special=True)
    full = parse_output(TOK, ids, thinking_started=thinking_started)
    want_full = (full.reasoning, full.content, [(c.id, c.name, c.arguments) for c in full.tool_calls])
    for cuts in splits(len(ids), n_random, seed):
        d = feed_all(ReasoningStreamParser(TOK, thinking_started=thinking_started), ids, cuts)
        assert accumulate(d) == (reasoning, plain, []), cuts
        p = OutputStreamParser(TOK, thinking_started=thinking_started)
        d = feed_all(p, ids, cuts)
        assert accumulate(d) == want_full, cuts
        assert p.tool_calls == full.tool_calls
        assert all("\ufffd" not in json.dumps(x, ensure_ascii=False) for x in d)
        # composition: the content ids passed on are the one-shot content ids
        r, prev, passed = ReasoningStreamParser(TOK, thinking_started=thinking_started), 0, []
        for c in list(cuts) + [len(ids)]:
            passed += r.feed_ids(ids[prev:c])[1]
            prev = c
        assert passed == content_ids
    return reasoning, content_ids


def test_think_block_then_content():
    ids = [THINK] + E("Let me think.") + [UNTHINK] + E("The answer.") + [IM_END]
    for mode in (True, False):  # explicit tags: same result whether thinking was started or not
        reasoning, content_ids = check_streaming(ids, thinking_started=mode)
        assert reasoning == "Let me think."
        assert TOK.decode(content_ids, skip_special=True) == "The answer."
        assert THINK not in content_ids and UNTHINK not in content_ids


def test_close_without_open():
    ids = E("pondering 東京") + [UNTHINK] + E("answer")
    assert check_streaming(ids, True) == ("pondering 東京", E("answer"))
    # content mode cannot know the reasoning began before seeing </think>: all content
    reasoning, content_ids = check_streaming(ids, False)
    assert reasoning == "" and TOK.decode(content_ids) == "pondering 東京answer"


def test_no_tags():
    ids = E("just text") + [EOS]
    # thinking started and never closed: cut off while thinking, all reasoning (EOS dropped)
    assert check_streaming(ids, True) == ("just text", [])
    assert check_streaming(ids, False) == ("", ids)


def test_thinking_disabled_everything_is_content():
    ids = [THINK] + E("r") + [UNTHINK] + E("c")
    reasoning, content_ids = check_streaming(ids, None)
    assert reasoning == "" and content_ids == E("r") + E("c")
    out = parse_output(TOK, ids, thinking_started=None)
    assert (out.reasoning, out.content, out.tool_calls) == ("", "rc", [])


def test_reasoning_then_tool_call():
    call = call_ids("\nfunctions.get_weather:0", '{"city": "東京"}')
    for ids in ([THINK] + E("need weather") + [UNTHINK] + E("Checking.") + [SB] + call + [SE],
                E("need weather") + [SB] + call + [SE],          # section begin ends reasoning
                E("need weather") + call + [SE, IM_END]):         # so does a bare call begin
        check_streaming(ids)
        out = parse_output(TOK, ids)
        assert out.reasoning == "need weather"
        assert out.content == ("Checking." if ids[0] == THINK else "")
        assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
            ("functions.get_weather:0", "get_weather", '{"city": "東京"}')]


def test_no_reasoning_after_tool_section():
    ids = E("r") + [UNTHINK, SB] + call_ids("functions.f:0", "{}") + [THINK] + E("x") + [UNTHINK, SE] + E("after")
    out = parse_output(TOK, ids)
    assert (out.reasoning, out.content, [c.name for c in out.tool_calls]) == ("r", "after", ["f"])
    check_streaming(ids)


def test_specials_dropped_from_reasoning():
    ids = [THINK, TOK.bos_id] + E("a") + [TOK.num_ordinary + 77, AB] + E("b") + [UNTHINK] + E("c")
    assert check_streaming(ids)[0] == "ab"


def test_tools_off_and_forced_prefix():
    ids = E("r") + [UNTHINK] + E("c") + [SB] + call_ids("functions.f:0", "{}") + [SE]
    out = parse_output(TOK, ids, tools=False)
    assert (out.reasoning, out.content, out.tool_calls) == ("r", "cfunctions.f:0{}", [])
    d = feed_all(OutputStreamParser(TOK, tools=False), ids, range(1, len(ids)))
    assert accumulate(d) == ("r", "cfunctions.f:0{}", [])
    # forced named call: the prefix ends reasoning, the header comes with the first feed
    prefix, gen = forced_tool_prefix(TOK, "f"), E('{"a": "é"}') + [CE, SE]
    p = OutputStreamParser(TOK, thinking_started=True)
    assert accumulate(p.feed(prefix)) == ("", "", [("functions.f:0", "f", "")])
    check_streaming(prefix + gen)
    assert parse_output(TOK, prefix + gen).tool_calls[0].arguments == '{"a": "é"}'


def test_thinking_started_from_prompt():
    msgs = [{"role": "user", "content": "hi"}]
    assert thinking_started_from_prompt(TOK, TOK.apply_chat_template(msgs, thinking=False, tokenize=True)) is None
    on = TOK.apply_chat_template(msgs, thinking=True, tokenize=True)
    assert on[-1] == TOK.id_of("<|im_middle|>") and thinking_started_from_prompt(TOK, on) is True
    assert thinking_started_from_prompt(TOK, on + [THINK]) is True
    assert thinking_started_from_prompt(TOK, on, default=False) is False
    assert thinking_started_from_prompt(TOK, on + [THINK], default=False) is True


_WORDS = ["think", " step", "東京", "🎉😀", "é", "\n", " ", "{", "Ж", "</think>", "1.5"]


def test_random_outputs_match_construction():
    rng = random.Random(99)
    text = lambda n: "".join(rng.choice(_WORDS) for _ in range(n))  # noqa: E731
    for trial in range(60):
        reasoning, content = text(rng.randint(0, 6)), text(rng.randint(0, 5))
        ids = ([THINK] if rng.random() < 0.5 else []) + E(reasoning)
        calls = []
        if rng.random() < 0.6 or not reasoning:
            ids += [UNTHINK] + E(content)
        else:
            content = ""  # reasoning ends at the section; no content
        if rng.random() < 0.6:
            ids.append(SB)
            for i in range(rng.randint(1, 2)):
                args = json.dumps({"q": text(rng.randint(0, 3))}, ensure_ascii=False)
                ids += call_ids(f"functions.t{i}:{i}", args)
                calls.append((f"functions.t{i}:{i}", f"t{i}", args))
            ids.append(SE)
        ids += [IM_END] if rng.random() < 0.5 else []
        out = parse_output(TOK, ids)
        assert (out.reasoning, out.content, [(c.id, c.name, c.arguments) for c in out.tool_calls]) \
            == (reasoning, content, calls), trial
        check_streaming(ids, n_random=10, seed=trial)


def test_feed_after_finish():
    p = ReasoningStreamParser(TOK)
    p.feed(E("x"))
    assert p.finish() == [] and p.finish() == []
    with pytest.raises(RuntimeError):
        p.feed([1])
