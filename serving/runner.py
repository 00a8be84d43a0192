"""Model runner: owns the cache pools on the device and the jitted step (model, then sampler).

Every step is padded to a shape bucket (tokens, sequences); pages per sequence are fixed by the
max model length, so the set of compilations is small and known. Pools are donated in and out.
Warm-up compiles them all, or (background) a covering set first and the rest on a background thread
while the engine serves, each step padding to the smallest compiled bucket until its own lands.
The sampler is a jit of its own: its variants (penalties, allowed-token masks) are small programs
compiled at warm-up per sequence bucket, never a recompile of the model while serving.
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.cache import SeqChunk, make_pools, make_step_batch
from pallas_kernels.scatter import read_rows, set_rows
from k3jax.nnx_model import K3Model, make_step, split_model
from pallas_kernels.backend import Backend, resolve
from serving import multihost
from serving.compile_queue import CompileQueue, Job, abstract, compile_now, compile_threads
from serving.sampler import SamplingArrays, build_sampling_arrays, make_key_data, sample
from serving.sampling_params import SamplingParams
from serving.spec.rejection import verify as spec_verify
from serving.step_shapes import (_fit, _multi_key, _sampler_key, _shape_key, _step_key, _verify_key, holds_short_verify,
                                 long_buckets, sampler_variant, step_buckets, step_compiler_options, step_shape,
                                 tqdm_if, warmup_shapes)

log = logging.getLogger(__name__)


class CompileAfterWarmupError(RuntimeError):
    """A new shape was compiled after warm-up while the compile guard is on."""


def _copy_pages(pools, src, dst):
    return pools.replace(mla_kv=set_rows(pools.mla_kv, dst, read_rows(pools.mla_kv, src)))  # all layers, as stored


def _with_previous_tokens(step):
    """The step with placeholder tokens -(r + 1) replaced by row r of the previous step's sampled tokens
    (async scheduling: the host has not seen them yet)."""
    def run(params, pools, batch, last_tokens):
        t = batch.tokens
        prev = last_tokens[jnp.clip(-t - 1, 0, last_tokens.shape[0] - 1)]
        return step(params, pools, batch.replace(tokens=jnp.where(t < 0, prev, t)))
    return run


def _multi_decode(step, steps: int, num_top_logprobs: int):
    """`steps` decode steps of a decode-only batch in one program (EngineArgs.decode_steps_per_launch):
    each step's sampled token is the next step's input, written at the next position of the sequence's
    block table (the host has reserved the pages), and its sampling counter advances by one, so each
    token is drawn with the key a one-step launch would use. Returns (tokens [N, steps], logprobs
    [N, steps], top_ids [N, steps, L], top_vals [N, steps, L], last_tokens, pools); padding sequences
    (no token) stay as they are."""
    def run(params, pools, batch, last_tokens, sarr, key_data, counters):
        t = batch.tokens
        prev = last_tokens[jnp.clip(-t - 1, 0, last_tokens.shape[0] - 1)]
        batch = batch.replace(tokens=jnp.where(t < 0, prev, t))
        cu = batch.cu_seqlens
        real = (cu[1:] - cu[:-1]) == 1                      # decode-only: a sequence feeds one token or none
        at = jnp.where(real, cu[:-1], t.shape[0])           # its token's index in the flat batch (none: dropped)
        rows = jnp.arange(real.shape[0])
        page_size = pools.page_size
        max_pages = batch.block_tables.shape[1]

        def one(carry, _):
            pools, batch, counters = carry
            logits, pools = step(params, pools, batch)
            toks, lp, (top_ids, top_vals) = sample(logits, sarr, key_data, counters,
                                                   num_top_logprobs=num_top_logprobs)
            pos = batch.kv_lens                              # the next token's position
            page = batch.block_tables[rows, jnp.clip(pos // page_size, 0, max_pages - 1)]
            slot = page * page_size + pos % page_size
            nxt = batch.replace(
                tokens=batch.tokens.at[at].set(toks.astype(batch.tokens.dtype), mode="drop"),
                slot_mapping=batch.slot_mapping.at[at].set(slot.astype(batch.slot_mapping.dtype), mode="drop"),
                kv_lens=batch.kv_lens + real.astype(batch.kv_lens.dtype))
            return (pools, nxt, counters + 1), (toks, lp, top_ids, top_vals)

        (pools, _, _), (toks, lp, top_ids, top_vals) = jax.lax.scan(one, (pools, batch, counters), None,
                                                                     length=steps)
        last = jax.lax.dynamic_update_slice(last_tokens, toks[-1].astype(last_tokens.dtype), (0,))
        swap = lambda x: jnp.moveaxis(x, 0, 1)               # noqa: E731 - [steps, N, ...] -> [N, steps, ...]
        return swap(toks), swap(lp), swap(top_ids), swap(top_vals), last, pools
    return run


def _verify_rows(logits, sarr, key_data, counters, drafts, num_drafts, *, num_top_logprobs):
    """rejection.verify on a verification step's logits as the step returns them ([N * W, V], a sequence's W
    positions in a row): the reshape inside the program, not an eager op on the host between the two."""
    n = counters.shape[0]
    return spec_verify(logits.reshape(n, -1, logits.shape[-1]), sarr, key_data, counters, drafts, num_drafts,
                       num_top_logprobs=num_top_logprobs)


def _sample_and_keep(logits, sarr, key_data, counters, last_tokens, *, num_top_logprobs):
    toks, lp, top = sample(logits, sarr, key_data, counters, num_top_logprobs=num_top_logprobs)
    return toks, lp, top, jax.lax.dynamic_update_slice(last_tokens, toks.astype(last_tokens.dtype), (0,))


class ModelRunner:
    @multihost.announce_init    # multi-host: followers build the same runner (serving/multihost.py)
    def __init__(self, config, params, *, num_pages: int, num_slots: int, page_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_logprobs: int = 20, seed: int = 0,
                 cache_dtype=None, mla_cache_dtype=None, token_buckets=None, seq_buckets=None, mesh=None,
                 backend: Backend | None = None, dense_in_place: bool = True, executable_cache=None,
                 spec_width: int = 0, decode_steps: int = 1, decode_steps_max_seqs: int = 0,
                 long_prefill_tokens: int = 0):
        self.config = config
        # several decode steps per launch (launch_decode_steps): `decode_steps` of them for steps of at most
        # `decode_steps_max_seqs` sequences (1 / 0: off)
        self.decode_steps = decode_steps
        self.decode_steps_max_seqs = decode_steps_max_seqs if decode_steps > 1 else 0
        self.spec_width = spec_width        # speculative decoding: K + 1 tokens per verify row (0 = off)
        self.backend = resolve(backend)     # closed over by the step (expert parallelism added on a mesh)
        # the model's layout (stacked by load_model already: then no copy). Split once: the step
        # merges the NNX model from (graph, params) inside its trace.
        self.graph, self.params = split_model(K3Model(config, params))
        self.page_size = page_size
        self.max_pages = -(-max_model_len // page_size)
        self.max_logprobs = max_logprobs
        self.pools = make_pools(config, num_pages, page_size, num_slots, cache_dtype or params["embed"].dtype,
                                bits=self.backend.pool_bits, mla_dtype=mla_cache_dtype)
        self.token_buckets, self.seq_buckets = step_buckets(
            max_num_seqs, max_num_batched_tokens, on_cpu=jax.default_backend() == "cpu",
            token_buckets=token_buckets, seq_buckets=seq_buckets)
        # a lone long prompt's steps (one sequence, more tokens than the regular buckets hold)
        self.long_token_buckets = long_buckets(self.token_buckets[-1], long_prefill_tokens)
        self.key_data = make_key_data(seed)
        self.guard = False
        self._seen: set = set()
        c = config

        step_kw, sample_kw, copy_kw = {}, {}, {}
        if mesh is not None:
            # Pools sharded by the partition rules and kept there; MoE traced expert-parallel.
            from sharding.moe_ep import expert_parallel
            from sharding.rules import pool_shardings, replicated, shard_pools
            self.pools = shard_pools(self.pools, mesh)
            ps = pool_shardings(config, mesh, self.pools)
            rep = replicated(mesh)
            step_kw = dict(out_shardings=(rep, ps))
            sample_kw = dict(out_shardings=rep)
            copy_kw = dict(out_shardings=ps)
            self.backend = expert_parallel(self.backend, mesh)
        elif self.backend.kernels and self.backend.platform == "gpu" and dense_in_place:
            # unsharded weights: few-row steps read the scanned layers' dense weights in place
            # (pallas_kernels/stacked.py; the step's slices were ~1.8 ms of copies per c64 decode step;
            # EngineArgs.dense_in_place=False slices them, for comparison)
            self.backend = self.backend.replace(dense_in_place=True)

        self._step = jax.jit(_with_previous_tokens(make_step(c, self.backend, self.graph)), donate_argnums=(1,),
                             compiler_options=step_compiler_options(), **step_kw)
        # (no lax.cond inside: XLA:GPU reads a conditional's predicate back to the host, which blocked this
        # dispatch until the step before had run; see sampler.SamplingArrays.truncate)
        self._sample = jax.jit(functools.partial(_sample_and_keep, num_top_logprobs=max_logprobs),
                               donate_argnums=(4,), **sample_kw)
        self._verify = jax.jit(functools.partial(_verify_rows, num_top_logprobs=max_logprobs), **sample_kw)
        if self.decode_steps_max_seqs:
            multi_kw = dict(out_shardings=(rep,) * 5 + (ps,)) if mesh is not None else {}
            self._multi = jax.jit(_multi_decode(make_step(c, self.backend, self.graph), decode_steps, max_logprobs),
                                  donate_argnums=(1, 3), compiler_options=step_compiler_options(), **multi_kw)
        # the last step's sampled tokens, on the device, for the next step's placeholders (runner.launch)
        self.last_tokens = jnp.zeros(self.seq_buckets[-1], jnp.int32)
        if mesh is not None:
            self.last_tokens = jax.device_put(self.last_tokens, rep)
        # one penalties variant: output ids padded to the context (a power of two, as the buckets)
        self.penalty_width = 1 << max(0, max_model_len - 1).bit_length()
        self._copy = jax.jit(_copy_pages, donate_argnums=(0,), **copy_kw)
        self.num_compiles = 0
        self._aot = mesh is None and jax.process_count() == 1   # on a mesh: jit places the host batch
        self._compiled = {}          # step shape -> executable compiled ahead of time by warmup
        self._multi_keys = {}        # (T, N, truncate) -> the key of that multi-step program
        self._queue = None           # the background compile (warmup(background=True)); None: every program is
                                     # compiled at warm-up, or compiles on first use
        # warm-up's executables kept across restarts (serving/executable_cache.py); None: off
        self.executable_cache = executable_cache if self._aot else None

    # ------------------------------------------------------------------ compile accounting
    def _note_shape(self, key):
        if key in self._seen:
            return
        if self.guard:
            raise CompileAfterWarmupError(f"step shape {key} was not compiled during warm-up")
        self._seen.add(key)
        self.num_compiles += 1

    def _note_landed(self, key):
        """A program compiled in the background: its shape is known to the guard (never run at warm-up)."""
        if key not in self._seen:
            self._seen.add(key)
            self.num_compiles += 1

    @staticmethod
    def _variant(sarr: SamplingArrays):
        return sampler_variant(sarr)

    # ------------------------------------------------------------------ execution
    def copy_pages(self, copies):
        if not copies:
            return
        n = _fit(self.seq_buckets, len(copies))
        src = np.zeros(n, np.int32)
        dst = np.zeros(n, np.int32)
        src[:len(copies)], dst[:len(copies)] = zip(*copies)
        self._note_shape(("copy", n))
        self._call("copy", src, dst)

    def execute(self, chunks: Sequence[SeqChunk], params: Sequence[SamplingParams], seeds, counters,
                prompt_ids=None, output_ids=None, allowed_masks=None):
        """Run one step. Returns numpy (tokens [N], logprobs [N], top_ids [N, K], top_vals [N, K])."""
        n = len(chunks)
        out = self.fetch(self.launch(chunks, params, seeds, counters, prompt_ids, output_ids, allowed_masks))
        return tuple(x[:n] for x in out)

    def _step_inputs(self, chunks, params, seeds, counters, prompt_ids, output_ids, allowed_masks, top_logprobs,
                     spec_width: int = 0):
        """(T, N, batch, sampling arrays, counters) of a step over `chunks`, padded to its shape bucket."""
        num_tokens = sum(len(ch.tokens) for ch in chunks)
        T, N = step_shape(num_tokens, len(chunks), self.token_buckets, self.seq_buckets, self.long_token_buckets)
        batch = make_step_batch(chunks, self.page_size, num_tokens=T, num_seqs=N, max_pages=self.max_pages,
                                spec_width=spec_width)
        if batch.verify_only and not holds_short_verify(T, N, self.token_buckets, spec_width):
            batch = batch.replace(verify_only=False)    # no such variant: the general verification runs them too
        if self._queue is not None and _step_key(batch) not in self._compiled:     # its program is still compiling
            picked = self._compiled_bucket(num_tokens, len(chunks), batch.decode_only, batch.mm_embeds is not None,
                                           spec_width, batch.verify_only)
            if picked is not None:
                T, N, decode, short = picked
                batch = make_step_batch(chunks, self.page_size, num_tokens=T, num_seqs=N, max_pages=self.max_pages,
                                        spec_width=spec_width)
                if batch.decode_only and not decode:
                    batch = batch.replace(decode_only=False)     # the general variant runs one-token chunks too
                if batch.verify_only and not short:
                    batch = batch.replace(verify_only=False)
        sarr = build_sampling_arrays(list(params), seeds=list(seeds), num_rows=N, vocab_size=self.config.vocab_size,
                                     prompt_token_ids=prompt_ids, output_token_ids=output_ids,
                                     allowed_masks=allowed_masks, penalty_width=self.penalty_width,
                                     top_logprobs=True if top_logprobs else None)
        cnt = np.zeros(N, np.int32)
        cnt[:len(counters)] = counters
        return T, N, batch, sarr, cnt

    def launch(self, chunks: Sequence[SeqChunk], params: Sequence[SamplingParams], seeds, counters,
               prompt_ids=None, output_ids=None, allowed_masks=None, top_logprobs: bool = False):
        """Dispatch one step without waiting: device (tokens, logprobs, top_ids, top_vals), one row per
        bucket sequence. A negative token -(r + 1) in a chunk stands for row r of the previous step's
        sampled tokens, which are still on the device. top_ids / top_vals have max_logprobs columns when
        a row asks for logprobs or `top_logprobs`, else none."""
        T, N, batch, sarr, cnt = self._step_inputs(chunks, params, seeds, counters, prompt_ids, output_ids,
                                                   allowed_masks, top_logprobs)
        self._note_shape(("step", T, N, batch.decode_only, batch.mm_embeds is not None))
        self._note_shape(("sample", N, self._variant(sarr)))
        return self._call("step", batch, sarr, cnt)

    def launch_verify(self, chunks: Sequence[SeqChunk], drafts, params: Sequence[SamplingParams], seeds, counters,
                      prompt_ids=None, output_ids=None, allowed_masks=None, top_logprobs: bool = False):
        """Dispatch a speculative verification step (serving/spec): chunk n's tokens end with drafts[n]
        (possibly none) and its SeqChunk.spec_slots name a KDA slot per fed token. Returns device (tokens
        [N, W], accepted [N], logprobs [N, W], top_ids [N, W, L], top_vals [N, W, L]), W = spec_width
        (rejection.verify)."""
        W = self.spec_width
        T, N, batch, sarr, cnt = self._step_inputs(chunks, params, seeds, counters, prompt_ids, output_ids,
                                                   allowed_masks, top_logprobs, spec_width=W)
        d = np.zeros((N, W - 1), np.int32)
        nd = np.zeros(N, np.int32)
        for n, ds in enumerate(drafts):
            d[n, :len(ds)] = ds
            nd[n] = len(ds)
        self._note_shape(("verify", T, N, W, batch.verify_only))
        self._note_shape(("verify-sample", N, self._variant(sarr)))
        return self._call("verify", batch, sarr, cnt, d, nd)

    # ---- while programs compile in the background (warmup(background=True)), steps use compiled ones only
    def _compiled_bucket(self, num_tokens: int, num_seqs: int, decode: bool, mm: bool, spec_width: int = 0,
                         verify_only: bool = False):
        """(T, N, decode variant, verify-only variant) of the smallest bucket whose program is compiled and holds
        the step: a bucket of at least its tokens and sequences (a lone long prompt's: of the long buckets), the
        decode-only (verify-only) variant or the general one for a decode-only (verify-only) batch; None when none
        is."""
        tb, sb = self.token_buckets, self.seq_buckets
        T, N = step_shape(num_tokens, num_seqs, tb, sb, self.long_token_buckets)
        if T > tb[-1]:
            holding = [(L, N) for L in self.long_token_buckets if L >= T]
        else:
            holding = [(t, n) for t in tb if t >= T for n in sb if N <= n <= t]
        for t, n in holding:
            for d in ((True, False) if decode else (False,)):
                for v in ((True, False) if verify_only else (False,)):
                    if _shape_key(t, n, d, mm, spec_width, v) in self._compiled:
                        return t, n, d, v
        return None

    def long_prefill_limit(self) -> int:
        """The most tokens a lone long prompt's step may take: the largest long bucket (0: none), while compiling in
        the background the largest whose program has landed."""
        ready = [L for L in self.long_token_buckets
                 if self._queue is None or _shape_key(L, self.seq_buckets[0], False, False) in self._compiled]
        return ready[-1] if ready else 0

    def can_launch_decode_steps(self, num_seqs: int) -> bool:
        """Whether launch_decode_steps may run `num_seqs` sequences now: within decode_steps_max_seqs, and while
        compiling in the background, once both sampler variants of their bucket's program have landed."""
        if not 0 < num_seqs <= self.decode_steps_max_seqs:
            return False
        if self._queue is None:
            return True
        T, N = _fit(self.token_buckets, num_seqs), _fit(self.seq_buckets, num_seqs)
        return all(self._multi_keys.get((T, N, t)) in self._compiled for t in (False, True))

    def can_verify(self, num_tokens: int, num_seqs: int, short: bool = False) -> bool:
        """Whether a verification step of `num_tokens` (drafts included) over `num_seqs` sequences (`short`: every
        chunk at most spec_width tokens) has a compiled program (always, unless compiling in the background)."""
        return self._queue is None or self._compiled_bucket(num_tokens, num_seqs, False, False,
                                                            self.spec_width, short) is not None

    def multi_step_shapes(self) -> list:
        """The (tokens, sequences) buckets of decode-only steps launch_decode_steps may run."""
        return sorted({(_fit(self.token_buckets, n), _fit(self.seq_buckets, n))
                       for n in range(1, min(self.decode_steps_max_seqs, self.seq_buckets[-1]) + 1)})

    def launch_decode_steps(self, chunks: Sequence[SeqChunk], params: Sequence[SamplingParams], seeds, counters):
        """Dispatch `decode_steps` decode steps of a decode-only batch in one program (see _multi_decode):
        every chunk feeds one token and its pages must hold `decode_steps` more positions. Returns device
        (tokens [N, S], logprobs [N, S], top_ids [N, S, L], top_vals [N, S, L]), S = decode_steps. No
        penalties or allowed-token masks (each step's sample would need the host)."""
        T, N, batch, sarr, cnt = self._step_inputs(chunks, params, seeds, counters, None, None, None, False)
        if not batch.decode_only or len(chunks) > self.decode_steps_max_seqs:
            raise ValueError("launch_decode_steps: a decode-only batch of at most decode_steps_max_seqs sequences")
        if sarr.output_tokens is not None or sarr.allowed_mask is not None:
            raise ValueError("launch_decode_steps: penalties and allowed-token masks need one step per launch")
        self._note_shape(_multi_key(batch, sarr, self.decode_steps))
        return self._call("multi", batch, sarr, cnt)

    @staticmethod
    def fetch(results):
        """Wait for a launched step and bring its results to the host (one transfer for all)."""
        return tuple(np.asarray(x) for x in jax.device_get(results))

    def warmup(self, progress: bool = True, multimodal: bool = False, threads: int | None = None,
               all_sampler_variants: bool = False, background: bool = False, gate=None):
        """Compile every (tokens, sequences) bucket with padding-only batches; then the guard may be armed.
        multimodal: also the variant of each bucket that takes image embeddings. all_sampler_variants: also
        the rare sampler variants (penalties or an allowed-token mask together with top-k/top-p or top
        logprobs; otherwise compiled when first used). The step shapes are
        traced one after another and compiled on `threads` host threads (default: half the cores, up
        to 8): XLA compiles outside the GIL, and the step's compile time is most of a cold start.

        background: compile only a covering set before returning (every sampler variant, the decode-only
        variant of each sequence bucket and the largest regular bucket, which holds any regular step) plus
        whatever the executable cache holds; the other programs are built on a background thread afterwards
        (serving/compile_queue.py) and used as they land: until then a step pads to a compiled bucket
        (_step_inputs), and the callers ask before a long-prompt, multi-step or verification launch
        (long_prefill_limit, can_launch_decode_steps, can_verify). Needs ahead-of-time compiles (one process,
        no mesh); ignored otherwise. gate: a threading.Event the background thread waits for before each program."""
        shapes = warmup_shapes(self.token_buckets, self.seq_buckets, multimodal)
        long = warmup_shapes((), self.seq_buckets, long_token_buckets=self.long_token_buckets)
        t0 = time.perf_counter()
        # sampler variants of every sequence bucket, (penalties, masked) x (top-k/top-p sort, top logprobs): the
        # common ones, or all 16 when a compile after warm-up would be an error (all_sampler_variants); a
        # request with presence_penalty must not compile while others run
        variants = [v for v in itertools.product((False, True), repeat=4)
                    if all_sampler_variants or not any(v[2:]) or not any(v[:2])]
        lower_s = compile_s = 0.0
        later, total = [], 0
        if self._aot:
            jobs = self._jobs(shapes + long, variants)
            total = len(jobs)
            jobs = self._load_cached(jobs)          # what the executable cache holds loads now, in any mode
            if background:
                later = sorted((j for j in jobs if not j.cover), key=lambda j: j.rank)
                jobs = [j for j in jobs if j.cover]
            lower_s, compile_s = compile_now(jobs, self._store, threads=threads, progress=progress,
                                             compile=self._compile_for_store)
        ready = (lambda key: key in self._compiled) if later else (lambda key: True)
        t_run = time.perf_counter()
        run = [s for s in shapes + long if ready(_shape_key(*s))]
        for T, N, decode, mm in tqdm_if(run, progress and not self._aot):
            self._run_padding(T, N, decode=decode, mm=mm)
        # each variant once, on the smallest step that holds its bucket (compiled above, or here)
        for N in self.seq_buckets:
            T = _fit(self.token_buckets, N)
            decode = not ready(_shape_key(T, N, False, False))      # the covering set has its decode-only variant
            for variant in variants:
                self._run_padding(T, N, decode, False, *variant)
        for T, N in self.multi_step_shapes():          # several decode steps per launch, (top-k/top-p sort) x 2
            for truncate in (False, True):
                if ready(self._multi_keys.get((T, N, truncate))):
                    self._run_padding_multi(T, N, truncate)
        if self.spec_width:            # the verification variants of every (tokens, sequences) bucket
            for T, N, decode, mm in shapes:
                for short in self._verify_variants(T, N, decode, mm):
                    if ready(_shape_key(T, N, False, False, self.spec_width, short)):
                        self._run_padding_verify(T, N, verify_only=short)
            for N in self.seq_buckets:                 # and its sampler variants, as the plain sampler's
                T = _fit(self.token_buckets, N)
                if ready(_shape_key(T, N, False, False, self.spec_width)):
                    for variant in variants:
                        self._run_padding_verify(T, N, *variant)
        self.copy_pages([(0, 0)])
        jax.block_until_ready(self.pools)
        if not later:
            log.info("warm-up: %d step shapes compiled in %.1fs (lowering %.1fs, compiling %.1fs, first runs %.1fs)",
                     len(shapes) + len(long), time.perf_counter() - t0, lower_s, compile_s, time.perf_counter() - t_run)
            return
        log.info("warm-up: ready in %.1fs with %d of %d programs; %d compile in the background (steps pad to a "
                 "compiled bucket until theirs lands) (lowering %.1fs, compiling %.1fs, first runs %.1fs)",
                 time.perf_counter() - t0, total - len(later), total, len(later), lower_s, compile_s,
                 time.perf_counter() - t_run)
        self._start_background(later, total, t0, threads, gate)

    # ------------------------------------------------------------------ ahead-of-time programs
    def _jobs(self, shapes, sampler_variants) -> list:
        """Every program warm-up builds for (T, N, decode_only, multimodal) step shapes and the sampler's variants
        of each sequence bucket (warmup's flags), one per key, as compile_queue.Job."""
        tb, sb, W = self.token_buckets, self.seq_buckets, self.spec_width
        largest = (tb[-1], max([N for N in sb if N <= tb[-1]] or sb[:1]))      # holds any regular step
        jobs = []
        for T, N, decode, mm in shapes:
            batch, _ = self._padding_batch(T, N, decode=decode, mm=mm)
            long = T > tb[-1]
            rank = (1, T, N) if decode else (3, T, N) if long else (2, T, N, mm)
            jobs.append(Job(_step_key(batch), self._step, "step", (self.params, self.pools, batch, self.last_tokens),
                             (("step", T, N, bool(decode), bool(mm)),), decode or (T, N) == largest, rank))
            for short in self._verify_variants(T, N, decode, mm):      # the verification variants of the bucket
                batch = self._padding_verify_batch(T, N, verify_only=short)
                jobs.append(Job(_step_key(batch), self._step, "step",
                                 (self.params, self.pools, batch, self.last_tokens), (("verify", T, N, W, short),),
                                 False, (4, not short, T, N)))     # short chunks' first: speculation's common step
        for N in sb:
            logits = jax.ShapeDtypeStruct((N, self.config.vocab_size),       # the step's logits: fp32 or wider
                                          jnp.result_type(self.params["embed"].dtype, jnp.float32))
            for v in sampler_variants:
                _, sarr = self._padding_batch(_fit(tb, N), N, False, False, *v)
                jobs.append(Job(_sampler_key(sarr), self._sample, "sample",
                                 (logits, sarr, self.key_data, np.zeros(N, np.int32), self.last_tokens),
                                 (("sample", N, self._variant(sarr)),), True, (0,)))
                if W:
                    wide = jax.ShapeDtypeStruct((N * W, logits.shape[1]), logits.dtype)
                    jobs.append(Job(_verify_key(sarr, W), self._verify, "verify",
                                     (wide, sarr, self.key_data, np.zeros(N, np.int32), np.zeros((N, W - 1), np.int32),
                                      np.zeros(N, np.int32)), (("verify-sample", N, self._variant(sarr)),), True, (0,)))
        for T, N in self.multi_step_shapes():
            for truncate in (False, True):
                batch, sarr = self._padding_batch(T, N, True, truncate=truncate)
                key = self._multi_keys[(T, N, truncate)] = _multi_key(batch, sarr, self.decode_steps)
                jobs.append(Job(key, self._multi, "multi", (self.params, self.pools, batch, self.last_tokens, sarr,
                                                             self.key_data, np.zeros(N, np.int32)),
                                 (key,), False, (0, T, N)))
        return list({job.key: job for job in jobs}.values())      # one program a key

    def _cache_key(self, job) -> str:
        return self.executable_cache.key(job.kind, repr(self.config), repr(self.backend), job.key,
                                         step_compiler_options())

    def _load_cached(self, jobs) -> list:
        """Load the executable cache's programs among `jobs`; returns the others."""
        cache = self.executable_cache
        if cache is None:
            return jobs
        left = []
        for job in jobs:
            exe = cache.load(self._cache_key(job), job.args)
            if exe is None:
                left.append(job)
            else:
                self._compiled[job.key] = exe
        log.info("executable cache: %d of %d step programs loaded from %s", len(jobs) - len(left), len(jobs),
                 cache.directory)
        return left

    def _compile_for_store(self, lowered):
        """A warm-up program's compile: as the executable cache needs it when there is one."""
        return lowered.compile() if self.executable_cache is None else self.executable_cache.compile(lowered)

    def _store(self, job, exe):
        """A program compiled at warm-up: kept for _call and stored in the executable cache."""
        self._compiled[job.key] = exe
        if self.executable_cache is not None:
            self.executable_cache.save(self._cache_key(job), job.args, exe)

    def _start_background(self, jobs, total: int, t0: float, threads: int | None, gate):
        """Build `jobs` on background threads (CompileQueue); each lands in the compiled table and the
        executable cache. The queue lowers against abstract arguments: the pools it was planned with are
        donated by the steps that run meanwhile."""
        by_key = {job.key: job._replace(args=abstract(job.args)) for job in jobs}

        def land(key, exe):
            job = by_key[key]
            for note in job.notes:      # first: a step may use the program as soon as it is in the table
                self._note_landed(note)
            self._store(job, exe)

        def done(seconds: float, failed: list):
            if failed:
                log.warning("background compile: %d of %d programs in %.1fs; %d failed (their shapes stay "
                            "unavailable): %s", total - len(failed), total, time.perf_counter() - t0, len(failed),
                            failed)
            else:
                log.info("background compile: all %d programs in %.1fs", total, time.perf_counter() - t0)

        self._queue = CompileQueue([(j.key, functools.partial(j.fn.lower, *j.args)) for j in by_key.values()], land,
                                   threads=compile_threads(threads, len(jobs)), gate=gate, on_done=done,
                                   compile=self._compile_for_store).start()

    def compiles_pending(self) -> int:
        """Programs still compiling in the background (0: none, or no background compile)."""
        return 0 if self._queue is None else self._queue.pending()

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Block until the background compile ended (True) or `timeout` seconds passed (False)."""
        return True if self._queue is None else self._queue.wait(timeout)

    def stop_compiles(self):
        """Start no further background compile (shutdown)."""
        if self._queue is not None:
            self._queue.stop()

    def _padding_batch(self, T: int, N: int, decode: bool, mm: bool = False, penalties: bool = False,
                       masked: bool = False, truncate: bool = False, top_logprobs: bool = False):
        # A one-token chunk on the garbage page / slot 0 fills bucket (T, N) without touching real state;
        # resuming from slot 0 gives the decode-only variant of the same bucket.
        rows = [(0, np.zeros((1, self.config.hidden_size), self.params["embed"].dtype))] if mm else ()
        batch = make_step_batch([SeqChunk([0], 0, [0], 0 if decode else -1, 0, mm=rows)], self.page_size,
                                num_tokens=T, num_seqs=N, max_pages=self.max_pages)
        v = self.config.vocab_size
        sarr = build_sampling_arrays(
            [SamplingParams(temperature=0.0, presence_penalty=0.5 if penalties else 0.0, top_p=0.9 if truncate else 1.0)],
            seeds=[0], num_rows=N, vocab_size=v, prompt_token_ids=[[0]], output_token_ids=[[]],
            penalty_width=self.penalty_width, top_logprobs=top_logprobs,
            allowed_masks=[np.full((v + 31) // 32, 0xFFFFFFFF, np.uint32)] if masked else None)
        return batch, sarr

    def _verify_variants(self, T: int, N: int, decode: bool, mm: bool) -> tuple:
        """The verification programs of warm-up shape (T, N, decode, mm), as their verify_only flags: the general
        one of each text bucket, and the short-chunk one where such a step can land (holds_short_verify)."""
        if not self.spec_width or decode or mm:
            return ()
        return (False, True) if holds_short_verify(T, N, self.token_buckets, self.spec_width) else (False,)

    def _padding_verify_batch(self, T: int, N: int, verify_only: bool = False):
        batch = make_step_batch([SeqChunk([0], 0, [0], -1, 0, spec_slots=[0])], self.page_size, num_tokens=T,
                                num_seqs=N, max_pages=self.max_pages, spec_width=self.spec_width)
        return batch.replace(verify_only=verify_only)

    def _run_padding_verify(self, T: int, N: int, *variant, verify_only: bool = False):
        batch = self._padding_verify_batch(T, N, verify_only)
        _, sarr = self._padding_batch(T, N, False, False, *variant)
        self._note_shape(("verify", T, N, self.spec_width, verify_only))
        self._note_shape(("verify-sample", N, self._variant(sarr)))
        self._call("verify", batch, sarr, np.zeros(N, np.int32), np.zeros((N, self.spec_width - 1), np.int32),
                   np.zeros(N, np.int32))

    def _run_padding_multi(self, T: int, N: int, truncate: bool):
        batch, sarr = self._padding_batch(T, N, True, truncate=truncate)
        self._note_shape(_multi_key(batch, sarr, self.decode_steps))
        self._call("multi", batch, sarr, np.zeros(N, np.int32))

    def _run_padding(self, T: int, N: int, decode: bool, mm: bool = False, penalties: bool = False,
                     masked: bool = False, truncate: bool = False, top_logprobs: bool = False):
        batch, sarr = self._padding_batch(T, N, decode, mm, penalties, masked, truncate, top_logprobs)
        self._note_shape(("step", T, N, batch.decode_only, mm))
        self._note_shape(("sample", N, self._variant(sarr)))
        self._call("step", batch, sarr, np.zeros(N, np.int32))

    # ---- multi-host hook: the one dispatch point of the jitted functions. In a multi-process run
    # process 0 first broadcasts (control, host args) and the followers make this same call
    # (serving/multihost.py); args must be host values (numpy / pytrees of numpy).
    def _call(self, control: str, *args):
        with multihost.leading(control, args):
            if control == "step":
                batch, sarr, counters = args
                step = self._compiled.get(_step_key(batch), self._step)     # warm-up's executable, if any
                logits, self.pools = step(self.params, self.pools, batch, self.last_tokens)
                sample = self._compiled.get(_sampler_key(sarr), self._sample)
                toks, lp, (top_ids, top_vals), self.last_tokens = sample(logits, sarr, self.key_data, counters,
                                                                         self.last_tokens)
                return multihost.settle((toks, lp, top_ids, top_vals))
            if control == "verify":
                batch, sarr, counters, drafts, num_drafts = args
                step = self._compiled.get(_step_key(batch), self._step)
                logits, self.pools = step(self.params, self.pools, batch, self.last_tokens)
                verify = self._compiled.get(_verify_key(sarr, self.spec_width), self._verify)
                toks, acc, lp, (top_ids, top_vals) = verify(logits, sarr, self.key_data, counters, drafts, num_drafts)
                return multihost.settle((toks, acc, lp, top_ids, top_vals))
            if control == "multi":
                batch, sarr, counters = args
                multi = self._compiled.get(_multi_key(batch, sarr, self.decode_steps), self._multi)
                *out, self.last_tokens, self.pools = multi(self.params, self.pools, batch, self.last_tokens, sarr,
                                                           self.key_data, counters)
                return multihost.settle(tuple(out))
            if control == "copy":
                src, dst = args
                self.pools = multihost.settle(self._copy(self.pools, src, dst))
                return None
            raise ValueError(f"unknown runner call {control!r}")
    # ---- end of the multi-host hook
