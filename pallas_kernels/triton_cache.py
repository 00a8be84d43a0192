"""A cache of the Triton compiles that Pallas runs while *lowering* a pallas_call on GPU.

With jaxlib > 0.10.2, Pallas' Triton lowering compiles each kernel's Triton IR to PTX inside
`jit(...).lower()` (jax._src.lib.triton.compile), in Python, one kernel after another. XLA's persistent
compilation cache starts after lowering, so a restarted server redid every one of these compiles:
~3.5 s per engine step shape on the H200 (60 s of a 17-shape warm-up, cold or restarted). This wraps
the registered CUDA compilation handler with a memo (kernels repeat across step shapes) and, given a
directory, a disk cache keyed by the IR bytes, the target and the launch options.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading

log = logging.getLogger(__name__)

_PLATFORM = "CUDA"


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """What the lowering reads of jax's CompilationResult."""
    asm: str
    smem_bytes: int
    hsaco_path: str = ""


class CachingHandler:
    """A Triton compilation handler that remembers results in memory and, with `cache_dir`, on disk."""

    def __init__(self, handler, cache_dir: str | None, version: str = ""):
        self.handler, self.cache_dir, self.version = handler, cache_dir, version
        self.memo: dict[str, CompiledKernel] = {}
        self.lock = threading.Lock()
        self.hits = self.disk_hits = self.misses = 0

    def key(self, module: bytes, arch_name: str, num_warps: int, num_ctas: int, num_stages: int) -> str:
        h = hashlib.sha256(module)
        h.update(f"|{arch_name}|{num_warps}|{num_ctas}|{num_stages}|{self.version}".encode())
        return h.hexdigest()

    def __call__(self, module: bytes, arch_name: str, num_warps: int, num_ctas: int, num_stages: int):
        key = self.key(module, arch_name, num_warps, num_ctas, num_stages)
        with self.lock:
            hit = self.memo.get(key)
            if hit is not None:
                self.hits += 1
                return hit
        result = self._read(key)
        if result is None:
            raw = self.handler(module, arch_name, num_warps, num_ctas, num_stages)
            result = CompiledKernel(raw.asm, int(raw.smem_bytes), getattr(raw, "hsaco_path", "") or "")
            self._write(key, result)
            with self.lock:
                self.misses += 1
        else:
            with self.lock:
                self.disk_hits += 1
        with self.lock:
            self.memo[key] = result
        return result

    def _path(self, key: str) -> str | None:
        return os.path.join(self.cache_dir, key[:2], key + ".json") if self.cache_dir else None

    def _read(self, key: str) -> CompiledKernel | None:
        path = self._path(key)
        if path is None or not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                d = json.load(f)
            return CompiledKernel(d["asm"], int(d["smem_bytes"]))
        except (OSError, ValueError, KeyError, TypeError) as e:     # a torn or foreign file: compile again
            log.warning("Triton kernel cache entry %s unreadable (%s): compiling again", path, e)
            return None

    def _write(self, key: str, result: CompiledKernel) -> None:
        path = self._path(key)
        if path is None or result.hsaco_path or not isinstance(result.asm, str):
            return                  # ROCm's result is a file path, not text: memory only
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"asm": result.asm, "smem_bytes": result.smem_bytes}, f)
            os.replace(tmp, path)                                  # readers see a whole file or none
        except OSError as e:
            log.warning("Triton kernel cache not written (%s): %s", path, e)


def install(cache_dir: str | None) -> CachingHandler | None:
    """Wrap this process's CUDA Triton compilation handler (once; a second call only sets the
    directory). Returns the handler, or None where there is none to wrap (CPU, TPU, ROCm, a jax
    without the hook): nothing changes there."""
    try:
        import jax
        from jax._src.lib import triton
        jax.devices()                      # the CUDA plugin registers its handler when the backend starts
        handlers, lock = triton._compilation_handlers, triton._compilation_handlers_lock
    except (ImportError, AttributeError, RuntimeError):
        return None
    with lock:
        current = handlers.get(_PLATFORM)
        if current is None:
            return None
        if isinstance(current, CachingHandler):
            current.cache_dir = cache_dir or current.cache_dir
            return current
        import jaxlib
        wrapped = CachingHandler(current, cache_dir, version=getattr(jaxlib, "__version__", ""))
        handlers[_PLATFORM] = wrapped
    log.info("Triton kernels compiled at lowering are cached%s", f" in {cache_dir}" if cache_dir else " in memory")
    return wrapped
