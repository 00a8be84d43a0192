import os

# Tests run on CPU with exact fp32 matmuls; several fake devices for the sharding tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")


# The longest test files first. xdist's loadfile scheduling hands files to the 2 workers in collection order:
# a long file collected last (alphabetically, test_vision_engine.py) ran alone at the end, one core idle for
# minutes. Durations from `pytest --durations` on the 2-core CI machine, longest first; others keep their order.
_LONGEST_FIRST = ("test_server.py", "test_engine.py", "test_vision_engine.py", "test_server_k3.py",
                  "test_multihost_serving.py", "test_notebooks.py", "test_cache_path.py", "test_compile_cache.py",
                  "test_disagg_serving.py", "test_layer_stack.py", "test_multiprocess.py", "test_sharding_model.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))
