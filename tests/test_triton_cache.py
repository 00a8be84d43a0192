"""pallas_kernels/triton_cache.py: the Triton compiles Pallas runs while lowering on GPU, remembered in
memory and on disk (a restarted server reads them back instead of compiling), with a fake CUDA handler."""
import os
import types

import pytest

from pallas_kernels import triton_cache


class FakeCompiler:
    def __init__(self):
        self.calls = []

    def __call__(self, module, arch_name, num_warps, num_ctas, num_stages):
        self.calls.append((module, arch_name, num_warps, num_stages))
        return types.SimpleNamespace(asm=f"// ptx of {module.decode()} w{num_warps} s{num_stages} sm{arch_name}",
                                     smem_bytes=len(module) * 1024, hsaco_path="")


@pytest.fixture
def fake_cuda(monkeypatch):
    from jax._src.lib import triton
    compiler = FakeCompiler()
    monkeypatch.setattr(triton, "_compilation_handlers", {"CUDA": compiler})
    return compiler


def test_memo_and_disk_cache_across_a_restart(fake_cuda, tmp_path):
    from jax._src.lib import triton
    h = triton_cache.install(str(tmp_path))
    assert triton._compilation_handlers["CUDA"] is h and triton_cache.install(str(tmp_path)) is h   # wrapped once
    a = triton.compile("cuda", b"kernel-a", "9.0", num_warps=4, num_ctas=1, num_stages=3)
    again = triton.compile("cuda", b"kernel-a", "9.0", num_warps=4, num_ctas=1, num_stages=3)
    other = triton.compile("cuda", b"kernel-a", "9.0", num_warps=8, num_ctas=1, num_stages=3)   # other options
    assert (a.asm, a.smem_bytes) == ("// ptx of kernel-a w4 s3 sm9.0", 8 * 1024) and again == a
    assert other.asm.endswith("w8 s3 sm9.0") and len(fake_cuda.calls) == 2 and (h.hits, h.misses) == (1, 2)
    # a new process: a fresh handler over the same directory compiles nothing it has seen
    restarted = triton_cache.CachingHandler(FakeCompiler(), str(tmp_path), version=h.version)
    assert restarted(b"kernel-a", "9.0", 4, 1, 3) == a and restarted(b"kernel-a", "9.0", 8, 1, 3) == other
    assert restarted.handler.calls == [] and restarted.disk_hits == 2
    # another jaxlib (its bundled Triton may compile differently) does not read those entries
    other_version = triton_cache.CachingHandler(FakeCompiler(), str(tmp_path), version="0.0.0-other")
    other_version(b"kernel-a", "9.0", 4, 1, 3)
    assert len(other_version.handler.calls) == 1


def test_a_torn_entry_is_compiled_again(fake_cuda, tmp_path, caplog):
    h = triton_cache.CachingHandler(fake_cuda, str(tmp_path))
    first = h(b"kernel-b", "9.0", 4, 1, 2)
    (entry,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    with open(entry, "w") as f:
        f.write('{"asm": "trunc')
    fresh = triton_cache.CachingHandler(fake_cuda, str(tmp_path))
    with caplog.at_level("WARNING"):
        assert fresh(b"kernel-b", "9.0", 4, 1, 2) == first
    assert len(fake_cuda.calls) == 2 and "unreadable" in caplog.text


def test_nothing_to_wrap_on_cpu(monkeypatch):
    from jax._src.lib import triton
    monkeypatch.setattr(triton, "_compilation_handlers", {})
    assert triton_cache.install("/nonexistent") is None and triton._compilation_handlers == {}
