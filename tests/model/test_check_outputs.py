"""The tiny models' outputs are bit-identical to the committed fixture (tools/check_outputs.py):
a refactor of the model code must not change a single bit of the full forward's logits or of the
engine's greedy tokens and logprobs on CPU.

Compared exactly, not within a tolerance: a tolerance would not make the bf16 entries portable (a
different accumulation order moves bf16 logits by ~1e-3, far past any rtol that still means
"unchanged"). XLA:CPU compiles differently per CPU kind (vector width, cache blocking), so there is
one fixture per machine kind the developers and CI run on (tests/fixtures/outputs_tiny*.npz) and the
outputs must equal one of them. After an intended change of the numbers, re-record every kind's
fixture (`python tools/check_outputs.py --write tests/fixtures/outputs_tiny<kind>.npz` on each) and
say why in the commit; on a new machine kind, record its fixture from unchanged main.
"""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = sorted(str(p) for p in (ROOT / "tests" / "fixtures").glob("outputs_tiny*.npz"))


def _check(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "check_outputs.py"), "--check", *FIXTURES, *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "identical to" in r.stdout
    return r.stdout.split("identical to")[0].split("against ")[-1]


def test_tiny_random_fp32_is_bit_identical():
    out = _check("--preset", "tiny-random", "--dtype", "float32")
    # every entry of that part of the fixture was compared
    assert out.count("ok  ") == 4


@pytest.mark.slow
def test_every_tiny_model_and_dtype_is_bit_identical():
    assert _check().count("ok  ") == 16


def test_compare_reports_a_one_ulp_change():
    import importlib.util

    import numpy as np
    spec = importlib.util.spec_from_file_location("check_outputs", ROOT / "tools" / "check_outputs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ref = {"full/a/float32/last": np.linspace(-3, 3, 12, dtype=np.float32), "step/a/float32/ids": np.arange(4)}
    assert mod.compare(ref, {k: v.copy() for k, v in ref.items()}) == []
    got = {k: v.copy() for k, v in ref.items()}
    got["full/a/float32/last"][5] = np.nextafter(got["full/a/float32/last"][5], np.float32(10))
    assert [line.split(":")[0] for line in mod.compare(ref, got)] == ["full/a/float32/last"]
    assert mod.compare(ref, got, rtol=1e-6) == []                      # within a tolerance when asked
    got["step/a/float32/ids"][0] = 7
    assert len(mod.compare(ref, got, rtol=1e-6)) == 1                  # token ids always exact
