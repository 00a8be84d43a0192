"""Engine arguments: one validated dataclass, and pool sizing from a memory budget."""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

log = logging.getLogger(__name__)


# (max_num_seqs, max_num_batched_tokens) when unset: an accelerator's step is weight-bandwidth bound
# up to ~64 rows and a 4096-token prefill step runs near the matmul rate (docs/benchmarks.md, H200);
# on CPU, step time grows with every row, so small steps keep latency and compile time down.
CPU_BATCH_DEFAULTS = (16, 512)
SPECULATIVE = ("off", "ngram", "draft")
ACCELERATOR_BATCH_DEFAULTS = (64, 4096)


def batch_defaults(on_cpu: bool | None = None) -> tuple[int, int]:
    if on_cpu is None:
        import jax
        on_cpu = jax.default_backend() == "cpu"
    return CPU_BATCH_DEFAULTS if on_cpu else ACCELERATOR_BATCH_DEFAULTS


@dataclasses.dataclass
class EngineArgs:
    max_num_seqs: Optional[int] = None            # default: 16 on CPU, 64 on an accelerator (batch_defaults)
    max_num_batched_tokens: Optional[int] = None  # default: 512 on CPU, 4096 on an accelerator
    max_model_len: Optional[int] = None           # default: min(model context, 8192)
    page_size: int = 16
    prefix_match_unit: int = 16
    state_block_size: int = 1024                  # periodic KDA checkpoints in long prompts (0 = off)
    enable_prefix_caching: bool = True
    cache_finished_state: bool = True             # a finished request's final state stays cached (follow-up turns
                                                  # resume at its end; one KDA slot each until evicted)
    prefix_wait_steps: int = 64                   # a waiting request whose prefix a running prefill is computing waits
                                                  # for its checkpoint up to this many steps (0 = admit at once)
    verify_prefix_cache: float = 0.0              # recompute this fraction of prefix-cache hits from scratch and
                                                  # compare the first token's log-probabilities (0 = off)
    verify_prefix_cache_tolerance: float = 0.25   # largest |log-prob difference| counted as equal (bf16 chunking noise)
    host_cache_bytes: int = 0                     # host-memory tier for evicted checkpoints and their pages (0 = off)
    memory_fraction: float = 0.85                 # of device memory left after the weights
    cache_memory_bytes: Optional[int] = None      # explicit cache budget (CPU default: 256 MiB)
    state_fraction: float = 0.5                   # share of the cache budget for KDA state slots
    num_pages: Optional[int] = None               # explicit pool sizes override the budget
    num_slots: Optional[int] = None
    max_waiting: int = 4096
    max_logprobs: int = 20
    seed: int = 0
    warmup: bool = True
    compile_threads: Optional[int] = None         # warm-up's step shapes compiled on this many host threads (None: half the cores, up to 8)
    forbid_compile_after_warmup: bool = False
    async_scheduling: bool = True                 # schedule and dispatch the next step while one runs on the device
    compilation_cache_dir: Optional[str] = os.path.join(os.path.expanduser("~"), ".cache", "k3jax", "xla")
    token_buckets: Optional[tuple] = None
    scan_layers: bool = True                      # the repeating layers as one scanned block (False: every
                                                  # layer traced, a debug path holding a second weight copy)
    seq_buckets: Optional[tuple] = None
    vision: bool = True                           # accept images when the model has a tower (False: text only,
                                                  # no tower warm-up or encoder cache)
    encoder_budget: Optional[int] = None          # image tokens encoded per step (default: max_num_batched_tokens)
    encoder_cache_bytes: int = 256 << 20          # encoder-output cache (image digest -> embeddings)
    speculative: str = "off"                      # speculative decoding: "off", "ngram" (prompt lookup) or "draft"
    num_speculative_tokens: int = 4               # drafts verified per sequence and step (the most; adaptive lowers it)
    draft_model: Optional[str] = None             # speculative="draft": preset name or checkpoint directory
    speculative_adaptive: bool = True             # shrink or pause speculation for sequences whose drafts are rejected
    speculative_max_batch: int = 32               # no speculation in steps with more decoding sequences than this

    def __post_init__(self):
        if self.max_num_seqs is None or self.max_num_batched_tokens is None:
            seqs, tokens = batch_defaults()
            given_tokens, given_seqs = self.max_num_batched_tokens, self.max_num_seqs
            if given_seqs is None:          # a smaller token budget given: as many sequences as tokens
                self.max_num_seqs = min(seqs, given_tokens) if isinstance(given_tokens, int) else seqs
            if given_tokens is None:        # more sequences given: a token for each
                self.max_num_batched_tokens = max(tokens, given_seqs) if isinstance(given_seqs, int) else tokens
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "prefix_match_unit", "max_waiting"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        for name, low in (("max_model_len", 2), ("compile_threads", 1), ("cache_memory_bytes", 1)):
            value = getattr(self, name)   # None: the default
            if value is not None and (not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be an int >= {low} (or unset), got {value!r}")
        if self.page_size % self.prefix_match_unit:
            raise ValueError(f"page_size ({self.page_size}) must be a multiple of prefix_match_unit ({self.prefix_match_unit})")
        if self.state_block_size < 0 or self.state_block_size % self.prefix_match_unit:
            raise ValueError(f"state_block_size ({self.state_block_size}) must be a non-negative multiple of "
                             f"prefix_match_unit ({self.prefix_match_unit})")
        if not isinstance(self.prefix_wait_steps, int) or self.prefix_wait_steps < 0:
            raise ValueError(f"prefix_wait_steps must be a non-negative int, got {self.prefix_wait_steps!r}")
        if not 0 <= self.verify_prefix_cache <= 1:
            raise ValueError(f"verify_prefix_cache must be a fraction in [0, 1], got {self.verify_prefix_cache!r}")
        if self.verify_prefix_cache and self.max_logprobs < 1:
            raise ValueError("verify_prefix_cache compares top log-probabilities: max_logprobs must be >= 1")
        if not self.verify_prefix_cache_tolerance >= 0:
            raise ValueError(f"verify_prefix_cache_tolerance must be >= 0, got {self.verify_prefix_cache_tolerance!r}")
        if not isinstance(self.host_cache_bytes, int) or self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be a non-negative int, got {self.host_cache_bytes!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not 0 < self.state_fraction < 1:
            raise ValueError(f"state_fraction must be in (0, 1), got {self.state_fraction}")
        if self.encoder_budget is not None and self.encoder_budget < 1:
            raise ValueError(f"encoder_budget must be a positive int, got {self.encoder_budget!r}")
        if self.encoder_cache_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be >= 0, got {self.encoder_cache_bytes!r}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive int, got {self.num_speculative_tokens!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("speculative='draft' needs draft_model (a preset name or checkpoint directory)")
        if self.speculative != "draft" and self.draft_model:
            raise ValueError(f"draft_model is only used with speculative='draft' (got speculative={self.speculative!r})")
        if not isinstance(self.speculative_max_batch, int) or self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be a positive int, got {self.speculative_max_batch!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every sequence needs a token)")


def device_free_bytes(weight_bytes: int) -> Optional[int]:
    try:
        stats = jax_device_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", weight_bytes)


def jax_device_stats():
    import jax
    return jax.devices()[0].memory_stats()


def size_pools(args: EngineArgs, config, weight_bytes: int, cache_dtype, activation_bytes: int = 0) -> tuple[int, int]:
    """(num_pages, num_slots) from explicit sizes or the memory budget; both include reserved id 0.
    activation_bytes: the largest step's scratch memory, kept free of the cache (measured by the engine)."""
    from k3jax.cache import pool_bytes_per_page, pool_bytes_per_slot
    per_page = max(pool_bytes_per_page(config, args.page_size, cache_dtype), 1)
    per_slot = max(pool_bytes_per_slot(config, cache_dtype), 1)
    budget = args.cache_memory_bytes
    if budget is None:
        free = device_free_bytes(weight_bytes)
        if free is not None and free - activation_bytes <= 0:
            raise ValueError(f"the largest step needs {activation_bytes / 2**30:.2f} GiB of activations but only "
                             f"{free / 2**30:.2f} GiB of device memory is free after the weights: lower "
                             f"max_num_batched_tokens / max_num_seqs")
        budget = int((free - activation_bytes) * args.memory_fraction) if free else 256 << 20
        if free:
            log.info("device memory: %.2f GiB free after the weights, %.2f GiB kept for the largest step's "
                     "activations, cache budget %.2f GiB (memory_fraction %.2f)", free / 2**30,
                     activation_bytes / 2**30, budget / 2**30, args.memory_fraction)
    slots = args.num_slots or int(budget * args.state_fraction // per_slot)
    pages = args.num_pages or int(budget * (1 - args.state_fraction) // per_page)
    min_slots = args.max_num_seqs + 2            # every running sequence plus garbage and one checkpoint
    max_len = args.max_model_len or 0
    min_pages = -(-max_len // args.page_size) + 1
    if slots < min_slots or pages < min_pages:
        raise ValueError(f"cache budget {budget / 2**20:.0f} MiB gives {pages} pages / {slots} slots; need at least "
                         f"{min_pages} pages (one max-length sequence) and {min_slots} slots "
                         f"(max_num_seqs + 2): raise the budget or lower max_num_seqs / max_model_len")
    log.info("cache pools: %d pages of %d tokens (%.1f MiB), %d KDA state slots (%.1f MiB)", pages, args.page_size,
             pages * per_page / 2**20, slots, slots * per_slot / 2**20)
    return pages, slots
