"""One configuration surface: EngineArgs' fields (kernel and layout choices, the KV cache dtype) are what
LLM takes, what the CLIs' flags set (same names, same defaults, same choices), and what reaches the backend
and the runner; nothing is read from the environment and `import k3jax` changes nothing."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from k3jax import batch, eval as eval_cli, generate, serve
from serving import engine_args
from serving.engine_args import CHOICES, EngineArgs, field_default


@pytest.mark.parametrize("field", sorted(CHOICES))
def test_choice_fields_are_checked_in_one_place(field):
    for value in CHOICES[field]:
        assert getattr(EngineArgs(**{field: value}), field) == value
    with pytest.raises(ValueError, match=f"{field} 'nope': expected one of"):
        EngineArgs(**{field: "nope"})


@pytest.mark.parametrize("cli", [serve, generate, batch, eval_cli])
def test_every_cli_has_the_advanced_group_with_the_engines_choices(cli):
    parser = cli.build_parser()
    actions = {a.dest: a for a in parser._actions}
    for field in ("kernels", "mla_prefill", "mla_decode"):
        assert tuple(actions[field].choices) == CHOICES[field] and actions[field].default == field_default(field)
    assert actions["merged_experts"].default is field_default("merged_experts") is False
    if cli is not eval_cli:                   # an engine: its cache dtype and dense-weight reads too
        assert tuple(actions["kv_cache_dtype"].choices) == CHOICES["kv_cache_dtype"] == ("auto", "bfloat16", "fp8_e4m3")
        assert actions["dense_in_place"].default is field_default("dense_in_place") is True
    args = parser.parse_args((["-i", "x", "-o", "y"] if cli is batch else ["--data", "x"] if cli is eval_cli else [])
                             + ["--kernels", "reference", "--mla-prefill", "expanded", "--merged-experts"])
    kw = engine_args.advanced_kwargs(args)
    assert (kw["kernels"], kw["mla_prefill"], kw["mla_decode"], kw["merged_experts"]) == ("reference", "expanded",
                                                                                           "auto", True)


def test_serve_flags_default_to_the_engines_defaults():
    """serve, LLM and plan read one set of defaults (EngineArgs'): the queue bound, page size, memory fraction."""
    args = serve.parse_args([])
    for flag, field in (("max_waiting", "max_waiting"), ("page_size", "page_size"),
                        ("memory_fraction", "memory_fraction"), ("prefix_match_unit", "prefix_match_unit"),
                        ("state_block_size", "state_block_size"), ("prefix_wait_steps", "prefix_wait_steps")):
        assert getattr(args, flag) == field_default(field), flag
    assert (args.max_waiting, args.page_size, args.memory_fraction) == (4096, 16, 0.85)
    assert args.encoder_cache_mb << 20 == field_default("encoder_cache_bytes")
    assert not any(a.dest in ("enable_test_hooks",) for a in serve.build_parser()._actions)


def test_load_choices_reach_the_model_backend_and_layout():
    from k3jax import load_model
    from k3jax.expert_layout import experts_merged
    default = load_model("tiny-random")
    assert not default.backend.kernels and not experts_merged(default.params)        # CPU, auto: the references
    m = load_model("tiny-random", kernels="pallas", mla_prefill="expanded", mla_decode="mosaic", merged_experts=True)
    assert (m.backend.kernels, m.backend.interpret, m.backend.mla_prefill, m.backend.mla_decode) == \
        (True, True, "expanded", "mosaic")
    assert experts_merged(m.params)
    with pytest.raises(ValueError, match="kernels 'fast'"):
        load_model("tiny-random", kernels="fast")
    from k3jax import LLM
    with pytest.raises(ValueError, match="kernels: chosen when a model loads"):
        LLM(default, kernels="reference")


def test_dense_in_place_is_the_runners_setting():
    from k3jax.params import init_params_numpy
    from k3jax.presets import preset_config
    from pallas_kernels.backend import Backend
    from serving.runner import ModelRunner
    c = preset_config("tiny-random")
    params = init_params_numpy(c, 0, jnp.float32)
    gpu = Backend(kernels=True, interpret=True, platform="gpu")
    kw = dict(num_pages=9, num_slots=4, page_size=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
    assert ModelRunner(c, params, backend=gpu, **kw).backend.dense_in_place                       # the default
    assert not ModelRunner(c, params, backend=gpu, dense_in_place=False, **kw).backend.dense_in_place


def test_kv_cache_dtype():
    """auto: the pools take the weights' dtype; bfloat16 gives 16-bit pools; a cache dtype other than the
    weights' is refused (the layers read and write the pools in the activations' dtype) before an engine
    builds anything."""
    from k3jax import LLM, load_model
    assert EngineArgs().cache_dtype(jnp.float32) == jnp.float32
    assert EngineArgs(kv_cache_dtype="bfloat16").cache_dtype(jnp.bfloat16) == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype 'bfloat16' with float32 weights"):
        EngineArgs(kv_cache_dtype="bfloat16").cache_dtype(jnp.float32)
    kw = dict(warmup=False, max_model_len=64, cache_memory_bytes=4 << 20, max_num_seqs=2, max_num_batched_tokens=32,
              compilation_cache_dir=None)
    llm = LLM("tiny-random", kv_cache_dtype="bfloat16", **kw)
    assert llm.engine.runner.pools.mla_kv.dtype.itemsize == 2            # bf16 (stored as its bits on CPU)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(load_model("tiny-random", dtype="float32"), kv_cache_dtype="bfloat16", **kw)
    # fp8_e4m3 with any weights: packed FP8 MLA pages (uint32 rows of words), the KDA pools in the weights' dtype
    fp8 = LLM(load_model("tiny-random", dtype="float32"), kv_cache_dtype="fp8_e4m3", **kw).engine.runner.pools
    assert fp8.mla_kv.dtype == jnp.uint32 and fp8.kda_conv.dtype == jnp.float32


def test_import_has_no_side_effects_and_loading_claims_the_allocator(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    code = "import json, os; before = dict(os.environ); import k3jax; print(json.dumps([before, dict(os.environ)]))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    before, after = json.loads(out.stdout)
    assert before == after and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in after
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    from k3jax import load_model
    load_model("tiny-random")
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    engine_args.claim_device_memory()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"                 # the user's value wins


@pytest.mark.parametrize("fits", [True, False])
def test_long_prefill_tokens_never_costs_context(monkeypatch, fits):
    """Sized from device memory, the engine reserves a lone long prompt's step activations (the long bucket's) and
    keeps long_prefill_tokens only while the cache still holds max_model_len; otherwise it drops it (the regular
    buckets' activations, no long buckets). Device memory and the step's measurement are stand-ins here."""
    from k3jax import load_model
    from k3jax.cache import pool_bytes_per_page, pool_bytes_per_slot
    from serving import engine
    model = load_model("tiny-random", dtype="float32")
    c = model.config
    args = dict(max_num_seqs=2, max_num_batched_tokens=64, long_prefill_tokens=256, max_model_len=1024, warmup=False,
                compilation_cache_dir=None, memory_fraction=0.5)
    need = max(66 * pool_bytes_per_page(c, 16, jnp.float32), 8 * pool_bytes_per_slot(c, jnp.float32)) * 4 + 4096
    per_token = need // 100
    measured = []

    def step_temp_bytes(config, params, *, num_tokens, num_seqs, **kw):
        measured.append((num_tokens, num_seqs))
        return num_tokens * per_token
    free = need + (256 if fits else 64) * per_token      # the cache holds 1024 tokens after the long (regular) step
    monkeypatch.setattr(engine, "step_temp_bytes", step_temp_bytes)
    for mod in (engine, engine_args):
        monkeypatch.setattr(mod, "device_free_bytes", lambda weight_bytes: free)
    eng = engine.LLMEngine(model, EngineArgs(**args))
    assert eng.max_model_len == 1024
    if fits:
        assert measured == [(256, 2)] and eng.args.long_prefill_tokens == 256
        assert eng.runner.long_token_buckets == [128, 256] and eng.scheduler.cfg.long_prefill_tokens == 256
    else:
        assert measured == [(256, 2), (64, 2)] and eng.args.long_prefill_tokens == 0
        assert eng.runner.long_token_buckets == [] and eng.scheduler.cfg.long_prefill_tokens == 0
