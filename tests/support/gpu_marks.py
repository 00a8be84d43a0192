"""The `gpu` tier's module mark: tests that need a GPU, skipped elsewhere (tests/conftest.py pins JAX to the
CPU unless JAX_PLATFORMS says otherwise: run them with JAX_PLATFORMS=cuda python -m pytest -m gpu -n 0)."""
import jax
import pytest


def on_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:        # no backend can start (a CUDA platform asked for on a machine without one)
        return False


GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not on_gpu(), reason="needs a GPU (JAX_PLATFORMS=cuda)")]
