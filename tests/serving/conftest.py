import pytest


@pytest.fixture(scope="session")
def server(tmp_path_factory, xla_cache_dir):
    """The tiny model's `python -m k3jax.serve` (tests/support/server_fixture.py) shared by the server test
    modules; --max-waiting / --max-n small enough that a test can fill the queue with one request's n choices."""
    from tests.support.server_fixture import ServerProcess
    s = ServerProcess(str(tmp_path_factory.mktemp("srv")), "--max-image-mb", "0.5", "--max-waiting", "100",
                      "--max-n", "200", compilation_cache_dir=xla_cache_dir)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai
    from tests.support.server_fixture import API_KEY
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
