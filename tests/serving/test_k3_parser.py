"""Parsing what K3 generates. Outputs are built with the K3 renderer (golden-tested against the
public one): an assistant message rendered after its prompt is exactly what the model writes.
Every case is parsed one-shot and streamed (token by token and in random splits), which must agree.
Failure classes from other engines' issues: tags split across deltas, a missing think close
(vllm#53246), text around the tools channel, a tools channel with no parsable call (vllm#44137),
tool markup leaking into content when no tools are declared (sglang#39583)."""
import json
import random

import pytest

from k3jax.tokenizer import KimiTokenizer
from k3jax.tokenizer import k3_format as fmt
from serving.openai.k3_parser import K3OutputParser, count_tool_calls
from serving.openai.reasoning_parser import OutputStreamParser, parse_output, thinking_started_from_prompt
from serving.openai.tool_parser import forced_tool_prefix, merge_deltas

TOK = KimiTokenizer.tiny("k3")
USER = [{"role": "user", "content": "Weather in Paris?"}]
ARGS = {"city": "Paris <|close|>argument<|sep|> \"quoted\"", "days": 3, "scale": -1.5, "metric": True,
        "hint": None, "opts": {"b": [1, "x"], "a": {"c": None}}, "tags": ["a", 2, False]}


def prompt(thinking=True, messages=USER):
    return fmt.encode(TOK, fmt.render(messages, thinking=thinking))


def generated(message, thinking=True, messages=USER):
    """Ids the model writes for `message`: its rendering after the generation prompt."""
    p = prompt(thinking, messages)
    full = fmt.encode(TOK, fmt.render(messages + [message], thinking=thinking, add_generation_prompt=False))
    assert full[:len(p)] == p
    return full[len(p):]


def E(text):
    return TOK.encode(text)


def S(*parts):
    """Ids from parts: control strings (tags) with specials, anything else plain text."""
    out = []
    for part in parts:
        out += TOK.encode(part, allow_special=part.startswith("<|"))
    return out


def parse_all_ways(ids, *, thinking_started=True, tools=True, first=0, seed=0):
    one = parse_output(TOK, ids, thinking_started=thinking_started, tools=tools, first_call_number=first)
    splits = [[[t] for t in ids]]
    rng = random.Random(seed)
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(1, 6)))) if len(ids) > 1 else []
        splits.append([ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])])
    for pieces in splits:
        p = OutputStreamParser(TOK, thinking_started=thinking_started, tools=tools, first_call_number=first)
        deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
        for d in deltas:   # no markup ever reaches the client
            for key in ("content", "reasoning_content"):
                assert "<|" not in d.get(key, "") or "<|" in (one.content + one.reasoning)
        merged = merge_deltas(deltas) or {}
        assert merged.get("reasoning_content", "") == one.reasoning
        assert merged.get("content", "") == one.content
        streamed_calls = merged.get("tool_calls", [])
        assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in streamed_calls] == \
            [(c.id, c.name, c.arguments) for c in one.tool_calls]
        assert p.tool_calls == one.tool_calls
    return one


def test_round_trip_reasoning_content_and_every_argument_type():
    msg = {"role": "assistant", "reasoning_content": "Think: call it.", "content": "Checking now.\n",
           "tool_calls": [{"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
                          {"id": "y", "type": "function", "function": {"name": "noop", "arguments": {}}}]}
    ids = generated(msg)
    out = parse_all_ways(ids + [TOK.eos_id], first=5)
    assert out.reasoning == "Think: call it." and out.content == "Checking now.\n"
    assert [(c.id, c.name, c.index, c.complete, c.json_valid) for c in out.tool_calls] == \
        [("get_weather:5", "get_weather", 0, True, True), ("noop:6", "noop", 1, True, True)]
    assert json.loads(out.tool_calls[0].arguments) == ARGS   # typed values come back with their types
    assert json.loads(out.tool_calls[1].arguments) == {}


def test_thinking_off_and_prompt_states():
    assert thinking_started_from_prompt(TOK, prompt(True)) is True
    assert thinking_started_from_prompt(TOK, prompt(False)) is None
    msg_level = prompt(True)[:-len(S("<|open|>", "think", "<|sep|>"))]
    assert thinking_started_from_prompt(TOK, msg_level) is False
    ids = generated({"role": "assistant", "content": "Sunny."}, thinking=False)
    out = parse_all_ways(ids, thinking_started=None)
    assert (out.reasoning, out.content, out.tool_calls) == ("", "Sunny.", [])
    # message level: the model writes its own channels
    full = generated({"role": "assistant", "reasoning_content": "r", "content": "c"})
    out = parse_all_ways(S("<|open|>", "think", "<|sep|>") + full, thinking_started=False)
    assert (out.reasoning, out.content) == ("r", "c")


def test_missing_think_close():
    # reasoning runs straight into the response channel
    ids = E("hmm") + S("<|open|>", "response", "<|sep|>") + E("4") + S("<|close|>", "response", "<|sep|>")
    out = parse_all_ways(ids)
    assert (out.reasoning, out.content) == ("hmm", "4")
    # ... or straight into the tools channel (vllm#53246: calls must not be lost)
    call = generated({"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]})
    start = _find(call, S("<|open|>", "tools", "<|sep|>"))
    out = parse_all_ways(E("let me call") + call[start:])
    assert out.reasoning == "let me call" and out.content == ""
    assert [c.name for c in out.tool_calls] == ["get_weather"] and json.loads(out.tool_calls[0].arguments) == \
        {"city": "Paris"}


def _find(seq, sub):
    for i in range(len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            return i
    raise ValueError("not found")


def test_output_cut_while_thinking_is_reasoning():
    out = parse_all_ways(E("still thinking about it") + S("<|close|>", "thi"))
    assert (out.reasoning, out.content, out.tool_calls) == ("still thinking about it", "", [])


def test_text_around_the_tools_channel():
    call = S("<|open|>", "call", " tool", '="', "f", '"', "<|sep|>", "<|open|>", "argument", " key", '="', "a",
             '"', " type", '="', "number", '"', "<|sep|>") + E("1") + S("<|close|>", "argument", "<|sep|>",
                                                                       "<|close|>", "call", "<|sep|>")
    ids = (E("r") + S("<|close|>", "think", "<|sep|>") + E("\n") + S("<|open|>", "response", "<|sep|>") + E("A")
           + S("<|close|>", "response", "<|sep|>") + E("\n\n") + S("<|open|>", "tools", "<|sep|>") + E("\n ")
           + call + E("\n") + call + S("<|close|>", "tools", "<|sep|>") + E(" Done.")
           + S("<|close|>", "message", "<|sep|>", "<|end_of_msg|>") + E("ignored after the message"))
    out = parse_all_ways(ids)
    assert out.reasoning == "r" and out.content == "A Done."
    assert [(c.id, c.arguments) for c in out.tool_calls] == [("f:0", '{"a": 1}'), ("f:1", '{"a": 1}')]


def test_tools_inside_an_unclosed_response():
    ids = (S("<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>") + E("Sure.")
           + S("<|open|>", "call", " tool", '="', "g", '"', "<|sep|>", "<|close|>", "call", "<|sep|>"))
    out = parse_all_ways(ids)
    assert out.content == "Sure." and [(c.name, c.arguments, c.complete) for c in out.tool_calls] == \
        [("g", "{}", True)]


def test_zero_parsable_calls_keep_the_text():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    ids = (S("<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>", "<|close|>", "response", "<|sep|>",
             "<|open|>", "tools", "<|sep|>") + E(text)
           + S("<|open|>", "call", "<|sep|>", "<|close|>", "call", "<|sep|>")   # no tool name: dropped
           + S("<|close|>", "tools", "<|sep|>"))
    out = parse_all_ways(ids)
    assert out.tool_calls == [] and out.content == text
    # an unfinished tools channel too (the output ended there)
    out = parse_all_ways(S("<|close|>", "think", "<|sep|>", "<|open|>", "tools", "<|sep|>") + E(text))
    assert out.tool_calls == [] and out.content == text


def test_no_tools_declared_no_markup_leaks():
    msg = {"role": "assistant", "reasoning_content": "r", "content": "Here.",
           "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "37*19"}}}]}
    out = parse_all_ways(generated(msg), tools=False)
    assert (out.reasoning, out.content, out.tool_calls) == ("r", "Here.", [])


def test_call_cut_by_max_tokens():
    ids = generated({"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]})
    cut = _find(ids, S("<|open|>", "argument", " key", '="', "days"))
    out = parse_all_ways(ids[:cut + 3])
    assert [(c.name, c.complete, json.loads(c.arguments)) for c in out.tool_calls] == \
        [("get_weather", False, {"city": "Paris"})]


def test_non_object_arguments_in_a_json_element():
    msg = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "raw", "arguments": "x = 1"}}]}
    out = parse_all_ways(generated(msg))
    assert [(c.name, c.arguments, c.json_valid) for c in out.tool_calls] == [("raw", "x = 1", False)]


def test_forced_prefix_named_and_required():
    for thinking in (True, False):
        p = prompt(thinking)
        prefix = forced_tool_prefix(TOK, "get_weather", p)
        text = TOK.decode(prefix)
        assert text.endswith('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>')
        assert text.startswith("<|close|>think<|sep|>" if thinking else "<|close|>response<|sep|>")
        args = S("<|open|>", "argument", " key", '="', "city", '"', " type", '="', "string", '"', "<|sep|>") + \
            E("Paris") + S("<|close|>", "argument", "<|sep|>", "<|close|>", "call", "<|sep|>")
        start = thinking_started_from_prompt(TOK, p)
        out = parse_all_ways(prefix + args, thinking_started=start)
        assert (out.reasoning, out.content) == ("", "")
        assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    required = TOK.decode(forced_tool_prefix(TOK, None, prompt(True)))
    assert required.endswith("<|open|>tools<|sep|>") and "call" not in required


def test_count_tool_calls():
    msgs = [{"role": "assistant", "tool_calls": [{}, {}]}, {"role": "tool"}, {"role": "assistant", "content": "x"},
            {"role": "assistant", "tool_calls": [{}]}]
    assert count_tool_calls(msgs) == 3


def test_k3_parser_refuses_feed_after_finish():
    p = K3OutputParser(TOK)
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed([1])


def test_unknown_elements_are_transparent():
    ids = (E("a") + S("<|open|>", "note", "<|sep|>") + E("b") + S("<|close|>", "think", "<|sep|>")
           + S("<|open|>", "response", "<|sep|>") + E("c") + S("<|open|>", "cite", " n", '="', "1", '"', "<|sep|>")
           + E("d") + S("<|close|>", "cite", "<|sep|>") + E("e"))
    out = parse_all_ways(ids)
    assert (out.reasoning, out.content) == ("ab", "cde")
