"""max_model_len when unset: the model's window when the page pool holds one such sequence, else the longest
it holds, logged with the reason; a prompt over it is refused naming both numbers (the server's 400 is in
tests/serving/test_server_requests.py)."""
import logging

import pytest

from serving.engine_args import CPU_MAX_MODEL_LEN, EngineArgs, default_max_model_len


def test_default_rule():
    n, why = default_max_model_len(1 << 20, 70_000, 16, on_cpu=False)
    assert n == 1 << 20 and "window" in why
    n, why = default_max_model_len(1 << 20, 1001, 16, on_cpu=False)     # page 0 is reserved
    assert n == 16_000 and "1000 pages of 16" in why and str(1 << 20) in why
    n, why = default_max_model_len(1 << 20, 70_000, 16, on_cpu=True)
    assert n == CPU_MAX_MODEL_LEN and "CPU" in why
    assert default_max_model_len(4096, 70_000, 16, on_cpu=True)[0] == 4096
    assert default_max_model_len(1 << 20, 101, 16, on_cpu=True)[0] == 1600


@pytest.fixture(scope="module")
def tiny():
    from k3jax.api import load_model
    return load_model("tiny-random", dtype="float32")


def _engine(model, **kw):
    from serving.engine import LLMEngine
    return LLMEngine(model, EngineArgs(max_num_seqs=2, max_num_batched_tokens=64, warmup=False,
                                       compilation_cache_dir=None, **kw))


def test_engine_default_is_the_window_or_what_fits(tiny, caplog):
    window = tiny.config.max_position_embeddings
    with caplog.at_level(logging.INFO, logger="serving.engine"):
        assert _engine(tiny, num_pages=window // 16 + 1, num_slots=8).max_model_len == window
    assert f"max_model_len {window}: the model's window" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="serving.engine"):
        eng = _engine(tiny, num_pages=41, num_slots=8)
    assert eng.max_model_len == 640 and eng.runner.max_pages == 40
    assert f"max_model_len 640: the longest sequence the cache holds (40 pages of 16 tokens)" in caplog.text
    assert str(window) in caplog.text
    with pytest.raises(ValueError, match=r"700 tokens leave no room in the context of 640 \(max_model_len\)"):
        eng.add_request(list(range(700)))
    assert _engine(tiny, max_model_len=100, num_pages=41, num_slots=8).max_model_len == 100   # given: kept


def test_llm_refuses_a_prompt_over_max_model_len(tiny):
    from k3jax.offline import LLM
    llm = LLM(tiny, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              warmup=False, compilation_cache_dir=None)
    with pytest.raises(ValueError, match=r"prompt: 80 tokens leave no room in the context of 64"):
        llm.generate({"prompt_token_ids": list(range(80))})
    assert not llm.engine.has_unfinished()
