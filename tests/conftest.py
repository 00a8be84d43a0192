import os

import pytest

# Tests run on CPU with exact fp32 matmuls; several fake devices for the sharding tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")


@pytest.fixture(scope="session")
def tok():
    from k3jax.tokenizer import KimiTokenizer
    return KimiTokenizer.tiny()
