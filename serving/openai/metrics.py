"""Prometheus metrics (k3jax: prefix) on a registry of the server's own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        lab = ["model_name"]
        self.ttft = Histogram("k3jax:time_to_first_token_seconds", "Time to first token", lab, buckets=_LAT, registry=r)
        self.itl = Histogram("k3jax:inter_token_latency_seconds", "Time between output tokens", lab, buckets=_LAT, registry=r)
        self.e2e = Histogram("k3jax:e2e_request_latency_seconds", "End-to-end request latency", lab, buckets=_LAT, registry=r)
        self.prompt_tokens = Counter("k3jax:prompt_tokens", "Prompt tokens processed", lab, registry=r)
        self.generation_tokens = Counter("k3jax:generation_tokens", "Tokens generated", lab, registry=r)
        self.requests = Counter("k3jax:requests", "Finished requests by finish reason", lab + ["finish_reason"], registry=r)
        self.running = Gauge("k3jax:num_requests_running", "Requests running", lab, registry=r)
        self.waiting = Gauge("k3jax:num_requests_waiting", "Requests waiting", lab, registry=r)
        self.page_usage = Gauge("k3jax:page_pool_usage", "Fraction of MLA pages held (in use or cached)", lab, registry=r)
        self.slot_usage = Gauge("k3jax:state_pool_usage", "Fraction of KDA state slots held (in use or cached)", lab,
                                registry=r)
        # Held is not full: cached blocks (prefix cache only) are evicted on demand; in_use ones are not.
        self.pages = Gauge("k3jax:cache_pages", "MLA cache pages by state: in_use (by requests), cached (evictable "
                           "prefix cache), free", lab + ["state"], registry=r)
        self.slots = Gauge("k3jax:cache_state_slots", "KDA state slots by state: in_use (by requests), cached "
                           "(evictable prefix-cache checkpoints), free", lab + ["state"], registry=r)
        self.prefix_queried = Gauge("k3jax:prefix_cache_queried_tokens", "Prompt tokens looked up", lab, registry=r)
        self.prefix_hit = Gauge("k3jax:prefix_cache_hit_tokens", "Prompt tokens served from the cache", lab, registry=r)
        self.prefix_rate = Gauge("k3jax:prefix_cache_hit_rate", "Hit tokens / queried tokens", lab, registry=r)
        self.preemptions = Gauge("k3jax:num_preemptions", "Preemptions so far", lab, registry=r)
        self.verify_checks = Counter("k3jax:prefix_cache_verify_checks", "Prefix-cache hits recomputed from scratch "
                                     "and compared (--verify-prefix-cache)", lab, registry=r)
        self.verify_mismatches = Counter("k3jax:prefix_cache_verify_mismatches", "Verified hits whose first token's "
                                         "log-probabilities differ from the recompute", lab, registry=r)
        self.http_closed = Counter("k3jax:http_connections_closed", "Connections the server closed to protect itself, "
                                   "by reason: header_timeout, body_timeout (the request did not arrive in time), "
                                   "over_limit (503 past --max-connections), evicted (an idle or slow connection "
                                   "closed to make room), refused (no room)", lab + ["reason"], registry=r)
        for reason in ("header_timeout", "body_timeout", "over_limit", "evicted", "refused"):
            self.http_closed.labels(model_name, reason)          # listed (at 0) before the first close
        self.http_open = Gauge("k3jax:http_connections_open", "Open HTTP connections", lab, registry=r)
        self.connections = None         # the server's set of open connections, once it runs
        self.spec_drafted = Counter("k3jax:spec_draft_tokens", "Speculative draft tokens verified (--speculative)",
                                    lab, registry=r)
        self.spec_accepted = Counter("k3jax:spec_accepted_tokens", "Speculative draft tokens accepted", lab,
                                     registry=r)
        self.spec_rate = Gauge("k3jax:spec_acceptance_rate", "Accepted / verified draft tokens so far", lab,
                               registry=r)
        self.compiles_pending = Gauge("k3jax:compiles_pending", "Step programs still compiling in the background "
                                      "after warm-up (steps pad to a compiled bucket until theirs lands)", lab,
                                      registry=r)
        self._counted = {}
        self.disagg = {k: Gauge(f"k3jax:{k}", h, lab, registry=r) for k, h in (
            ("disagg_remote_prefills", "Requests whose prompt the prefill peer computed (--role decode)"),
            ("disagg_local_prefills", "Requests prefilled here although a prefill peer is set"),
            ("disagg_peer_failures", "Prefill-peer calls that failed or timed out (the request went on locally)"),
            ("disagg_transfer_bytes", "Cache bytes pulled from the prefill peer"),
            ("disagg_transfer_ms", "Milliseconds spent pulling cache entries from the prefill peer"),
            ("disagg_remote_prefill_ms", "Milliseconds the prefill peer took to answer, as the decode server saw it"))}
        self.model = model_name

    def count_closed(self, reason: str) -> None:
        self.http_closed.labels(self.model, reason).inc()

    def render(self, stats: dict) -> bytes:
        m = self.model
        if self.connections is not None:
            self.http_open.labels(m).set(len(self.connections))
        self.running.labels(m).set(stats.get("num_running", 0))
        self.waiting.labels(m).set(stats.get("num_waiting", 0))
        self.page_usage.labels(m).set(stats.get("page_usage", 0.0))
        self.slot_usage.labels(m).set(stats.get("slot_usage", 0.0))
        q, h = stats.get("prefix_queried_tokens", 0), stats.get("prefix_hit_tokens", 0)
        self.prefix_queried.labels(m).set(q)
        self.prefix_hit.labels(m).set(h)
        self.prefix_rate.labels(m).set(h / q if q else 0.0)
        self.preemptions.labels(m).set(stats.get("num_preemptions", 0))
        self.compiles_pending.labels(m).set(stats.get("compiles_pending", 0))
        if "spec_acceptance_rate" in stats:
            self.spec_rate.labels(m).set(stats["spec_acceptance_rate"])
        for counter, key in ((self.verify_checks, "prefix_verify_checks"),
                             (self.verify_mismatches, "prefix_verify_mismatches"),
                             (self.spec_drafted, "spec_drafted_tokens"), (self.spec_accepted, "spec_accepted_tokens")):
            new = stats.get(key, 0) - self._counted.get(key, 0)     # the engine counts; a Counter only goes up
            if new > 0:
                counter.labels(m).inc(new)
                self._counted[key] = stats[key]
        for key, gauge in self.disagg.items():
            if key in stats:
                gauge.labels(m).set(stats[key])
        for state in ("in_use", "cached", "free"):
            self.pages.labels(m, state).set(stats.get(f"pages_{state}", 0))
            self.slots.labels(m, state).set(stats.get(f"slots_{state}", 0))
        return generate_latest(self.registry)
