"""Cache pools sized from device memory leave room for the largest step's activations (an OOM otherwise)."""
import jax
import pytest

from k3jax import load_model
from k3jax.cache import pool_bytes_per_page, pool_bytes_per_slot
from serving import engine as engine_mod
from serving import engine_args
from serving.engine import LLMEngine
from serving.engine_args import EngineArgs
from serving.step_shapes import step_temp_bytes


def test_pools_sized_after_the_largest_steps_activations(monkeypatch):
    model = load_model("tiny-random", dtype="bfloat16")
    c, dt = model.config, model.params["embed"].dtype
    w = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(model.params))
    free = 64 << 20
    monkeypatch.setattr(engine_args, "jax_device_stats", lambda: {"bytes_limit": w + free, "bytes_in_use": w})
    measured = []

    def spy(*a, **kw):
        measured.append((kw["num_tokens"], kw["num_seqs"], step_temp_bytes(*a, **kw)))
        return measured[-1][2]
    monkeypatch.setattr(engine_mod, "step_temp_bytes", spy)
    args = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256, warmup=False,
                compilation_cache_dir=None, seq_buckets=(4,), token_buckets=(16, 256), memory_fraction=0.5)
    pools = LLMEngine(model, EngineArgs(**args)).runner.pools
    [(tokens, seqs, temp)] = measured
    assert (tokens, seqs) == (256, 4)                       # the largest bucket
    small = step_temp_bytes(c, model.params, num_tokens=16, num_seqs=4, page_size=16, max_pages=16, cache_dtype=dt)
    assert 0 < small < temp                                 # a real measurement: it grows with the bucket
    budget = (free - temp) * 0.5
    assert pools.num_slots == int(budget * 0.5 // pool_bytes_per_slot(c, dt))
    assert pools.num_pages == int(budget * 0.5 // pool_bytes_per_page(c, 16, dt))
    # no room for the activations at all: a clear error naming what to lower
    monkeypatch.setattr(engine_mod, "step_temp_bytes", lambda *a, **kw: temp)
    monkeypatch.setattr(engine_args, "jax_device_stats", lambda: {"bytes_limit": w + temp // 2, "bytes_in_use": w})
    with pytest.raises(ValueError, match="activations.*max_num_batched_tokens"):
        LLMEngine(model, EngineArgs(**args))


def test_fp8_pages_fill_the_budget_at_their_own_width():
    """An FP8 MLA cache's pages are narrower: the same budget gives more of them (the KDA slots unchanged)."""
    import jax.numpy as jnp

    from k3jax.presets import preset_config
    from pallas_kernels.mla import fp8_cache
    c = preset_config("kimi-linear-48b-a3b")
    args = EngineArgs(cache_memory_bytes=8 << 30, max_model_len=4096)
    bf16 = engine_args.size_pools(args, c, 0, jnp.bfloat16)
    fp8 = engine_args.size_pools(args, c, 0, jnp.bfloat16, mla_dtype=fp8_cache.FP8)
    assert fp8[1] == bf16[1]
    half = (8 << 30) * (1 - args.state_fraction)
    assert bf16[0] == int(half // pool_bytes_per_page(c, 16, jnp.bfloat16))
    assert fp8[0] == int(half // pool_bytes_per_page(c, 16, fp8_cache.FP8))
    assert pool_bytes_per_page(c, 16, fp8_cache.FP8) == len(c.mla_layers) * 16 * 656
    assert fp8[0] > 1.7 * bf16[0]


def test_a_long_context_takes_its_pages_first_and_lowers_a_defaulted_max_num_seqs():
    """max_model_len past what the default split's pages hold: the pages take one such sequence first, the
    slots the rest, and a max_num_seqs left at its default drops to the slots there are (given: an error)."""
    import jax.numpy as jnp

    from k3jax.presets import preset_config
    c = preset_config("kimi-linear-48b-a3b")
    per_page, per_slot = pool_bytes_per_page(c, 16, jnp.bfloat16), pool_bytes_per_slot(c, jnp.bfloat16)
    need = 65536 // 16 + 1
    budget = need * per_page + 7 * per_slot + per_page // 2          # one 64k sequence and 7 slots
    assert budget * 0.5 // per_page < need                             # the default split falls short
    args = EngineArgs(cache_memory_bytes=budget, max_model_len=65536)
    assert args.max_num_seqs > 5
    pages, slots = engine_args.size_pools(args, c, 0, jnp.bfloat16)
    assert (pages, slots) == (need, 7)
    assert pages * per_page + slots * per_slot <= budget
    assert args.max_num_seqs == 5
    with pytest.raises(ValueError, match="need at least"):
        engine_args.size_pools(EngineArgs(cache_memory_bytes=budget, max_model_len=65536, max_num_seqs=8), c, 0,
                               jnp.bfloat16)
    # a context the default split holds: unchanged
    short = EngineArgs(cache_memory_bytes=budget, max_model_len=4096)
    assert engine_args.size_pools(short, c, 0, jnp.bfloat16) == (int(budget * 0.5 // per_page),
                                                                  int(budget * 0.5 // per_slot))


@pytest.mark.slow     # CI's time budget: the sizing itself is the test above
def test_engine_runs_with_max_num_seqs_lowered_for_a_long_context():
    model = load_model("tiny-random", dtype="float32")
    c, dt = model.config, model.params["embed"].dtype
    per_page, per_slot = pool_bytes_per_page(c, 16, dt), pool_bytes_per_slot(c, dt)
    need = 2048 // 16 + 1
    budget = need * per_page + 6 * per_slot
    eng = LLMEngine(model, EngineArgs(cache_memory_bytes=budget, max_model_len=2048, warmup=False,
                                      compilation_cache_dir=None))
    assert eng.args.max_num_seqs == 4 and list(eng.runner.seq_buckets) == [4]
    assert eng.runner.pools.num_pages >= need
    from serving.sampling_params import SamplingParams
    for i in range(6):                       # more requests than sequences: they wait their turn
        eng.add_request([1 + i, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
    done = set()
    while eng.has_unfinished():
        done |= {o.request_id for o in eng.step() if o.finished}
    assert len(done) == 6
