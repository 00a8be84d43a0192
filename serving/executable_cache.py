"""Compiled step programs kept on disk, so a restarted server skips tracing and lowering too.

XLA's persistent compilation cache (serving.engine.enable_compilation_cache) saves the compile, but
its key is the lowered program: every restart still traces and lowers each step shape, which is most
of a warm restart of a large model (tens of seconds of Python for the scanned decoder's many
shapes). This cache stores each warm-up executable itself (jax's serialize_executable) under a key
made of everything the program depends on, so a restart with the same code, model, settings and
devices loads the executables directly:

- the product's own source (every .py file of k3jax, pallas_kernels, sharding, serving) and the
  jax / jaxlib versions,
- the devices (platform, kind, count), the XLA flags and the step's compiler options,
- what the caller names (config, backend, the step's shape key) and the argument tree: structure,
  shapes, dtypes and shardings of parameters, pools and batch.

An entry whose stored argument tree differs from the call's is refused and rebuilt (never run), and
any error reading, deserializing or writing an entry is logged once and falls back to compiling.

The programs it stores are compiled by `compile`: on CPU past XLA's persistent cache, because an XLA:CPU
executable read back from that cache serializes without its kernels (the entry loads, then fails at its first
run with "Function ... not found").
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile

import jax

log = logging.getLogger(__name__)

_PACKAGES = ("k3jax", "pallas_kernels", "sharding", "serving")
FORMAT = 1                      # bump when the entry layout changes


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 over the product's Python sources (paths and bytes), computed once per process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, pkg)):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def _leaf_signature(x) -> str:
    sharding = getattr(x, "sharding", None)
    return f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{sharding}"


def args_signature(args) -> str:
    """The argument tree as a compiled program sees it: structure, shapes, dtypes, shardings."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return f"{tree}|" + ";".join(_leaf_signature(x) for x in leaves)


class ExecutableCache:
    """Serialized executables in `directory`, one file per key."""

    def __init__(self, directory: str):
        self.directory = directory
        self.hits = self.misses = self.refused = 0
        self._broken = False

    def key(self, *parts) -> str:
        devices = jax.devices()
        h = hashlib.sha256()
        for part in (FORMAT, source_fingerprint(), jax.__version__, getattr(jax.lib, "__version__", ""),
                     jax.default_backend(), devices[0].device_kind, len(devices), os.environ.get("XLA_FLAGS", ""),
                     *parts):
            h.update(repr(part).encode())
            h.update(b"\0")
        return h.hexdigest()

    @staticmethod
    def compile(lowered):
        """lowered.compile() for a program this cache will store (see the module's docstring). The switch is
        thread-local: the warm-up's compile threads bypass XLA's cache for their own programs only."""
        if jax.default_backend() != "cpu":
            return lowered.compile()
        from jax._src import config as jax_config       # the thread-local form of jax_enable_compilation_cache
        with jax_config.enable_compilation_cache(False):
            return lowered.compile()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.exe")

    def load(self, key: str, args):
        """The executable stored under `key` for arguments shaped like `args`, or None."""
        path = self._path(key)
        if self._broken or not os.path.exists(path):
            self.misses += 1
            return None
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            if entry.get("args") != args_signature(args):
                self.refused += 1
                log.warning("executable cache: %s was stored for other arguments; rebuilding it", path)
                os.unlink(path)
                return None
            from jax.experimental.serialize_executable import deserialize_and_load
            by_id = {d.id: d for d in jax.devices()}
            exe = deserialize_and_load(entry["payload"], entry["in_tree"], entry["out_tree"],
                                       execution_devices=[by_id[i] for i in entry["devices"]])
        except Exception as e:      # noqa: BLE001  (a damaged or foreign entry: compile instead)
            self.refused += 1
            log.warning("executable cache: cannot load %s (%s: %s); compiling instead", path, type(e).__name__,
                        str(e).splitlines()[0][:200] if str(e) else "")
            return None
        self.hits += 1
        return exe

    def save(self, key: str, args, compiled) -> bool:
        """Store `compiled` (made for `args`) under `key`; False (logged once) where it cannot be."""
        if self._broken:
            return False
        try:
            from jax.experimental.serialize_executable import serialize
            payload, in_tree, out_tree = serialize(compiled)
            devices = [d.id for d in compiled.runtime_executable().local_devices()]   # the program's own devices
            entry = {"args": args_signature(args), "payload": payload, "in_tree": in_tree, "out_tree": out_tree,
                     "devices": devices}
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self._path(key))       # readers never see a half-written entry
            return True
        except Exception as e:      # noqa: BLE001  (a backend whose executables do not serialize)
            self._broken = True
            log.warning("executable cache: this backend's step programs cannot be stored (%s: %s); restarts "
                        "will trace and lower them again", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            return False
