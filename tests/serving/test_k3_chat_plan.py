"""How a chat request becomes a K3 prompt (serving/openai/chat.py's plan), without a server:
image prompts name the image's size, tool_choice / response_format reach the prompt, calls are
numbered over the conversation; the Kimi format is left as it was."""
import numpy as np
import pytest

from k3jax.tokenizer import KimiTokenizer
from serving.multimodal import ImageInput
from serving.openai import chat
from serving.openai.generation import ServerState
from serving.openai.protocol import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


class _Images:
    pad_id = None

    def load(self, src):
        return ImageInput(digest=src, pixel_values=np.zeros((16, 3, 14, 14), np.float32), grid_thw=(1, 4, 4),
                          num_tokens=4, size=(640, 480))


def _plan(tok, **req):
    state = ServerState(engine=None, tokenizer=tok, model_name="m", max_model_len=8192, metrics=None,
                        vision=_Images())
    return chat.Plan(state, ChatCompletionRequest(model="m", **req))


@pytest.fixture(scope="module")
def k3():
    return KimiTokenizer.tiny("k3")


def test_images_get_k3_prompts_with_their_size(k3):
    p = _plan(k3, messages=[{"role": "user", "content": [IMAGE, {"type": "text", "text": "what?"}]}])
    text = k3.decode(p.prompt)
    assert '<|open|>message role="user"<|sep|><|media_begin|>image 640x480<|media_content|><|media_pad|>' \
           '<|media_end|>what?<|close|>message<|sep|>' in text
    assert p.num_prompt_tokens == len(p.prompt) + 3 and p.thinking is True


def test_tool_choice_and_response_format_reach_the_prompt(k3):
    user = [{"role": "user", "content": "hi"}]
    none = _plan(k3, messages=user, tools=TOOLS, tool_choice="none")
    text = k3.decode(none.prompt)
    assert 'type="tool-declare"' in text and "tool_choice=none" in text and not none.parse_tools
    assert "tool_choice" not in k3.decode(_plan(k3, messages=user, tools=TOOLS).prompt)
    rf = _plan(k3, messages=user, response_format={"type": "json_object"})
    assert "response_format=json_object" in k3.decode(rf.prompt) and rf.thinking is None   # thinking off
    assert rf.matcher_factory is not None


def test_forced_named_call_is_grammar_constrained_and_numbered(k3):
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "get_weather:0", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
               {"role": "tool", "tool_call_id": "get_weather:0", "content": "rain"},
               {"role": "user", "content": "and Paris?"}]
    p = _plan(k3, messages=history, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert k3.decode(p.forced).endswith('<|open|>call tool="get_weather" index="1"<|sep|>')
    assert p.matcher_factory is not None and p.call_number == 1
    args = k3.encode('<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
                     '<|close|>call<|sep|>', allow_special=True)
    m = p.matcher_factory()
    assert all(m.accept(t) for t in args)
    out = p.parse(k3, args)
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [("get_weather:1", "get_weather",
                                                                      '{"city": "Paris"}')]


@pytest.mark.parametrize("parameters", [{"properties": 5}, {"properties": ["city"]}, {"required": [["city"]]},
                                        {"properties": {"city": {"type": {"a": 1}}}},
                                        {"properties": {"city": {"type": "string", "enum": "abc"}}}])
def test_malformed_tool_parameters_of_a_forced_k3_call_are_a_400(k3, parameters):
    """tool_choice required / named on K3 builds a grammar from the parameters: these were a 500
    (AttributeError / TypeError in the grammar builder)."""
    from serving.openai.errors import APIError
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(APIError) as e:
            _plan(k3, messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=choice)
        assert e.value.status == 400 and e.value.param == "tools", e.value.message


def test_kimi_format_unchanged():
    tok = KimiTokenizer.tiny()
    p = _plan(tok, messages=[{"role": "user", "content": [IMAGE, {"type": "text", "text": "what?"}]}])
    assert "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" in tok.decode(p.prompt)
    assert p.prompt == tok.apply_chat_template([{"role": "user", "content": [IMAGE, {"type": "text", "text": "what?"}]}],
                                               tokenize=True)


def test_reasoning_effort(k3):
    user = [{"role": "user", "content": "hi"}]
    assert "`thinking_effort=low`" in k3.decode(_plan(k3, messages=user, reasoning_effort="low").prompt)
    off = _plan(k3, messages=user, reasoning_effort="none")
    assert k3.decode(off.prompt).endswith("<|open|>response<|sep|>") and off.thinking is None
    with pytest.raises(Exception, match="thinking_effort"):
        _plan(k3, messages=user, reasoning_effort="medium")


def test_load_model_picks_the_format_from_the_checkpoint(tmp_path):
    from tools import synthetic_k3
    from k3jax import load_model
    for files, fmt in (("k3", "k3"), (True, "kimi")):
        d = tmp_path / str(files)
        synthetic_k3.write_checkpoint(d, seed=1, vision=False, tokenizer=files)
        assert load_model(str(d)).tokenizer.message_format == fmt
