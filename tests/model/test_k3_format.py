"""K3's tagged message format: our renderer against the public one (golden fixtures made by
tools/make_k3_format_fixtures.py from the checkpoint's encoding_k3.py), plus the rules the
fixtures cannot show on their own."""
import json
from pathlib import Path

import pytest

from k3jax.tokenizer import KimiTokenizer
from k3jax.tokenizer import k3_format

GOLDEN = json.loads((Path(__file__).parents[1] / "fixtures" / "k3_format_golden.json").read_text(encoding="utf-8"))
CASES = {c["name"]: c for c in GOLDEN["cases"]}


@pytest.fixture(scope="module")
def tok():
    return KimiTokenizer.tiny("k3")


def _args(case):
    kw = json.loads(json.dumps(case["kwargs"]))
    kw["images_in_text"] = True      # the public renderer's way with a placeholder typed in text
    return kw.pop("messages"), kw.pop("tools", None), kw


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_segments_and_ids(tok, name):
    case = CASES[name]
    messages, tools, kw = _args(case)
    segments = k3_format.render(messages, tools, **kw)
    assert [[s.text, s.control] for s in segments] == case["segments"]
    assert k3_format.encode(tok, segments) == case["ids"]
    # the tokenizer entry point renders the same thing
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, **kw)
    assert ids == case["ids"]
    assert tok.apply_chat_template(messages, tools=tools, **kw) == case["text"]


def test_golden_set_covers_the_issue(tok):
    text = {n: c["text"] for n, c in CASES.items()}
    assert 'type="tool-declare"' in text["tools_declared"]
    every = text["tool_call_every_argument_type"]
    for t in ("string", "number", "boolean", "null", "object", "array"):
        assert f'type="{t}"' in every
    assert '<|open|>json type="object"<|sep|>not json {<|close|>json<|sep|>' in every
    assert 'call tool="f&amp;&quot;g&quot;"' in every
    # results given out of order render in call order, named by the matched call
    rt = text["tool_round_trip_results_out_of_order"]
    assert rt.index('tool="get_weather" index="1"') < rt.index('tool="search" index="2"')
    assert "tool_choice=required" in text["tool_choice_required"]
    assert "tool_choice=none" in text["tool_choice_none"]
    assert "tool_choice" not in text["tool_choice_named"]
    assert '"required":["name"]' in text["response_format_json_schema"]
    assert "image 640x480" in text["images"] and text["images"].count("<|media_pad|>") == 3
    assert text["thinking_off_multi_turn"].endswith("<|open|>response<|sep|>")
    assert "dropped when thinking is off" not in text["thinking_off_multi_turn"]
    # K3 keeps the reasoning of every assistant turn (K2 dropped the old ones)
    assert "Add them." in text["system_multi_turn"] and "  six  " in text["system_multi_turn"]


def test_segments_are_encoded_one_by_one(tok):
    # Encoding the joined prompt with special tokens parsed would turn text that spells a
    # control token into that token; the checkpoint tokenizer encodes message text on its own.
    case = CASES["literal_control_text_in_content"]
    assert tok.encode(case["text"], allow_special=True) != case["ids"]
    assert tok.decode(case["ids"]) == case["text"]


def test_message_text_cannot_smuggle_control_tokens(tok):
    ids = CASES["literal_control_text_in_content"]["ids"]
    structural = {tok.id_of(n) for n in (k3_format.OPEN, k3_format.CLOSE, k3_format.SEP, k3_format.END_OF_MSG)}
    # 3 messages' worth of structure: effort message, user message, generation prompt
    n_struct = sum(t in structural for t in ids)
    plain = k3_format.render([{"role": "user", "content": "x"}])
    assert n_struct == sum(t in structural for t in k3_format.encode(tok, plain))


def test_option_errors():
    with pytest.raises(ValueError, match="thinking_effort"):
        k3_format.render([{"role": "user", "content": "x"}], thinking_effort="medium")
    with pytest.raises(ValueError, match="image prompts"):
        k3_format.render([{"role": "user", "content": "x"}], image_prompts=["<|media_pad|>"])
    with pytest.raises(ValueError, match="more images"):
        k3_format.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}] * 2}],
                         image_prompts=["p"])
    with pytest.raises(ValueError, match="tool name"):
        k3_format.render([{"role": "tool", "content": "orphan"}])
    with pytest.raises(ValueError, match="JSON object"):
        k3_format.render([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])


def test_image_prompt_text():
    assert k3_format.image_prompt((640, 480)) == \
        "<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_end|>"
    assert k3_format.image_prompt() == "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


def test_value_round_trip():
    for v in json.loads(json.dumps([True, None, 3, -2.5, "s\n\"", {"a": [1]}, [1, "x"]])):
        t = k3_format.value_type(v)
        assert k3_format.parse_value(k3_format.value_text(v), t) == v
    assert k3_format.unescape_attr(k3_format.escape_attr('a&"b&amp;')) == 'a&"b&amp;'
