"""The tiny models' outputs are bit-identical to the committed fixture (tools/check_outputs.py):
a refactor of the model code must not change a single bit of the full forward's logits or of the
engine's greedy tokens and logprobs on CPU.

Compared exactly, not within a tolerance: the developers' machines and CI are one machine kind, so
the same program gives the same bits; and a tolerance would not make the bf16 entries portable
anyway (a different accumulation order moves bf16 logits by ~1e-3, far past any rtol that still
means "unchanged"). After an intended change of the numbers, re-record the fixture with
`python tools/check_outputs.py --write tests/fixtures/outputs_tiny.npz` and say why in the commit.
"""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "outputs_tiny.npz"


def _check(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "check_outputs.py"), "--check", str(FIXTURE), *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "identical" in r.stdout and "DIFF" not in r.stdout
    return r.stdout


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
