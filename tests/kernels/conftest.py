import pytest


@pytest.fixture
def traced_as_gpu(monkeypatch):
    """The kernels' dispatch sees a GPU while the test traces (jax lowers for CUDA without one); jax's trace
    caches are cleared after, so that no later CPU call reuses a program traced for the GPU."""
    import jax
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    yield
    monkeypatch.undo()
    jax.clear_caches()
