"""Warm-up's compiled programs kept across restarts (serving/executable_cache.py): a second engine of the same
model and settings loads every program instead of tracing, lowering and compiling it, answers the same, and
an entry that is damaged or was stored for other arguments is refused and rebuilt, never run."""
import os

import numpy as np
import pytest
from k3jax.offline import LLM, SamplingParams
from serving.executable_cache import ExecutableCache, args_signature

SETTINGS = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, token_buckets=(16,), seq_buckets=(2,),
                executable_cache=True, dtype="float32")
PROMPT = [5, 6, 7, 8, 9]


def _engine(cache_dir):
    return LLM("tiny-random", compilation_cache_dir=str(cache_dir), **SETTINGS)


def _greedy(llm):
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids


@pytest.mark.slow      # three engines' warm-ups (~1 min of CPU); the cache's own checks run in the default suite
def test_restart_loads_every_program_answers_the_same_and_rebuilds_a_damaged_one(tmp_path):
    cold = _engine(tmp_path)
    tokens, stored = _greedy(cold), cold.engine.runner.executable_cache
    programs = len(cold.engine.runner._compiled)
    assert programs > 0 and stored.hits == 0 and stored.misses == programs
    exe_dir = tmp_path / "executables"
    entries = sorted(f for f in os.listdir(exe_dir) if f.endswith(".exe"))
    assert len(entries) == programs
    warm = _engine(tmp_path)                            # a restart: every program loaded, none compiled
    cache = warm.engine.runner.executable_cache
    assert (cache.hits, cache.misses, cache.refused) == (programs, 0, 0)
    assert _greedy(warm) == tokens
    (exe_dir / entries[0]).write_bytes(b"not a pickle")
    damaged = _engine(tmp_path)                         # that one program is compiled again and stored again
    cache = damaged.engine.runner.executable_cache
    assert (cache.hits, cache.refused) == (programs - 1, 1)
    assert _greedy(damaged) == tokens
    with open(exe_dir / entries[0], "rb") as f:
        assert f.read(1) != b"n"


def test_entry_for_other_arguments_is_refused(tmp_path):
    import jax
    import jax.numpy as jnp
    cache = ExecutableCache(str(tmp_path))
    f = jax.jit(lambda x: x * 2)
    x4 = np.ones(4, np.float32)
    key = cache.key("double")
    assert cache.save(key, (x4,), f.lower(x4).compile())
    assert cache.load(key, (np.ones(5, np.float32),)) is None and cache.refused == 1
    assert not os.path.exists(tmp_path / f"{key}.exe")                 # dropped, to be rebuilt
    assert cache.save(key, (x4,), f.lower(x4).compile())
    np.testing.assert_array_equal(cache.load(key, (x4,))(jnp.asarray(x4)), x4 * 2)
    assert args_signature((x4,)) != args_signature((x4.astype(np.float64),))
    assert cache.key("double") != cache.key("triple")
