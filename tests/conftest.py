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


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
    """An XLA compilation cache shared by the whole run, both xdist workers included (their base temps are
    siblings): a program compiled once, by any process, is loaded by the next one that needs it (a tiny
    server's warm-up: ~55 s cold, ~9 s from a warm cache on 2 cores). JAX writes each entry under a key of
    the program, the backend and the compile options, so processes of different flags do not share entries; a
    reader that meets an entry still being written compiles instead (with a warning)."""
    base = tmp_path_factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xla-shared"
    d.mkdir(exist_ok=True)
    return str(d)
