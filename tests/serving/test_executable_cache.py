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
    cache = ExecutableCache(str(tmp_path))
    f = jax.jit(lambda x: x * 2)
    x4 = np.ones(4, np.float32)
    key = cache.key("double")
    assert cache.save(key, (x4,), cache.compile(f.lower(x4)))
    assert cache.load(key, (np.ones(5, np.float32),)) is None and cache.refused == 1
    assert not os.path.exists(tmp_path / f"{key}.exe")                 # dropped, to be rebuilt
    assert cache.save(key, (x4,), cache.compile(f.lower(x4)))
    assert cache.load(key, (x4,)) is not None and (cache.hits, cache.refused) == (1, 1)
    assert args_signature((x4,)) != args_signature((x4.astype(np.float64),))
    assert cache.key("double") != cache.key("triple")


# In a fresh process: XLA:CPU resolves a loaded executable's kernels by name, and in a worker that has run
# hundreds of other programs a loaded one has failed to find its own ("Function broadcast_multiply_fusion not
# found") even when stored whole; a server loads its executables at start, before running anything else.
STORED_WHOLE = """
import sys, numpy as np, jax, jax.numpy as jnp
from serving.executable_cache import ExecutableCache
jax.config.update("jax_compilation_cache_dir", sys.argv[1] + "/xla")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
make = lambda: jax.jit(lambda x: jnp.sin(x) * 3 + 1)     # a new jit each time: a new in-memory cache
x = np.linspace(0, 1, 6, dtype=np.float32)
want = np.asarray(make()(x))                              # compiled once: now in XLA's cache
cache = ExecutableCache(sys.argv[1] + "/exe")
key = cache.key("sin")
assert cache.save(key, (x,), cache.compile(make().lower(x)))
np.testing.assert_array_equal(np.asarray(cache.load(key, (x,))(jnp.asarray(x))), want)
print("ran")
"""


def test_a_program_in_xlas_cache_is_stored_whole(tmp_path):
    """A program XLA's persistent cache already holds (an earlier run compiled it) is stored so that it runs when
    loaded: on CPU the copy read back from XLA's cache serializes without its kernels, so the cache compiles it
    past XLA's cache ("Function ... not found" at the loaded program's first run otherwise)."""
    import subprocess
    import sys
    from tests.support import ROOT
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), XLA_FLAGS="")
    r = subprocess.run([sys.executable, "-c", STORED_WHOLE, str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ran", r.stderr[-3000:]
