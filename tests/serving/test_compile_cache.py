"""A restart with the persistent compilation cache loads every warm-up executable from the cache
(also when something compiled before the engine set the cache directory: jax sets its cache up at
the first store that has a directory)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = r"""
import json, sys, time
import jax
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
from k3jax.api import load_model
from serving.engine import LLMEngine
from serving.engine_args import EngineArgs
m = load_model("tiny-random")
# Something compiles, slowly enough to be stored, before the engine sets the cache directory.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: x + 1)(1)
t0 = time.perf_counter()
eng = LLMEngine(m, EngineArgs(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                              compilation_cache_dir=sys.argv[1]))
print(json.dumps({"warmup_s": time.perf_counter() - t0, "hits": len(hits),
                  "shapes": eng.runner.num_compiles}))
"""


def _start(cache_dir):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _CHILD, cache_dir], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_restart_compiles_from_the_cache(tmp_path):
    cold = _start(str(tmp_path))
    assert cold["hits"] == 0 and os.listdir(tmp_path)             # executables were written
    warm = _start(str(tmp_path))
    assert warm["shapes"] == cold["shapes"] >= 2
    assert warm["hits"] >= warm["shapes"]                          # every step shape came from the cache
    assert warm["warmup_s"] < cold["warmup_s"], (cold, warm)


def test_step_compiler_options_apply_on_gpu_only_and_yield_to_xla_flags(monkeypatch):
    """The step's GPU options (CUDA graphs around the layer loop, no HLO rematerialization) are asked for
    on a GPU only, and a flag the user set in XLA_FLAGS is left to the user."""
    import jax
    from serving import step_shapes as runner
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert runner.step_compiler_options() == {}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert runner.step_compiler_options() == runner.GPU_STEP_OPTIONS
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer= --xla_force_host_platform_device_count=8")
    got = runner.step_compiler_options()
    assert "xla_gpu_enable_command_buffer" not in got
    assert got["xla_gpu_memory_limit_slop_factor"] == runner.GPU_STEP_OPTIONS["xla_gpu_memory_limit_slop_factor"]
