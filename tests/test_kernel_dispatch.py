"""The model's call sites run the Pallas kernels (interpret mode on CPU) through the one dispatch
point and agree with the reference ops: KDA chunk (varlen, resumed states), paged MLA, fused
MXFP4 expert MLP."""
import numpy as np
import pytest

from pallas_kernels import ops
from kernel_steps import two_step_logits


@pytest.fixture
def restore_mode():
    yield
    ops.set_kernel_mode(None)


def test_step_with_pallas_kernels_matches_reference(restore_mode):
    out = {}
    for mode in ("reference", "pallas"):
        ops.set_kernel_mode(mode)
        assert ops.use_pallas() == ((True, True) if mode == "pallas" else (False, False))
        out[mode], decode_only = two_step_logits()
        assert decode_only == [False, True]          # the second step runs the fused decode op
    for ref, ker in zip(out["reference"], out["pallas"]):
        assert np.abs(ref - ker).max() / np.abs(ref).max() < 5e-4


def test_bad_kernel_mode_is_rejected(restore_mode, monkeypatch):
    with pytest.raises(ValueError, match="kernel mode"):
        ops.set_kernel_mode("fast")
    monkeypatch.setenv("K3JAX_KERNELS", "turbo")
    with pytest.raises(ValueError, match="K3JAX_KERNELS"):
        ops.kernel_mode()
