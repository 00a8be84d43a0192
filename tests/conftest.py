import os

import pytest

# Tests run on CPU with exact fp32 matmuls; several fake devices for the sharding tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The tiny model's `python -m k3jax.serve` (tests/server_fixture.py) shared by the server test modules;
    --max-waiting / --max-n small enough that a test can fill the queue with one request's n choices."""
    from server_fixture import ServerProcess
    s = ServerProcess(str(tmp_path_factory.mktemp("srv")), "--max-image-mb", "0.5", "--max-waiting", "100",
                      "--max-n", "200")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai
    from server_fixture import API_KEY
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tok():
    from k3jax.tokenizer import KimiTokenizer
    return KimiTokenizer.tiny()
