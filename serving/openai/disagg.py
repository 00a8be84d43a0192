"""Disaggregated serving: `--role prefill` and `--role decode --prefill-peer HOST:PORT`.

Clients talk to the decode server. Before it admits a request, PrefillPeer asks the prefill
server (POST /internal/prefill, token ids only) to compute the prompt; the prefill server runs it
for one token, offers the prompt's prefix-cache entry on its transfer server and answers with the
entry's description (serving/kv_transfer.py); the decode server pulls the arrays over
jax.experimental.transfer, indexes them in its own cache and admits the request, which hits the
entry and computes only the last tokens of the prompt. A peer that fails, is slow (--prefill-timeout)
or answers nothing usable leaves the request to prefill locally: no request is lost. After a failure
the peer is skipped for a few seconds. Requests with images, and prompts the local cache already
covers, are always prefilled locally.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import urllib.request
from typing import Optional

from serving.kv_transfer import Transport, export_prefix, import_prefix
from serving.sampling_params import SamplingParams

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0


class PrefillService:
    """The prefill role's side: compute a prompt, offer its cache entry."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._n = 0

    async def prefill(self, engine, prompt_ids: list) -> dict:
        self._n += 1
        async for _ in engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=1),
                                       f"prefill-{self._n}"):
            pass
        res = await engine.call(lambda eng: export_prefix(eng, prompt_ids))
        if res is None:
            return {"num_tokens": 0}
        desc, flat = res
        return {**desc, "uuid": self.transport.offer(flat), "address": self.transport.address}


class PrefillPeer:
    """The decode role's side: have the peer prefill, pull the entry, index it locally."""

    def __init__(self, peer: str, transport: Transport, timeout_s: float = 30.0, api_key: Optional[str] = None):
        self.url = f"http://{peer}/internal/prefill"
        self.transport, self.timeout_s, self.api_key = transport, timeout_s, api_key
        self._skip_until = 0.0
        self.stats = collections.Counter()

    async def prefetch(self, engine, prompt_ids: list, has_images: bool = False) -> None:
        """Try to get prompt_ids' prefix from the peer into the engine's cache; any failure: nothing happens
        (the request prefills locally)."""
        if has_images or time.monotonic() < self._skip_until:
            self.stats["disagg_local_prefills"] += 1
            return
        loop = asyncio.get_running_loop()
        try:
            local, best = await engine.call(lambda eng: _local_hit(eng, prompt_ids))
            if local >= best:
                self.stats["disagg_local_prefills"] += 1
                return
            t0 = time.perf_counter()
            desc = await asyncio.wait_for(loop.run_in_executor(None, self._post, prompt_ids), self.timeout_s)
            if desc.get("num_tokens", 0) <= local:
                self.stats["disagg_local_prefills"] += 1
                return
            t1 = time.perf_counter()
            flat = await asyncio.wait_for(loop.run_in_executor(
                None, self.transport.fetch, desc["address"], desc["uuid"], desc), self.timeout_s)
            t2 = time.perf_counter()
            if not await engine.call(lambda eng: import_prefix(eng, prompt_ids, desc, flat)):
                raise RuntimeError("the peer's entry was not kept (another hash chain, or larger than the host tier)")
        except Exception as e:  # noqa: BLE001 - the request goes on locally
            self._skip_until = time.monotonic() + RETRY_AFTER_S
            self.stats["disagg_local_prefills"] += 1
            self.stats["disagg_peer_failures"] += 1
            log.warning("prefill peer %s: %s: %s; prefilling locally", self.url, type(e).__name__, e)
            return
        self.stats["disagg_remote_prefills"] += 1
        self.stats["disagg_transfer_bytes"] += desc["nbytes"]
        self.stats["disagg_remote_prefill_ms"] += 1000 * (t1 - t0)
        self.stats["disagg_transfer_ms"] += 1000 * (t2 - t1)

    def _post(self, prompt_ids: list) -> dict:
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, json.dumps({"prompt_token_ids": prompt_ids}).encode(), headers)
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read())


def _local_hit(engine, prompt_ids) -> tuple:
    """(tokens the local cache would serve, the most any cache entry could: a whole number of units that
    leaves a token to compute)."""
    cache = engine.scheduler.cache
    if cache is None or engine.scheduler.host is None:
        return 0, 0                     # nothing to import into: stay local
    return cache.lookup(prompt_ids, record=False).num_tokens, (len(prompt_ids) - 1) // cache.unit * cache.unit
