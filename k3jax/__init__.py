"""k3jax: a JAX/XLA serving stack for Kimi K3 and the Kimi Linear family.

Importing it has no side effects: the process-wide setting a server needs (JAX's allocator share of the
device) is made where a model is loaded (serving.engine_args.claim_device_memory)."""
from k3jax.config import ModelConfig

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
