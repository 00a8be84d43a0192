"""--kv-cache-dtype fp8_e4m3 through the engine (tiny-random, CPU): the flag, the pool it makes and its sizing,
and the copies that must carry the scales with the pages (page copies, prefix cache, host tier, KV transfer)."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.engine_workloads import make_workload, run_one, run_workload
from k3jax import load_model
from k3jax.cache import make_pools, pool_bytes_per_page
from pallas_kernels.mla import fp8_cache
from serving.engine import LLMEngine
from serving.engine_args import EngineArgs
from serving.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random", dtype="float32")


def _engine(model, tmp_path_factory, **kw):
    args = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, page_size=16, prefix_match_unit=16,
                state_block_size=64, num_pages=200, num_slots=32, token_buckets=(32, 128), seq_buckets=(8,),
                compilation_cache_dir=str(tmp_path_factory.getbasetemp() / "xla"), vision=False, warmup=False,
                kv_cache_dtype="fp8_e4m3")
    args.update(kw)
    return LLMEngine(model, EngineArgs(**args))


def test_flag_values_and_one_line_errors():
    assert EngineArgs(kv_cache_dtype="fp8_e4m3").mla_cache_dtype(jnp.float32) == jnp.float8_e4m3fn
    assert EngineArgs(kv_cache_dtype="fp8_e4m3").cache_dtype(jnp.float32) == jnp.float32    # KDA pools as today
    assert EngineArgs().mla_cache_dtype(jnp.bfloat16) == jnp.bfloat16
    with pytest.raises(ValueError, match=r"^kv_cache_dtype 'fp9': expected one of \('auto', 'bfloat16', 'fp8_e4m3'\)$"):
        EngineArgs(kv_cache_dtype="fp9")
    # the CLI: one error line naming the flag, the bad value and the choices (after argparse's usage line)
    run = subprocess.run([sys.executable, "-m", "k3jax.serve", "--kv-cache-dtype", "fp9"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert errors == run.stderr.splitlines()[-1:] == [
        "python -m k3jax.serve: error: argument --kv-cache-dtype: invalid choice: 'fp9' "
        "(choose from 'auto', 'bfloat16', 'fp8_e4m3')"], run.stderr


def test_fp8_pool_shape_and_sizing():
    c = load_model("tiny-random", dtype="float32").config
    pools = make_pools(c, 4, 16, 3, jnp.float32, mla_dtype=jnp.float8_e4m3fn)
    assert pools.mla_kv.dtype == fp8_cache.STORAGE == jnp.uint32                   # packed rows of words
    assert pools.mla_kv.shape == (4, len(c.mla_layers), 16, fp8_cache.packed_width(c.kv_lora_rank, c.qk_rope_head_dim))
    assert pools.kda_conv.dtype == jnp.float32 and pools.kda_state.dtype == jnp.float32
    # K3's dims: 656 bytes (164 words) a token per layer against 1,152 in bf16
    from k3jax.presets import preset_config
    k3 = preset_config("kimi-k3")
    n = len(k3.mla_layers) * 64
    assert pool_bytes_per_page(k3, 64, jnp.float8_e4m3fn) == n * 656
    assert pool_bytes_per_page(k3, 64, jnp.bfloat16) == n * 1152
    # the memory plan counts the smaller pages: more sequences of a context fit the same budget
    from k3jax.plan import plan
    kw = dict(device=None, memory_gib=0.25, context=4096, step_tokens=256, dtype=jnp.bfloat16)
    auto, fp8 = (plan(c, "data=1", kv_cache_dtype=d, **kw) for d in ("auto", "fp8_e4m3"))
    # bytes a row at L 64, R 16: 100 against 160
    assert fp8["per_sequence_bytes"]["mla"] * 160 == auto["per_sequence_bytes"]["mla"] * 100
    assert fp8["max_batch_at_context"] > auto["max_batch_at_context"] > 0


def test_page_copy_and_kv_transfer_format_carry_the_scales(model, tmp_path_factory):
    from serving.kv_transfer import _same_format
    from serving.runner import _copy_pages
    c = model.config
    pools = make_pools(c, 6, 16, 3, jnp.float32, mla_dtype=jnp.float8_e4m3fn)
    rows = jax.random.normal(jax.random.key(0), pools.mla_kv.shape[:3] + (c.mla_cache_dim,))
    pools = pools.replace(mla_kv=fp8_cache.quantize(rows, c.kv_lora_rank))
    copied = _copy_pages(pools, jnp.asarray([2, 3], jnp.int32), jnp.asarray([5, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(copied.mla_kv[5]), np.asarray(pools.mla_kv[2]))   # codes, scales, rope
    np.testing.assert_array_equal(np.asarray(copied.mla_kv[1]), np.asarray(pools.mla_kv[3]))
    np.testing.assert_array_equal(np.asarray(fp8_cache.dequantize(copied.mla_kv[5], c.kv_lora_rank, jnp.float32)),
                                  np.asarray(fp8_cache.round_trip(rows[2], c.kv_lora_rank)))
    # a KV transfer between engines with different cache formats is refused, not reinterpreted
    nm, nk = len(c.mla_layers), len(c.kda_layers)
    spec = lambda p, lead: [list(lead) + list(p.shape[2:]), str(p.dtype)]  # noqa: E731
    specs = [spec(pools.mla_kv, (2,))] * nm + [spec(pools.kda_state, ())] * nk + [spec(pools.kda_conv, ())] * nk
    assert _same_format(pools, specs, nm, nk)
    bf16 = make_pools(c, 6, 16, 3, jnp.float32)
    assert not _same_format(bf16, specs, nm, nk)


def _recording_copies(engine):
    copies = []
    real_copy = engine.runner.copy_pages
    engine.runner.copy_pages = lambda cp: (copies.extend(cp), real_copy(cp))[1]
    return copies


def test_prefix_hit_mid_page_copies_the_packed_rows(model, tmp_path_factory, caplog):
    """A prefix hit that ends inside a page copies that page (copy-on-write) with its scales: the hit request
    reads the same quantized rows its first run wrote, so its greedy output is the same. The start-up log
    names the cache dtype."""
    caplog.set_level("INFO", logger="serving.engine_args")
    eng = _engine(model, tmp_path_factory, page_size=32, state_block_size=48, token_buckets=(64,), seq_buckets=(2,),
                  max_num_seqs=2, max_num_batched_tokens=64)
    copies = _recording_copies(eng)
    prompt = np.random.RandomState(3).randint(0, 768, 60).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = run_one(eng, prompt, params, "a")
    second = run_one(eng, prompt, params, "b")
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48          # ends inside page 2
    assert copies, "the hit's partial page must be copied"
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert any("MLA cache fp8_e4m3" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.slow
def test_prefix_cache_on_off_identical_with_fp8_pages(model, tmp_path_factory):
    """Outputs with the prefix cache equal those without it over a mixed workload (both read the same quantized
    rows; hits and copy-on-write copies move them as bytes)."""
    work = make_workload(5, 24, model.config.vocab_size, max_prefix=60)
    on = _engine(model, tmp_path_factory)
    copies = _recording_copies(on)
    off = _engine(model, tmp_path_factory, enable_prefix_caching=False)
    res_on, res_off = run_workload(on, work), run_workload(off, work)
    assert {k: v[0] for k, v in res_on.items()} == {k: v[0] for k, v in res_off.items()}
    assert sum(v[1] for v in res_on.values()) > 100 and copies


@pytest.mark.slow
def test_host_tier_restores_fp8_pages(model, tmp_path_factory):
    rng = np.random.RandomState(13)
    base = rng.randint(0, 1024, 150).tolist()
    others = [rng.randint(0, 1024, 150).tolist() for _ in range(5)]
    follow = base + rng.randint(0, 1024, 20).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=3)
    res = {}
    for host_bytes in (64 << 20, 0):
        eng = _engine(model, tmp_path_factory, num_pages=40, num_slots=12, state_block_size=0,
                      host_cache_bytes=host_bytes)
        for i, p in enumerate([base] + others):
            run_one(eng, p, params, f"p{i}")
        out = run_one(eng, follow, params, "f")
        res[host_bytes] = (out.outputs[0].token_ids, out.num_cached_tokens, eng.stats())
    (on, hit_on, st), (off, hit_off, _) = res[64 << 20], res[0]
    assert on == off and hit_off == 0
    assert hit_on == 144 and st["host_restored"] >= 1, st
