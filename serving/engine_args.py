"""Engine arguments: one validated dataclass, and pool sizing from a memory budget."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Optional

from pallas_kernels.backend import MLA_DECODE_KERNELS, MLA_PREFILL_FORMS, MODES

log = logging.getLogger(__name__)

# The KV cache's element type, by name ("auto": the weights' dtype). A new cache type is one entry here;
# the CLIs' --kv-cache-dtype choices and EngineArgs' check read this table. "fp8_e4m3": the MLA pages hold
# float8_e4m3fn latents with an fp32 scale per 128 values and the rope key in bf16 (pallas_kernels/mla/
# fp8_cache.py: 656 bytes a token at K3's dims instead of 1,152); the KDA state and conv pools keep the
# weights' dtype.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}
FP8_CACHE = "fp8_e4m3"

# The values of EngineArgs' choice fields: what __post_init__ accepts and what the CLIs offer.
CHOICES = {
    "kernels": MODES,                        # pallas_kernels/backend.py
    "mla_prefill": MLA_PREFILL_FORMS,
    "mla_decode": MLA_DECODE_KERNELS,
    "kv_cache_dtype": tuple(KV_CACHE_DTYPES),
}

# Fields chosen when the model loads (they decide its backend value and its expert layout): LLM and the
# CLIs pass them to k3jax.load_model.
LOAD_FIELDS = ("kernels", "mla_prefill", "mla_decode", "merged_experts")


# JAX's allocator holds 75% of an accelerator by default. The engine sizes its cache from what the allocator
# may hold, after the weights and the largest step's activations (size_pools): a process that serves lets it
# hold 90% (vLLM's default utilization). This is the XLA client's own setting, read once when JAX starts its
# backend, so it is set where a process starts a model on an accelerator (load_model, LLM and the CLIs call
# claim_device_memory first), never on `import k3jax`: a program that only imports the library, or set up
# JAX before loading a model, keeps JAX's default. A value the user set wins. k3jax.plan models the same.
ALLOCATOR_MEMORY_FRACTION = 0.90


def claim_device_memory(fraction: float = ALLOCATOR_MEMORY_FRACTION) -> None:
    """Let JAX's allocator hold `fraction` of each accelerator, unless XLA_PYTHON_CLIENT_MEM_FRACTION is
    set; takes effect only if no JAX backend has started yet (XLA reads it once)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{fraction:.2f}")


# (max_num_seqs, max_num_batched_tokens) when unset: an accelerator's step is weight-bandwidth bound
# up to ~64 rows and a 4096-token prefill step runs near the matmul rate (docs/performance.md);
# on CPU, step time grows with every row, so small steps keep latency and compile time down.
CPU_BATCH_DEFAULTS = (16, 512)
SPECULATIVE = ("off", "ngram", "draft")
ACCELERATOR_BATCH_DEFAULTS = (64, 4096)
# long_prefill_tokens when unset: a lone long prompt's step on an accelerator. Each step reads every weight and
# decompresses the prompt's cached prefix once (the expanded MLA form), and the routed experts' grouped matmuls
# fill their 256-row tiles only from ~8k tokens a step (8 of 256 experts a token); 16,384 tokens is ~4x
# ACCELERATOR_BATCH_DEFAULTS' step in activations, sized by the engine's measurement (LLMEngine._activation_bytes).
# CPU: off (a CPU step's cost grows with its tokens; nothing to amortize).
ACCELERATOR_LONG_PREFILL_TOKENS = 16384


# Decode steps per launch when unset, on an accelerator: one sequence's step is a few milliseconds of kernels
# and about a millisecond and a half of host work and launch gaps between steps (docs/performance.md); eight
# steps in one program pay that once, and a request that stops inside a launch wastes at most seven steps. On
# CPU the step is much longer than the host's work, and its compile time matters more: off.
DECODE_STEPS_ACCELERATOR = 8


def decode_steps_default(on_cpu: bool | None = None) -> int:
    if on_cpu is None:
        import jax
        on_cpu = jax.default_backend() == "cpu"
    return 1 if on_cpu else DECODE_STEPS_ACCELERATOR


# max_model_len's cap on CPU when unset: every step carries block tables as wide as max_model_len, and a CPU
# step's cost grows with them; an accelerator takes the model's whole window.
CPU_MAX_MODEL_LEN = 8192


def default_max_model_len(window: int, num_pages: int, page_size: int, on_cpu: bool) -> tuple[int, str]:
    """(max_model_len, the reason) when unset: the model's window (config max_position_embeddings) when the
    page pool (num_pages per shard, page 0 reserved) holds one sequence that long, else the longest it holds
    (whole pages); on CPU at most CPU_MAX_MODEL_LEN."""
    fits = (num_pages - 1) * page_size
    if on_cpu and CPU_MAX_MODEL_LEN < min(window, fits):
        return CPU_MAX_MODEL_LEN, f"the CPU default (the model's window is {window})"
    if window <= fits:
        return window, "the model's window (max_position_embeddings)"
    return fits, (f"the longest sequence the cache holds ({num_pages - 1} pages of {page_size} tokens); the model's "
                  f"window is {window}: raise memory_fraction / cache_memory_bytes or lower max_num_seqs for more")


def batch_defaults(on_cpu: bool | None = None) -> tuple[int, int]:
    if on_cpu is None:
        import jax
        on_cpu = jax.default_backend() == "cpu"
    return CPU_BATCH_DEFAULTS if on_cpu else ACCELERATOR_BATCH_DEFAULTS


@dataclasses.dataclass
class EngineArgs:
    max_num_seqs: Optional[int] = None            # default: 16 on CPU, 64 on an accelerator (batch_defaults)
    max_num_batched_tokens: Optional[int] = None  # default: 512 on CPU, 4096 on an accelerator
    max_model_len: Optional[int] = None           # default: the model's window when the cache holds one such
                                                  # sequence, else the longest it holds (default_max_model_len)
    page_size: int = 16
    prefix_match_unit: int = 16
    state_block_size: int = 1024                  # KDA checkpoints in long prompts on this grid: a chunk reaching past a
                                                  # multiple ends at the last one inside it (0 = off)
    enable_prefix_caching: bool = True
    cache_finished_state: bool = True             # a finished request's final state stays cached (follow-up turns
                                                  # resume at its end; one KDA slot each until evicted)
    prefix_wait_steps: int = 64                   # a waiting request whose prefix a running prefill is computing waits
                                                  # for its checkpoint up to this many steps (0 = admit at once)
    interactive_prefill_pairs: int = 1 << 26      # while decode rows run, a prefill chunk's (query, key) pairs at
                                                  # most: long prompts' steps stay short (serving/scheduler.py; 0 = off)
    long_prefill_tokens: Optional[int] = None     # a lone long prompt's step (nothing else running or waiting) takes
                                                  # this many tokens (default: 16384 on an accelerator, off on CPU;
                                                  # <= max_num_batched_tokens: off); the engine drops it when its
                                                  # activations would shorten max_model_len, and on a mesh
    verify_prefix_cache: float = 0.0              # recompute this fraction of prefix-cache hits from scratch and
                                                  # compare the first token's log-probabilities (0 = off)
    verify_prefix_cache_tolerance: float = 0.25   # largest |log-prob difference| counted as equal (bf16 chunking noise)
    host_cache_bytes: int = 0                     # host-memory tier for evicted checkpoints and their pages (0 = off)
    memory_fraction: float = 0.85                 # of device memory left after the weights
    cache_memory_bytes: Optional[int] = None      # explicit cache budget (CPU default: 256 MiB)
    state_fraction: float = 0.5                   # share of the cache budget for KDA state slots (of what one
                                                  # max_model_len sequence's pages leave, when the share would not
                                                  # hold them: split_budget)
    num_pages: Optional[int] = None               # explicit pool sizes override the budget
    num_slots: Optional[int] = None
    max_waiting: int = 4096
    max_logprobs: int = 20
    seed: int = 0
    warmup: bool = True
    compile_threads: Optional[int] = None         # warm-up's step shapes compiled on this many host threads (None: half the cores, up to 8)
    background_compile: Optional[bool] = None     # warm-up compiles a covering set of step programs (every sampler,
                                                  # each sequence bucket's decode-only step, the largest step) and the
                                                  # engine serves while the rest compile on a background thread, steps
                                                  # padding to a compiled bucket until theirs lands (None: on with an
                                                  # accelerator in one process; off on CPU and in multi-process runs)
    forbid_compile_after_warmup: bool = False
    async_scheduling: bool = True                 # schedule and dispatch the next step while one runs on the device
    compilation_cache_dir: Optional[str] = os.path.join(os.path.expanduser("~"), ".cache", "k3jax", "xla")
    executable_cache: bool = False                # warm-up's compiled programs kept in compilation_cache_dir/executables:
                                                  # a restart skips tracing and lowering (serve turns it on)
    token_buckets: Optional[tuple] = None
    seq_buckets: Optional[tuple] = None
    vision: bool = True                           # accept images when the model has a tower (False: text only,
                                                  # no tower warm-up or encoder cache)
    encoder_budget: Optional[int] = None          # image tokens encoded per step (default: max_num_batched_tokens)
    encoder_cache_bytes: int = 256 << 20          # encoder-output cache (image digest -> embeddings)
    kv_cache_dtype: str = "auto"                  # element type of the cache pools (KV_CACHE_DTYPES; auto: the
                                                  # weights'; bfloat16 must equal them; fp8_e4m3: MLA pages in
                                                  # FP8 with per-128-value scales, KDA pools as the weights)
    # ---- advanced: kernel and layout choices (pallas_kernels/backend.py); the defaults pick per device
    kernels: str = "auto"                         # auto: Pallas kernels on GPU/TPU, jnp references on CPU;
                                                  # reference | pallas (interpret mode on CPU)
    mla_prefill: str = "auto"                     # MLA prefill form: auto (expanded for large GPU prefill steps)
                                                  # | absorbed | expanded
    mla_decode: str = "auto"                      # decode-only MLA kernel: auto (mosaic on Hopper) | mosaic | triton
    dense_in_place: bool = True                   # one GPU running the kernels: few-row steps read the scanned
                                                  # layers' dense weights in place (False: sliced copies)
    merged_experts: bool = False                  # one GPU running the kernels: routed experts' gate and up
                                                  # weights merged at load (opt-in until measured end to end)
    decode_steps_per_launch: Optional[int] = None  # decode steps run in one device program while no request needs
                                                  # the host between tokens (None: 8 on an accelerator, 1 on CPU;
                                                  # 1 = off; see DECODE_STEPS_ACCELERATOR)
    decode_steps_max_seqs: int = 4                # several decode steps per launch only while at most this many
                                                  # sequences decode (a larger batch's step hides the host's work)
    speculative: str = "off"                      # speculative decoding: "off", "ngram" (prompt lookup) or "draft"
    num_speculative_tokens: int = 4               # drafts verified per sequence and step (the most; adaptive lowers it)
    draft_model: Optional[str] = None             # speculative="draft": preset name or checkpoint directory
    speculative_adaptive: bool = True             # shrink or pause speculation for sequences whose drafts are rejected
    speculative_max_batch: int = 32               # no speculation in steps with more decoding sequences than this
    speculative_on_gpu: bool = False              # speculation over GPU kernels is refused: on the H200 its greedy
                                                  # tokens differ from speculation off (docs/performance.md,
                                                  # "Speculative decoding"); True runs it anyway (gpu tests, bench_spec)

    def __post_init__(self):
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name} {value!r}: expected one of {choices}")
        if self.background_compile is not None and not isinstance(self.background_compile, bool):
            raise ValueError(f"background_compile must be a bool (or unset), got {self.background_compile!r}")
        for name in ("dense_in_place", "merged_experts", "speculative_on_gpu"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        # a defaulted max_num_seqs may be lowered by size_pools to fit the KDA slots beside a long max_model_len
        self.max_num_seqs_defaulted = self.max_num_seqs is None
        if self.max_num_seqs is None or self.max_num_batched_tokens is None:
            seqs, tokens = batch_defaults()
            given_tokens, given_seqs = self.max_num_batched_tokens, self.max_num_seqs
            if given_seqs is None:          # a smaller token budget given: as many sequences as tokens
                self.max_num_seqs = min(seqs, given_tokens) if isinstance(given_tokens, int) else seqs
            if given_tokens is None:        # more sequences given: a token for each
                self.max_num_batched_tokens = max(tokens, given_seqs) if isinstance(given_seqs, int) else tokens
        if self.long_prefill_tokens is None:
            import jax
            self.long_prefill_tokens = 0 if jax.default_backend() == "cpu" else ACCELERATOR_LONG_PREFILL_TOKENS
        if not isinstance(self.long_prefill_tokens, int) or self.long_prefill_tokens < 0:
            raise ValueError(f"long_prefill_tokens must be a non-negative int, got {self.long_prefill_tokens!r}")
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
        if not isinstance(self.interactive_prefill_pairs, int) or self.interactive_prefill_pairs < 0:
            raise ValueError(f"interactive_prefill_pairs must be a non-negative int, got {self.interactive_prefill_pairs!r}")
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
        if self.decode_steps_per_launch is not None and (not isinstance(self.decode_steps_per_launch, int)
                                                         or self.decode_steps_per_launch < 1):
            raise ValueError(f"decode_steps_per_launch must be a positive int (or unset), got "
                             f"{self.decode_steps_per_launch!r}")
        if not isinstance(self.decode_steps_max_seqs, int) or self.decode_steps_max_seqs < 1:
            raise ValueError(f"decode_steps_max_seqs must be a positive int, got {self.decode_steps_max_seqs!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every sequence needs a token)")


    def load_options(self) -> dict:
        """The keyword arguments of k3jax.load_model these settings choose."""
        return {name: getattr(self, name) for name in LOAD_FIELDS}

    def cache_dtype(self, weight_dtype):
        """The KDA pools' dtype (and the MLA pages' unless FP8, see mla_cache_dtype): kv_cache_dtype, or the
        weights' dtype for "auto" and "fp8_e4m3". The model's cache reads and writes take the pools in the
        activations' dtype (pallas_kernels/scatter.py: a CPU pool of 16-bit floats is stored as bits whose
        value dtype is the activations'), so another 16-bit dtype is refused until the layers convert at the
        pool."""
        name = KV_CACHE_DTYPES[self.kv_cache_dtype]
        if name is None or self.kv_cache_dtype == FP8_CACHE:
            return weight_dtype
        import jax.numpy as jnp
        dtype = jnp.dtype(name)
        if dtype != jnp.dtype(weight_dtype):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} with {jnp.dtype(weight_dtype).name} weights: "
                             f"the cache takes the weights' dtype (use 'auto', or load the model in {dtype.name})")
        return dtype.type

    def mla_cache_dtype(self, weight_dtype):
        """The MLA pages' dtype: float8_e4m3fn for "fp8_e4m3" (the pool stores packed rows, k3jax/cache.py),
        else cache_dtype's."""
        if self.kv_cache_dtype == FP8_CACHE:
            import jax.numpy as jnp
            return jnp.float8_e4m3fn
        return self.cache_dtype(weight_dtype)


def field_default(name: str):
    """EngineArgs' default of a field: the one source the CLIs and k3jax.plan read theirs from."""
    f = EngineArgs.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def add_advanced_args(parser, *, engine: bool = True):
    """The CLIs' "advanced" group: kernel and layout choices (EngineArgs' fields of the same names).
    engine=False: only those chosen when the model loads (a CLI without an engine, e.g. k3jax.eval)."""
    g = parser.add_argument_group("advanced (kernel and layout choices; the defaults pick per device)")
    g.add_argument("--kernels", choices=CHOICES["kernels"], default=field_default("kernels"),
                   help="auto: Pallas kernels on GPU/TPU, the jnp references on CPU; reference; pallas "
                        "(interpret mode on CPU)")
    g.add_argument("--mla-prefill", choices=CHOICES["mla_prefill"], default=field_default("mla_prefill"),
                   help="MLA prefill form: auto (expanded for large prefill steps on GPU), absorbed, expanded")
    g.add_argument("--mla-decode", choices=CHOICES["mla_decode"], default=field_default("mla_decode"),
                   help="decode-only MLA kernel on GPU: auto (mosaic on Hopper, else triton), mosaic, triton")
    g.add_argument("--merged-experts", action="store_true",
                   help="one GPU running the kernels: load the routed experts with gate and up merged (default: off)")
    if engine:
        g.add_argument("--kv-cache-dtype", choices=CHOICES["kv_cache_dtype"], default=field_default("kv_cache_dtype"),
                       help="element type of the KV cache pools (auto: the weights' dtype; fp8_e4m3: MLA pages "
                            "in FP8 with a scale per 128 values, ~1.76x the tokens; KDA state as the weights)")
        g.add_argument("--no-dense-in-place", dest="dense_in_place", action="store_false",
                       help="one GPU running the kernels: slice the scanned layers' dense weights for few-row "
                            "steps (default: read in place)")
        g.add_argument("--background-compile", action=argparse.BooleanOptionalAction, default=None,
                       help="ready after compiling a covering set of step programs; the rest compile in the "
                            "background and steps pad to a compiled bucket until theirs lands (default: on with "
                            "an accelerator in one process, off on CPU and in multi-process runs)")
    return g


def advanced_kwargs(args) -> dict:
    """EngineArgs keyword arguments from add_advanced_args' flags."""
    return {name: getattr(args, name)
            for name in LOAD_FIELDS + ("kv_cache_dtype", "dense_in_place", "background_compile")
            if hasattr(args, name)}


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


def cache_budget(args: EngineArgs, free: int, activation_bytes: int) -> int:
    """The cache's bytes when sized from device memory: memory_fraction of what the largest step leaves."""
    return int((free - activation_bytes) * args.memory_fraction)


def split_budget(args: EngineArgs, config, budget: int, cache_dtype, mla_dtype) -> tuple[int, int]:
    """(MLA pages, KDA state slots) a cache budget gives, reserved id 0 included: state_fraction of it for the slots,
    the rest for the pages. When that leaves the pages short of one max_model_len sequence (a long context asked
    for), the pages take what that sequence needs first and the split applies to the rest, the slots keeping
    max_num_seqs + 2 when it holds them (size_pools says so in the log)."""
    from k3jax.cache import pool_bytes_per_page, pool_bytes_per_slot
    per_page = max(pool_bytes_per_page(config, args.page_size, mla_dtype), 1)
    per_slot = max(pool_bytes_per_slot(config, cache_dtype), 1)
    sf = args.state_fraction
    pages = args.num_pages or int(budget * (1 - sf) // per_page)
    slots = args.num_slots or int(budget * sf // per_slot)
    need = min_pages(args)
    rest = budget - need * per_page
    if pages >= need or args.num_pages or args.num_slots or rest <= 0:
        return pages, slots
    slots = max(int(rest * sf // per_slot), min(args.max_num_seqs + 2, int(rest // per_slot)))
    return need + int((rest - slots * per_slot) // per_page), slots


def min_pages(args: EngineArgs) -> int:
    """Pages of one max_model_len sequence, plus the reserved page 0."""
    return -(-(args.max_model_len or 0) // args.page_size) + 1


def size_pools(args: EngineArgs, config, weight_bytes: int, cache_dtype, activation_bytes: int = 0,
               mla_dtype=None) -> tuple[int, int]:
    """(num_pages, num_slots) from explicit sizes or the memory budget; both include reserved id 0.
    activation_bytes: the largest step's scratch memory, kept free of the cache (measured by the engine).
    mla_dtype: the MLA pages' dtype (EngineArgs.mla_cache_dtype; None: cache_dtype)."""
    from k3jax.cache import pool_bytes_per_page, pool_bytes_per_slot
    mla_dtype = cache_dtype if mla_dtype is None else mla_dtype
    per_page = max(pool_bytes_per_page(config, args.page_size, mla_dtype), 1)
    per_slot = max(pool_bytes_per_slot(config, cache_dtype), 1)
    budget = args.cache_memory_bytes
    if budget is None:
        free = device_free_bytes(weight_bytes)
        if free is not None and free - activation_bytes <= 0:
            raise ValueError(f"the largest step needs {activation_bytes / 2**30:.2f} GiB of activations but only "
                             f"{free / 2**30:.2f} GiB of device memory is free after the weights: lower "
                             f"max_num_batched_tokens / max_num_seqs")
        budget = cache_budget(args, free, activation_bytes) if free else 256 << 20
        if free:
            log.info("device memory: %.2f GiB free after the weights, %.2f GiB kept for the largest step's "
                     "activations, cache budget %.2f GiB (memory_fraction %.2f)", free / 2**30,
                     activation_bytes / 2**30, budget / 2**30, args.memory_fraction)
    pages, slots = split_budget(args, config, budget, cache_dtype, mla_dtype)
    if pages > int(budget * (1 - args.state_fraction) // per_page) and not args.num_pages:
        log.info("cache split: the pages first take one sequence of max_model_len %d (%d pages), state_fraction "
                 "%.2f applies to the rest", args.max_model_len, min_pages(args), args.state_fraction)
    if slots < args.max_num_seqs + 2 and getattr(args, "max_num_seqs_defaulted", False) and slots >= 3:
        log.warning("max_num_seqs %d -> %d: beside one sequence of max_model_len %d the cache holds %d KDA state "
                    "slots (one a running sequence, two reserved); set max_num_seqs, or lower max_model_len, to "
                    "choose otherwise", args.max_num_seqs, slots - 2, args.max_model_len, slots)
        args.max_num_seqs = slots - 2
    min_slots = args.max_num_seqs + 2            # every running sequence plus garbage and one checkpoint
    if slots < min_slots or pages < min_pages(args):
        raise ValueError(f"cache budget {budget / 2**20:.0f} MiB gives {pages} pages / {slots} slots; need at least "
                         f"{min_pages(args)} pages (one max-length sequence) and {min_slots} slots "
                         f"(max_num_seqs + 2): raise the budget or lower max_num_seqs / max_model_len")
    log.info("cache pools: %d pages of %d tokens (%.1f MiB, MLA cache %s), %d KDA state slots (%.1f MiB, %s)",
             pages, args.page_size, pages * per_page / 2**20, cache_dtype_name(mla_dtype), slots,
             slots * per_slot / 2**20, cache_dtype_name(cache_dtype))
    return pages, slots


def cache_dtype_name(dtype) -> str:
    """How the start-up log names a pool's dtype ("fp8_e4m3 (...)" for packed FP8 MLA pages)."""
    import jax.numpy as jnp
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        return "fp8_e4m3 (float8_e4m3fn latent, fp32 scale per 128 values, bf16 rope)"
    return jnp.dtype(dtype).name
