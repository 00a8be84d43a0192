"""Public API: load_model, Model.logits, generate and info entry points, bad input."""
import json
import subprocess
import sys

import numpy as np
import pytest

import k3jax
from k3jax.generate import generate_ids


@pytest.fixture(scope="module")
def tiny():
    return k3jax.load_model("tiny-random", dtype="float32")


def test_tiny_is_deterministic_and_has_tokenizer(tiny):
    again = k3jax.load_model("tiny-random", dtype="float32")
    toks = np.array([[1, 2, 3, 500, 1000]])
    a, b = tiny.logits(toks), again.logits(toks)
    assert a.shape == (1, 5, 1024) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    assert tiny.tokenizer.vocab_size == tiny.config.vocab_size == 1024
    assert tiny.tokenizer.decode(tiny.tokenizer.encode("héllo 世界")) == "héllo 世界"


@pytest.mark.parametrize("bad,msg", [
    ([[1, 2, 1024]], "out of range"), ([[-1, 2]], "out of range"), (np.zeros((1, 0), np.int32), "empty"),
    ([[1.5, 2.0]], "integers"), ([1, 2, 3], "dimensions"), ([["a", "b"]], "integers"),
])
def test_bad_tokens_raise_value_error(tiny, bad, msg):
    with pytest.raises(ValueError, match=msg):
        tiny.logits(bad)


def test_bad_load_arguments():
    with pytest.raises(ValueError, match="neither a directory, a preset"):
        k3jax.load_model("no-such-model")
    with pytest.raises(ValueError, match="ships no weights"):
        k3jax.load_model("kimi-k3")
    with pytest.raises(ValueError, match="dtype"):
        k3jax.load_model("tiny-random", dtype="int3")


def test_generate_loop_is_greedy_decoding_of_full_logits(tiny):
    prompt = np.random.RandomState(0).randint(0, 1024, 150)          # > one 128-token prefill chunk
    out = generate_ids(tiny, prompt, max_tokens=6)
    logits = tiny.logits([list(prompt) + out])[0]                     # causal: one pass checks every step
    assert out == [int(t) for t in np.argmax(logits[len(prompt) - 1:-1], axis=-1)]


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)


def test_info_counts_parameters_by_eval_shape():
    k3 = json.loads(_run("k3jax.info", "--model", "kimi-k3", "--json").stdout)
    assert abs(k3["total_params"] / 2.78e12 - 1) < 0.01
    assert 100e9 < k3["active_params"] < 108e9
    kl = json.loads(_run("k3jax.info", "--model", "kimi-linear-48b-a3b", "--json").stdout)
    assert abs(kl["total_params"] / 49e9 - 1) < 0.02 and 2.5e9 < kl["active_params"] < 4e9
    assert kl["mla_cache_bytes_per_token"] == 7 * 576 * 2


def test_generate_cli():
    # float32: the step shapes test_generate_loop_* compiled (the XLA cache under ~/.cache serves both)
    r = _run("k3jax.generate", "--model", "tiny-random", "--dtype", "float32", "--prompt", "Hello", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "4 generated" in r.stderr
    # a first run says it is compiling instead of sitting silent
    assert "preparing the model step" in r.stderr and "first step done in" in r.stderr
    r = _run("k3jax.generate", "--model", "tiny-random", "--prompt", "Hello", "--max-tokens", "0")
    assert r.returncode == 2 and "max_tokens" in r.stderr


def test_info_text_has_units():
    """`info` printed bare numbers (weight_bytes 2641920)."""
    lines = dict(line.split(None, 1) for line in _run("k3jax.info", "--model", "tiny-random").stdout.splitlines())
    assert lines["weight_bytes"].endswith(" MiB") and lines["mla_cache_bytes_per_token"] == "320 B"
    assert lines["total_params"].endswith(" params") and lines["max_context"] == "8192 tokens"
    assert lines["kda_state_bytes_per_sequence"] == "73.00 KiB"


@pytest.mark.parametrize("module", ["k3jax.serve", "k3jax.generate"])
def test_every_cli_flag_has_help_and_shows_its_default(module):
    """Every flag has help text and shows its default."""
    import importlib
    mod = importlib.import_module(module)
    parser = mod.build_parser()
    fmt = parser._get_formatter()
    for action in parser._actions:
        if action.dest == "help" or action.help == "==SUPPRESS==":
            continue
        text = fmt._get_help_string(action)
        assert action.help and "default" in text, (action.option_strings, action.help)
    assert "K3JAX_API_KEY" in parser.format_help() if module == "k3jax.serve" else True


@pytest.mark.parametrize("flag,value", [("--port", "99999"), ("--port", "x"), ("--max-n", "0"), ("--max-model-len", "0"),
                                        ("--max-num-seqs", "-1"), ("--compile-threads", "0"), ("--shutdown-timeout", "-1"),
                                        ("--cache-memory-mb", "-5"), ("--max-prompts-per-request", "0"),
                                        ("--stream-send-timeout", "-1"), ("--stream-send-timeout", "nan")])
def test_serve_refuses_bad_numbers_in_one_line(flag, value, capsys):
    """--port 99999 loaded and warmed the model, then served nowhere; --max-n 0, --max-model-len -3 and
    --shutdown-timeout -1 started a server that refused or mishandled every request."""
    from k3jax import serve
    with pytest.raises(SystemExit) as e:
        serve.parse_args([flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and flag in err and "Traceback" not in err


def test_engine_settings_are_refused_before_the_model_loads(monkeypatch):
    from k3jax import api, serve
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model loaded before the settings were checked"))
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        serve.build_state(serve.parse_args(["--max-num-seqs", "600", "--max-num-batched-tokens", "512"]))
    from serving.engine_args import EngineArgs
    for bad in ({"max_model_len": 1}, {"compile_threads": 0}, {"cache_memory_bytes": -5 << 20}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineArgs(**bad)


def test_default_tiny_is_the_trained_model_or_says_why_not(monkeypatch, caplog, tmp_path):
    """`tiny` loads the shipped weights (k3jax/assets/tiny-trained.safetensors) with its English
    tokenizer; without the file it warns that its weights are random, and still loads."""
    from k3jax import api
    from k3jax.checkpoint.flat_file import save_flat
    monkeypatch.setattr(api, "TINY_WEIGHTS", str(tmp_path / "absent.safetensors"))
    with caplog.at_level("WARNING"):
        m = k3jax.load_model("tiny")
    assert "RANDOM weights" in caplog.text
    tok = m.tokenizer
    assert m.config.vocab_size == tok.vocab_size == 4096 and m.vision is None
    assert (tok.bos_id, tok.eos_id) == (3840, 3841) == (m.config.bos_token_id, m.config.eos_token_id)
    text = "Each application defines its models in a module, and the database stores their fields."
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) < len(k3jax.load_model(
        "tiny-random").tokenizer.encode(text)) / 1.5            # an English vocabulary: far fewer tokens
    from k3jax.layer_stack import unstack_layers
    per_layer = unstack_layers(m.params, m.config)          # the file keeps the checkpoint's layer list
    params = jax_tree_map(lambda x: x + 0 if x.dtype.kind == "u" else x * 0 + 0.5, per_layer)
    save_flat(tmp_path / "w.safetensors", params)
    monkeypatch.setattr(api, "TINY_WEIGHTS", str(tmp_path / "w.safetensors"))
    loaded = k3jax.load_model("tiny")
    assert float(unstack_layers(loaded.params, loaded.config)["layers"][0]["attn"]["q_proj"][0, 0]) == 0.5


def jax_tree_map(fn, tree):
    import jax
    return jax.tree_util.tree_map(fn, tree)


def test_batch_defaults_follow_the_platform(monkeypatch):
    """Unset max_num_seqs / max_num_batched_tokens take the platform's defaults (CPU: 16 / 512; an
    accelerator: 64 / 4096, the settings the H200 targets were measured at); one given value bounds the other."""
    from k3jax import serve
    from serving import engine_args
    from serving.engine_args import EngineArgs
    a = EngineArgs()
    assert (a.max_num_seqs, a.max_num_batched_tokens) == engine_args.CPU_BATCH_DEFAULTS == (16, 512)
    assert serve.parse_args([]).max_num_seqs is None              # the server leaves it to EngineArgs
    monkeypatch.setattr(engine_args, "batch_defaults", lambda on_cpu=None: engine_args.ACCELERATOR_BATCH_DEFAULTS)
    a = EngineArgs()
    assert (a.max_num_seqs, a.max_num_batched_tokens) == (64, 4096)
    assert (EngineArgs(max_num_batched_tokens=32).max_num_seqs, EngineArgs(max_num_seqs=8000).max_num_batched_tokens) \
        == (32, 8000)
    assert EngineArgs(max_num_seqs=8).max_num_batched_tokens == 4096
