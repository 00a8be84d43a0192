"""Multi-host serving: process 0 leads, every other process follows.

JAX's multi-controller model needs every process to enter the same jitted functions, with the
same shapes, in the same order. Process 0 runs the HTTP server, the scheduler and the engine;
its ModelRunner makes every jitted call through one dispatch point (`ModelRunner._call`), which
runs inside `leading(control, args)`: in a multi-process run that first broadcasts the control
word and the host-side inputs to the other processes. Those run `follow(model)`: receive a
message, make the same call on their own ModelRunner (same params, same pools, same jit), repeat
until process 0 says "shutdown" (serving/follower.py).

Control words: "init" (the runner's constructor settings: followers build the same runner),
"step" (StepBatch, SamplingArrays, counters), "copy" (page-copy lists), "shutdown". Warm-up is
no separate word: it is the same "step" / "copy" calls with padding batches.

Wire format, two collectives per message (`broadcast_one_to_all` from process 0):
  1. header int32[4]: control, bytes of the pickled skeleton, bytes of array data, sequence no.
  2. payload uint8[power-of-two bucket]: the skeleton (the args pytree with every numpy array
     replaced by its shape / dtype / offset; other leaves kept as they are) and the arrays' raw
     bytes. Any pytree works, so new or optional StepBatch fields with per-step shapes travel as is.
"shutdown" sends the header only. The sender is the same program on a trusted cluster network.

Failures: serving/multihost_watch.py ends every process within seconds when one fails or goes
silent (process 0 names it); here the messages report progress to it, and process 0 waits for each
call's result inside `leading` so a message counts as finished only when it has run. A follower
whose collective fails (process 0 died) logs that and exits with status 1.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import pickle
import threading

import numpy as np

log = logging.getLogger(__name__)

CONTROLS = ("init", "step", "copy", "shutdown")
_CODE = {name: i + 1 for i, name in enumerate(CONTROLS)}
_NAME = {i + 1: name for i, name in enumerate(CONTROLS)}


@dataclasses.dataclass(frozen=True)
class _Arr:
    """Placeholder for one numpy array in a message skeleton."""
    shape: tuple
    dtype: np.dtype
    offset: int


def is_multiprocess() -> bool:
    import jax
    return jax.process_count() > 1


def is_leader() -> bool:
    """True on process 0 of a multi-process run (the process that serves and schedules)."""
    import jax
    return jax.process_count() > 1 and jax.process_index() == 0


def start(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
          mesh=None, heartbeat_timeout_s: float | None = None):
    """Start jax.distributed from the arguments or K3JAX_* env (no-op for one process, or when
    `sharding.launch` already did). Returns the mesh to load the model on: a multi-process run needs
    one spanning every process's devices, so None becomes the default layout ("").
    heartbeat_timeout_s: the fault watch's (multihost_watch); JAX's own heartbeat timeout is set 30 s
    above it, so the watch reports a lost process before JAX's runtime aborts, and a clean exit waits
    at most a minute at JAX's shutdown barrier."""
    from sharding import distributed
    kw = {} if heartbeat_timeout_s is None else {"heartbeat_timeout_s": int(heartbeat_timeout_s) + 30,
                                                 "shutdown_timeout_s": 60}
    distributed.initialize(coordinator, num_processes, process_id, **kw)
    if is_multiprocess() and mesh is None:
        import jax
        log.info("multi-host: no mesh given, using the default layout over all %d devices", jax.device_count())
        return ""
    return mesh


# ---------------------------------------------------------------------- encoding

def encode(tree) -> tuple[bytes, list[np.ndarray]]:
    """(pickled skeleton, arrays in payload order) for any pytree of numpy / jax arrays and Python values."""
    import jax
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays, placeholders, offset = [], [], 0
    for leaf in leaves:
        if isinstance(leaf, (np.ndarray, jax.Array)):
            a = np.ascontiguousarray(np.asarray(leaf))
            placeholders.append(_Arr(a.shape, a.dtype, offset))
            arrays.append(a)
            offset += a.nbytes
        else:
            placeholders.append(leaf)
    skeleton = pickle.dumps(jax.tree_util.tree_unflatten(treedef, placeholders), protocol=pickle.HIGHEST_PROTOCOL)
    return skeleton, arrays


def decode(skeleton: bytes, data: memoryview | bytes):
    import jax
    tree = pickle.loads(skeleton)

    def one(x):
        if not isinstance(x, _Arr):
            return x
        n = int(np.prod(x.shape, dtype=np.int64))
        return np.frombuffer(data, x.dtype, count=n, offset=x.offset).reshape(x.shape).copy()
    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, _Arr))


def _bucket(n: int) -> int:
    """Power-of-two payload sizes: few distinct shapes, so the broadcast compiles only a few times."""
    return max(1024, 1 << max(n - 1, 0).bit_length())


# ---------------------------------------------------------------------- transport

class Channel:
    """Process 0 -> all broadcast of (control, pytree) messages over JAX collectives."""

    def __init__(self):
        self.seq = 0

    def send(self, control: str, tree=None):
        from sharding.distributed import broadcast_fixed
        skeleton, arrays = (b"", []) if control == "shutdown" else encode(tree)
        data_bytes = sum(a.nbytes for a in arrays)
        total = len(skeleton) + data_bytes
        if total >= 2**31:
            raise ValueError(f"multi-host message of {total} bytes is too large (limit 2 GiB)")
        self.seq += 1
        broadcast_fixed(np.array([_CODE[control], len(skeleton), data_bytes, self.seq], np.int32))
        if control == "shutdown":
            return
        buf = np.zeros(_bucket(total), np.uint8)
        buf[:len(skeleton)] = np.frombuffer(skeleton, np.uint8)
        pos = len(skeleton)
        for a in arrays:
            buf[pos:pos + a.nbytes] = a.reshape(-1).view(np.uint8)
            pos += a.nbytes
        broadcast_fixed(buf)

    def receive(self):
        """(control, tree) as process 0 sent it (followers only)."""
        from sharding.distributed import broadcast_fixed
        code, nskel, ndata, seq = (int(v) for v in broadcast_fixed(np.zeros(4, np.int32)))
        if code not in _NAME:
            raise RuntimeError(f"multi-host: bad control word {code} (message {seq}): processes out of step")
        self.seq += 1
        if seq != self.seq:
            raise RuntimeError(f"multi-host: got message {seq}, expected {self.seq}: processes out of step")
        control = _NAME[code]
        if control == "shutdown":
            return control, None
        buf = np.asarray(broadcast_fixed(np.zeros(_bucket(nskel + ndata), np.uint8)))
        mv = memoryview(buf)
        return control, decode(bytes(mv[:nskel]), mv[nskel:nskel + ndata])


# ---------------------------------------------------------------------- process 0

_LOCK = threading.RLock()       # one message + its jitted call at a time (collectives must stay in order)
_channel: Channel | None = None
_closed = False


def _lead_channel() -> Channel:
    global _channel
    if _closed:
        raise RuntimeError("multi-host run already shut down: the follower processes have exited")
    if _channel is None:
        _channel = Channel()
        atexit.register(shutdown_followers)    # runs before jax.distributed's own atexit shutdown
    return _channel


@contextlib.contextmanager
def leading(control: str, args=()):
    """Wrap one jitted call on process 0: broadcast (control, args) first, then the body runs the call.

    Outside a multi-process run, and on followers, this does nothing. The lock keeps message and
    call together when another thread (shutdown) also talks to the followers.
    """
    if not is_leader():
        yield
        return
    from serving import multihost_watch
    watch = multihost_watch.current()
    with _LOCK:
        channel = _lead_channel()
        if watch:
            watch.message_started(channel.seq + 1)
        channel.send(control, args)
        yield
        if watch:
            watch.message_finished(channel.seq)


def settle(result):
    """Process 0 of a multi-process run waits for a call's result inside `leading`, so the fault
    watch knows when a message has really run. (This gives up async scheduling's overlap of host work
    with the device step in multi-process runs.)"""
    if is_leader():
        import jax
        jax.block_until_ready(result)
    return result


def announce_init(init):
    """ModelRunner.__init__ decorator: process 0 sends the runner's settings (all keyword
    arguments but the mesh and the backend, which every process has from its own model, plus the
    config to check against) so followers build the same runner."""
    @functools.wraps(init)
    def wrapped(self, config, params, **kw):
        if is_leader():
            with leading("init", {"config": config, "kwargs": {k: v for k, v in kw.items() if k not in ("mesh", "backend")}}):
                pass
        return init(self, config, params, **kw)
    return wrapped


def shutdown_followers(timeout: float = 30.0) -> bool:
    """Process 0: tell the followers to exit (once; also registered at exit). Returns whether it was sent."""
    global _closed
    if not is_leader() or _closed:
        return False
    if not _LOCK.acquire(timeout=timeout):
        log.warning("multi-host: the engine is still inside a step after %.0fs; followers not told to stop "
                    "(they end when this process does)", timeout)
        return False
    try:
        if _closed:
            return False
        try:
            (_channel or Channel()).send("shutdown")
            log.info("multi-host: told %d follower processes to exit", _num_processes() - 1)
        except Exception as e:  # noqa: BLE001 - a dead follower must not keep process 0 from exiting
            log.warning("multi-host: could not tell the followers to exit: %s", e)
            return False
        finally:
            _closed = True
        return True
    finally:
        _LOCK.release()


def _num_processes() -> int:
    import jax
    return jax.process_count()
