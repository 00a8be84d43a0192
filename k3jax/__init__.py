"""k3jax: a JAX/XLA serving stack for Kimi K3 and the Kimi Linear family."""
import os as _os

# JAX preallocates 75% of an accelerator by default. The engine sizes its cache from what the allocator
# may hold, after the weights and the largest step's activations: let it hold 90% (vLLM's default
# utilization) unless the user chose otherwise. Takes effect if no JAX backend has started yet.
_os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")

from k3jax.config import ModelConfig  # noqa: E402

__all__ = ["ModelConfig", "load_model", "Model", "LLM", "SamplingParams"]


def __getattr__(name):
    # Lazy: importing k3jax must stay cheap (the API pulls in checkpoint and tokenizer code).
    if name in ("load_model", "Model"):
        from k3jax import api
        return getattr(api, name)
    if name in ("LLM", "SamplingParams"):
        from k3jax import offline
        return getattr(offline, name)
    raise AttributeError(name)
