"""Step shapes: the (tokens, sequences) buckets steps pad to, the keys of their compiled programs, the
shapes warm-up compiles, padding arguments to compile them, the step's XLA options, and its scratch
memory from an ahead-of-time compile (the cache is sized after it)."""
from __future__ import annotations

import os
from typing import Sequence

import jax
import numpy as np

from k3jax.cache import SeqChunk, make_step_batch
from k3jax.nnx_model import make_step
from pallas_kernels.backend import Backend, resolve
from serving.sampler import build_sampling_arrays
from serving.sampling_params import SamplingParams


def _pow2_buckets(lo: int, hi: int) -> list:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 4
    return out + [hi]


def tqdm_if(items, progress: bool):
    if not progress:
        return items
    from tqdm import tqdm
    return tqdm(items, desc="warm-up (compiling step shapes)", unit="shape")


def _shape_key(T: int, N: int, decode: bool, mm: bool, spec_width: int = 0, verify_only: bool = False) -> tuple:
    """The compiled step variant of bucket (T, N): decode-only, image embeddings, verification width, verification
    of short chunks only (StepBatch.verify_only)."""
    return ((T, N, bool(decode), bool(mm)) + ((("spec", spec_width),) if spec_width else ())
            + (("verify_only",) if verify_only else ()))


def _step_key(batch) -> tuple:
    """The compiled variant a step batch needs (_shape_key of its bucket and flags)."""
    return _shape_key(batch.tokens.shape[0], batch.cu_seqlens.shape[0] - 1, batch.decode_only,
                      batch.mm_embeds is not None, batch.spec_dst.shape[1] if batch.spec_dst is not None else 0,
                      batch.verify_only)


def holds_short_verify(T: int, N: int, token_buckets: Sequence[int], spec_width: int) -> bool:
    """Whether a verification step of short chunks only (StepBatch.verify_only: N chunks of at most spec_width
    tokens) can land in bucket (T, N): its own variant is compiled for these buckets."""
    return T <= _fit(token_buckets, min(N * spec_width, token_buckets[-1]))


def sampler_variant(sarr) -> tuple:
    """What a compiled sampler program depends on beyond its rows: optional fields' shapes, static flags."""
    return tuple(None if x is None else x.shape for x in (sarr.prompt_mask, sarr.output_tokens, sarr.allowed_mask)
                 ) + (sarr.truncate, sarr.top_logprobs)


def _multi_key(batch, sarr, steps: int) -> tuple:
    """The compiled variant of `steps` decode steps per launch: the step's bucket and the sampler's variant."""
    return ("multi", steps) + _step_key(batch) + sampler_variant(sarr)


def _sampler_key(sarr) -> tuple:
    """The compiled sampler variant sampling arrays need: rows, optional fields' shapes, static flags."""
    return ("sample", sarr.temperature.shape[0]) + sampler_variant(sarr)


def _verify_key(sarr, width: int) -> tuple:
    """The compiled verification-sampler variant (speculative decoding, `width` tokens a row)."""
    return ("verify", width) + _sampler_key(sarr)[1:]


def _fit(buckets: Sequence[int], n: int) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def step_buckets(max_num_seqs: int, max_num_batched_tokens: int, *, on_cpu: bool, token_buckets=None,
                 seq_buckets=None) -> tuple[list, list]:
    """(token buckets, sequence buckets) of a runner. CPU: few shapes (compiles dominate start-up
    there); accelerators: x4 steps (padding costs compute)."""
    tb = token_buckets or (sorted({min(32, max_num_batched_tokens), max_num_batched_tokens}) if on_cpu
                           else _pow2_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens))
    sb = seq_buckets or ([max_num_seqs] if on_cpu else _pow2_buckets(min(4, max_num_seqs), max_num_seqs))
    return sorted(tb), sorted(sb)


def long_buckets(max_num_batched_tokens: int, long_prefill_tokens: int) -> list:
    """Token buckets of a lone long prompt's steps (scheduler: long_prefill_tokens), above the regular ones:
    doubling from 2 x max_num_batched_tokens up to long_prefill_tokens (its last chunk pads at most 2x); one
    sequence bucket each. Empty when long_prefill_tokens <= max_num_batched_tokens (off)."""
    out, b = [], 2 * max_num_batched_tokens
    while b < long_prefill_tokens:
        out.append(b)
        b *= 2
    return out + [long_prefill_tokens] if long_prefill_tokens > max_num_batched_tokens else []


def step_shape(num_tokens: int, num_seqs: int, token_buckets: Sequence[int], seq_buckets: Sequence[int],
               long_token_buckets: Sequence[int] = ()) -> tuple[int, int]:
    """The (tokens, sequences) bucket of a step: the regular buckets, or a long bucket for a step of more tokens
    than they hold and few enough sequences (a lone long prompt's)."""
    if num_tokens > token_buckets[-1] and long_token_buckets and num_seqs <= seq_buckets[0]:
        return _fit(long_token_buckets, num_tokens), seq_buckets[0]
    return _fit(token_buckets, num_tokens), _fit(seq_buckets, num_seqs)


def warmup_shapes(token_buckets: Sequence[int], seq_buckets: Sequence[int], multimodal: bool = False,
                  long_token_buckets: Sequence[int] = ()) -> list:
    """Every step variant warm-up compiles, as (tokens, sequences, decode_only, multimodal); a lone long
    prompt's buckets (long_token_buckets) with the smallest sequence bucket, text only."""
    out = []
    for T in token_buckets:
        for N in seq_buckets:
            if N > T:
                continue
            out.append((T, N, False, False))
            if T <= _fit(token_buckets, N):       # a decode-only step has at most N tokens
                out.append((T, N, True, False))
            if multimodal:
                out.append((T, N, False, True))
    return out + [(T, min(seq_buckets), False, False) for T in long_token_buckets]


def padding_step_args(config, page_size: int, max_pages: int, T: int, N: int, decode: bool, mm: bool, dtype):
    """(batch, sampling arrays, counters) of a step that fills bucket (T, N) without touching real
    state: a one-token chunk on the garbage page / slot 0 (resuming from slot 0: decode-only variant)."""
    rows = [(0, np.zeros((1, config.hidden_size), dtype))] if mm else ()
    batch = make_step_batch([SeqChunk([0], 0, [0], 0 if decode else -1, 0, mm=rows)], page_size,
                            num_tokens=T, num_seqs=N, max_pages=max_pages)
    sarr = build_sampling_arrays([SamplingParams(temperature=0.0)], seeds=[0], num_rows=N)
    return batch, sarr, np.zeros(N, np.int32)


# XLA options for the engine's step on a GPU, measured with the scanned decoder (docs/performance.md):
# - CUDA graphs also around the layer loop (WHILE, CONDITIONAL): the scan body's ~60 kernels per layer are
#   otherwise launched one by one every step (c64 decode 30.5 -> 28.2 ms);
# - no HLO rematerialization: XLA's limit counts the donated cache pools carried through the loop as
#   scratch and re-runs matmuls to "fit"; the engine already sizes its pools after the step's own scratch.
GPU_STEP_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "xla_gpu_memory_limit_slop_factor": 10000,
}


def step_compiler_options() -> dict:
    """The step's per-compile XLA options on this backend; an option the user set in XLA_FLAGS wins."""
    if jax.default_backend() != "gpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    return {k: v for k, v in GPU_STEP_OPTIONS.items() if f"--{k}=" not in flags}


def step_temp_bytes(config, params, *, num_tokens: int, num_seqs: int, page_size: int, max_pages: int,
                    cache_dtype, backend: Backend | None = None, mla_cache_dtype=None) -> int:
    """Scratch memory (activations) of one step of the given bucket, from XLA's buffer assignment of an
    ahead-of-time compile against abstract pools (nothing allocated; pools are donated, so their size
    does not change the scratch). vLLM sizes its cache after a profile run of the largest batch; this is
    the same measurement without running."""
    from k3jax.cache import pool_shapes
    pools = pool_shapes(config, max_pages + 1, page_size, num_seqs + 2, cache_dtype, bits=resolve(backend).pool_bits,
                        mla_dtype=mla_cache_dtype)
    batch = make_step_batch([SeqChunk([0], 0, [0], -1, 0)], page_size, num_tokens=num_tokens, num_seqs=num_seqs,
                            max_pages=max_pages)
    abstract = lambda t: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
    lowered = jax.jit(make_step(config, backend), donate_argnums=(1,),
                      compiler_options=step_compiler_options()).lower(abstract(params), pools, batch)
    stats = lowered.compile().memory_analysis()
    return int(getattr(stats, "temp_size_in_bytes", 0) or 0) if stats is not None else 0
