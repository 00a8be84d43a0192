"""Multi-host runtime: JAX's multi-controller model (every process runs the same program).

Process 0 is the coordinator: it alone serves HTTP and schedules; each step it broadcasts the
host-side batch to all processes, which then all enter the same jitted step with the same
shapes. CPU processes talk through gloo (set here before the backend starts), which is what
the tests use over 127.0.0.1.

Environment fallbacks for `initialize()` (set by deploy/launch_*.sh):
  K3JAX_COORDINATOR=host:port  K3JAX_NUM_PROCESSES=N  K3JAX_PROCESS_ID=i
  K3JAX_DISTRIBUTED=auto       none of the above: let JAX auto-detect the cluster (TPU pods)
With nothing set, the program stays a single process. Serving's per-step broadcast to follower
processes lives in serving/multihost.py.
"""
from __future__ import annotations

import inspect
import os
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, local_device_ids=None, auto: bool | None = None, cpu_collectives: str | None = "gloo",
               timeout_s: int = 300, heartbeat_timeout_s: int | None = None,
               shutdown_timeout_s: int | None = None) -> bool:
    """Start the multi-process runtime; call before anything touches a JAX device.

    coordinator "host:port" of process 0; num_processes; process_id (0-based). Missing values
    come from K3JAX_* env vars; with none given, auto=True (or K3JAX_DISTRIBUTED=auto) lets JAX
    detect the cluster (TPU pods, SLURM), otherwise nothing happens (single process).
    cpu_collectives: "gloo" (CPU processes need it for cross-process collectives) or None to
    leave JAX's setting alone. heartbeat_timeout_s: seconds of silence after which JAX's
    coordination service aborts every process (None: JAX's default); shutdown_timeout_s: how long
    a clean exit waits for the others at JAX's shutdown barrier (None: JAX's default, 5 minutes).
    Returns whether the distributed runtime was started.
    """
    coordinator = coordinator or os.environ.get("K3JAX_COORDINATOR")
    if num_processes is None and os.environ.get("K3JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["K3JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("K3JAX_PROCESS_ID"):
        process_id = int(os.environ["K3JAX_PROCESS_ID"])
    if auto is None:
        auto = os.environ.get("K3JAX_DISTRIBUTED", "") == "auto"
    if num_processes == 1 or (coordinator is None and num_processes is None and process_id is None and not auto):
        return False
    if is_initialized():       # e.g. `python -m sharding.launch k3jax.serve`: the launcher already did it
        return True
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    kw = {}
    if local_device_ids is not None:
        kw["local_device_ids"] = local_device_ids
    accepted = inspect.signature(jax.distributed.initialize).parameters
    for name, value in (("heartbeat_timeout_seconds", heartbeat_timeout_s),
                        ("shutdown_timeout_seconds", shutdown_timeout_s)):
        if value is not None and name in accepted:
            kw[name] = int(value)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s, **kw)
    return True


def is_initialized() -> bool:
    """Whether jax.distributed is running in this process."""
    if hasattr(jax.distributed, "is_initialized"):
        return bool(jax.distributed.is_initialized())
    from jax._src import distributed as _d     # older JAX
    return _d.global_state.client is not None


def is_coordinator() -> bool:
    return jax.process_index() == 0


def broadcast_fixed(tree):
    """Process 0's value of a tree whose structure and shapes every process already knows."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.broadcast_one_to_all(tree, is_source=is_coordinator())


def _bucket(n: int) -> int:
    """Power-of-two byte buckets: few distinct shapes, so the broadcast compiles only a few times."""
    return max(1024, 1 << (n - 1).bit_length())


def broadcast_host_tree(tree=None):
    """Process 0's host pytree (any structure: a StepBatch of numpy arrays) on every process.

    Process 0 passes the tree; the others pass None (ignored). Two collectives: the pickled
    size, then the bytes padded to a power of two. The sender is the same program (trusted).
    """
    if jax.process_count() == 1:
        return tree
    if is_coordinator():
        blob = np.frombuffer(pickle.dumps(jax.device_get(tree), protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    else:
        blob = np.zeros(0, np.uint8)
    size = int(broadcast_fixed(np.array([blob.size], np.int32))[0])
    buf = np.zeros(_bucket(size), np.uint8)
    buf[:blob.size] = blob
    buf = np.asarray(broadcast_fixed(buf))
    return pickle.loads(buf[:size].tobytes())


def replicate(tree, mesh):
    """Host arrays -> global arrays replicated over the mesh (valid jit inputs in every process)."""
    sharding = NamedSharding(mesh, P())

    def one(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.tree_util.tree_map(one, tree)


def step_input(batch, mesh):
    """The per-step batch as every process must feed it: broadcast from process 0, replicated."""
    return replicate(broadcast_host_tree(batch if is_coordinator() else None), mesh)
