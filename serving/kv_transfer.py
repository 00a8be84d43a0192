"""Prefill/decode disaggregation: ship a prompt's prefix-cache entry between engines.

The unit shipped is a prefix-cache checkpoint (serving.prefix_cache.CacheEntry): the KDA recurrent +
conv state after N tokens and the MLA pages of [0, N), keyed by the prompt's chained unit hashes, so
the receiving side checks the chain against its own and indexes the data as its own cache entry
(either side's prefix cache reuses what it holds). Array bytes travel over JAX's transfer API
(`jax.experimental.transfer`: a transfer server on each side; the receiver pulls by a uuid the
sender offered); only the small JSON description below travels over the control channel (HTTP).

- prefill side: run the prompt (one token), then `export_prefix` reads the entry's arrays on the
  device and `Transport.offer`s them; the description names the uuid and the transfer address.
- decode side: `Transport.fetch` pulls the arrays onto its device, `import_prefix` hands them to the
  scheduler's host tier (serving/host_tier.py), which copies them into pages and a slot the next time
  the request is considered; the request then hits the entry and computes only its last tokens.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Optional

import jax

from serving.host_tier import HostEntry, read_entry

log = logging.getLogger(__name__)


def export_prefix(engine, prompt_ids, extra_keys=None) -> Optional[tuple]:
    """(description dict, flat array list) of the longest cached checkpoint that leaves at least one prompt token
    to compute, or None. Call from the engine's thread (the pools change every step)."""
    cache = engine.scheduler.cache
    if cache is None:
        return None
    unit, ps = cache.unit, cache.page_size
    hashes = cache.hashes(prompt_ids, extra_keys)
    ce = cache.unit_checkpoint(hashes, (len(prompt_ids) - 1) // unit)
    if ce is None:
        return None
    mla, state, conv, rows = read_entry(engine.runner.pools, ce)
    flat = list(mla) + list(state) + list(conv)
    desc = {"num_tokens": ce.num_tokens, "checkpoint_hash": ce.checkpoint_hash.hex(),
            "page_hashes": [h.hex() for h in ce.page_hashes], "num_rows": rows, "page_size": ps, "unit": unit,
            "layout": [len(mla), len(state)], "specs": [[list(x.shape), str(x.dtype)] for x in flat],
            "nbytes": int(sum(x.nbytes for x in flat))}
    return desc, flat


def import_prefix(engine, prompt_ids, desc: dict, flat, extra_keys=None) -> bool:
    """Index the arrays received for prompt_ids (see export_prefix) in this engine: checked against this side's own
    hash chain, then queued in the host tier for the scheduler to copy in. Returns False (nothing kept) when
    the description does not match this engine. Call from the engine's thread."""
    sched = engine.scheduler
    cache = sched.cache
    if cache is None or sched.host is None:
        return False
    n = int(desc["num_tokens"])
    if desc["page_size"] != cache.page_size or desc["unit"] != cache.unit or n % cache.unit or n >= len(prompt_ids):
        return False
    hashes = cache.hashes(prompt_ids[:n], extra_keys)
    k = n // cache.page_size
    if (hashes[-1].hex() != desc["checkpoint_hash"]
            or [hashes[(j + 1) * cache.upp - 1].hex() for j in range(k)] != desc["page_hashes"]):
        log.warning("prefix transfer: the peer's hash chain differs from ours (another model or namespace?)")
        return False
    rows, (n_mla, n_kda) = int(desc["num_rows"]), desc["layout"]
    if not _same_format(engine.runner.pools, desc["specs"], n_mla, n_kda):
        log.warning("prefix transfer: the peer's cache rows differ from ours (another kv_cache_dtype?)")
        return False
    entry = HostEntry(n, [hashes[(j + 1) * cache.upp - 1] for j in range(k)], [m[:rows] for m in flat[:n_mla]],
                      list(flat[n_mla:n_mla + n_kda]), list(flat[n_mla + n_kda:]))
    sched.host.put(hashes[-1], entry)
    return hashes[-1] in sched.host


def _same_format(pools, specs, n_mla: int, n_kda: int) -> bool:
    """The peer's arrays (export_prefix's specs: MLA pages per layer, then KDA state, then conv) have this
    engine's row shapes and dtypes: an FP8 cache's packed rows (pallas_kernels/mla/fp8_cache.py, scales inside)
    never land in a 16-bit pool or the other way round."""
    kinds = [pools.mla_kv] * n_mla + [pools.kda_state] * n_kda + [pools.kda_conv] * (len(specs) - n_mla - n_kda)
    for (shape, dtype), pool in zip(specs, kinds):
        tail = tuple(pool.shape[2:])                  # a pool is [pages | slots, layers, ...]
        if tuple(shape[len(shape) - len(tail):]) != tail or jax.numpy.dtype(dtype) != pool.dtype:
            return False
    return True


class Transport:
    """Array bytes over jax.experimental.transfer: one transfer server per process; the sender offers a pytree
    under a uuid (kept alive until pulled or `keep_s` seconds pass), the receiver pulls it onto its device."""

    def __init__(self, address: str = "127.0.0.1:0", keep_s: float = 60.0):
        from jax.experimental import transfer
        host = address.rsplit(":", 1)[0]
        self.server = transfer.start_transfer_server(jax.devices()[0].client, address, [f"{host}:0"])
        self.keep_s = keep_s
        self._offered: dict = {}               # uuid -> (deadline, arrays): alive until pulled
        self._conns: dict = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)

    @property
    def address(self) -> str:
        return self.server.address()

    def offer(self, arrays: list) -> int:
        uuid = next(self._ids)
        now = time.monotonic()
        with self._lock:
            for u in [u for u, (t, _) in self._offered.items() if t < now]:
                del self._offered[u]          # never pulled (the receiver gave up): let the arrays go
            self._offered[uuid] = (now + self.keep_s, arrays)
        self.server.await_pull(uuid, arrays)
        return uuid

    def fetch(self, address: str, uuid: int, desc: dict):
        """Pull the arrays `desc` describes (export_prefix's description) from the peer at `address`."""
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self.server.connect(address)
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        specs = [jax.ShapeDtypeStruct(tuple(s), jax.numpy.dtype(d), sharding=dev) for s, d in desc["specs"]]
        return conn.pull(uuid, specs)
