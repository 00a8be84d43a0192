"""tool_choice "required": the grammar after the forced prefix admits only calls of the offered tools
with arguments valid for their schemas, in the Kimi (K2) and K3 formats. Checked without a model: a
"model" that picks a random allowed token at every step must still produce calls that parse (whole and
streamed) into declared names with schema-valid JSON arguments. (The served model: test_server*.py.)"""

import numpy as np
import pytest

from k3jax.tokenizer import KimiTokenizer
from tests.support.server_fixture import BOUNDED_TOOLS, assert_declared_calls
from serving.openai import chat
from serving.openai.errors import APIError
from serving.openai.generation import ServerState
from serving.openai.protocol import ChatCompletionRequest
from serving.openai.tool_parser import merge_deltas

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

USER = [{"role": "user", "content": "Weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def states():
    out = {}
    for fmt in ("kimi", "k3"):
        tok = KimiTokenizer.tiny(fmt)
        out[fmt] = ServerState(engine=None, tokenizer=tok, model_name="m", max_model_len=8192, metrics=None)
    return out


def _plan(state, **kw):
    return chat.Plan(state, ChatCompletionRequest(messages=USER, tools=BOUNDED_TOOLS, tool_choice="required", **kw))


def _random_walk(matcher, vocab: int, rng, max_steps: int = 3000) -> list:
    """Ids a model writing noise would produce under the matcher: a random allowed token each step."""
    ids = []
    for _ in range(max_steps):
        mask = np.unpackbits(matcher.allowed_mask().view(np.uint8), bitorder="little")[:vocab]
        t = int(rng.choice(np.flatnonzero(mask)))
        assert matcher.accept(t)
        ids.append(t)
        if matcher.is_terminated():
            return ids
    raise AssertionError("the grammar did not end")


def _streamed_calls(plan, tok, ids) -> list:
    parser, first = plan.stream_parser(tok)
    deltas = list(first)
    for t in ids:
        deltas += parser.feed([t])
    deltas += parser.finish()
    calls = {}
    for d in deltas:
        for tc in (merge_deltas([d]) or {}).get("tool_calls", []):
            slot = calls.setdefault(tc["index"], ["", ""])
            fn = tc.get("function") or {}
            slot[0] += fn.get("name") or ""
            slot[1] += fn.get("arguments") or ""
    return [tuple(v) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("fmt", ["kimi", "k3"])
@pytest.mark.parametrize("parallel", [True, False])
def test_random_outputs_are_declared_calls_with_valid_arguments(states, fmt, parallel):
    state = states[fmt]
    tok = state.tokenizer
    plan = _plan(state, parallel_tool_calls=parallel)
    assert plan.matcher_factory is not None
    rng = np.random.default_rng(len(fmt) + parallel)
    names = set()
    for _ in range(6):
        ids = _random_walk(plan.matcher_factory(), tok.vocab_size, rng)
        assert ids[-1] in tok.stop_ids
        calls = [(c.name, c.arguments) for c in plan.parse(tok, ids[:-1]).tool_calls]
        assert_declared_calls(calls, BOUNDED_TOOLS)
        assert parallel or len(calls) == 1
        assert _streamed_calls(plan, tok, ids[:-1]) == calls
        names.update(n for n, _ in calls)
    assert names == {"get_weather", "get_time"}      # (both tools are reachable)


def test_kimi_grammar_admits_the_declared_calls_only(states):
    state = states["kimi"]
    tok = state.tokenizer
    plan = _plan(state)
    assert tok.decode(plan.forced) == "<|tool_calls_section_begin|><|tool_call_begin|>"

    def accepts(text):
        m = plan.matcher_factory()
        return all(m.accept(t) for t in tok.encode(text, allow_special=True))

    call = 'functions.get_time:0<|tool_call_argument_begin|>{"tz": "UTC"}<|tool_call_end|>'
    assert accepts(call + "<|tool_call_begin|>" + call.replace(":0", ":1") + "<|tool_calls_section_end|><|im_end|>")
    assert not accepts("functions.get_date:0")                                             # undeclared
    assert not accepts('functions.get_time:0<|tool_call_argument_begin|>{"tz": "PST"}')      # not in the enum
    assert not accepts('functions.get_weather:0<|tool_call_argument_begin|>{"days": 3}')     # city required first
    assert not accepts(call + "<|im_end|>")                                                # the section must close
    single = _plan(state, parallel_tool_calls=False).matcher_factory()
    assert not all(single.accept(t) for t in tok.encode(call + "<|tool_call_begin|>", allow_special=True))


@pytest.mark.parametrize("fmt", ["kimi", "k3"])
def test_required_with_unusable_tools_is_a_400(states, fmt):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]
    with pytest.raises(APIError) as e:
        chat.Plan(states[fmt], ChatCompletionRequest(messages=USER, tools=bad, tool_choice="required"))
    assert e.value.status == 400 and e.value.param == "tools"
