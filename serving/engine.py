"""LLMEngine: requests in, tokens out. Ties the scheduler, the runner, detokenization and stops.

`add_request` validates and queues one sequence; `step` runs one scheduled model step and
returns a RequestOutput for every request that produced a token (cumulative text and ids, plus
the new ids of this step). Sequences with n > 1 are expanded by the callers (k3jax.offline, the
server) into n requests with seeds seed + i.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
import time
from typing import Optional

import jax

from k3jax.cache import SeqChunk
from serving.engine_args import (EngineArgs, cache_budget, decode_steps_default, default_max_model_len,
                                  device_free_bytes, size_pools, split_budget)
from serving.executable_cache import ExecutableCache
from serving.multimodal import chunk_rows, expand_image_placeholders, image_extra_keys
from serving.prefix_verify import PrefixCacheVerifier
from serving.request import CompletionOutput, Request, RequestOutput, Status
from serving.runner import ModelRunner
from serving.step_shapes import long_buckets, step_buckets, step_temp_bytes
from serving.sampling_params import SamplingParams
from serving.scheduler import QueueFullError, Scheduler, SchedulerConfig
from serving.spec import make_speculator
from serving.stop import StopChecker

log = logging.getLogger(__name__)


def enable_compilation_cache(path: Optional[str]):
    if not path:
        return
    try:
        jax.config.update("jax_compilation_cache_dir", path)
        # every warm-up program, the sampler's variants too (0.2-0.5 s each: 16 per sequence bucket)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    except Exception as e:  # noqa: BLE001 - an older jax without these flags still serves
        log.warning("persistent compilation cache not enabled: %s", e)


class LLMEngine:
    def __init__(self, model, args: EngineArgs | None = None, *, load_model=None, compile_gate=None):
        """load_model: how the entry point loads a model (k3jax.api.load_model), for a draft model
        (speculative="draft"). compile_gate: a threading.Event the background compile (background_compile)
        waits for before each program (a test holds it to look at an engine serving with only the covering set)."""
        self.args = args = args or EngineArgs()
        self.model = model
        c = model.config
        enable_compilation_cache(args.compilation_cache_dir)
        window = c.max_position_embeddings
        chosen = args.max_model_len is None
        # unset: sized after the pools (the activations measured at the window, their upper bound)
        self.max_model_len = window if chosen else min(args.max_model_len, window)
        # the step's shape buckets, computed once here: the activation measurement and the runner use them
        self.token_buckets, self.seq_buckets = step_buckets(
            args.max_num_seqs, args.max_num_batched_tokens, on_cpu=jax.default_backend() == "cpu",
            token_buckets=args.token_buckets, seq_buckets=args.seq_buckets)
        # speculation off: None; a draft model's weights and pools come first, so the cache is sized after them
        self.spec = make_speculator(args, model, self.max_model_len, load_model=load_model)
        weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(model.params))
        weight_dtype = model.params["embed"].dtype
        cache_dtype, mla_dtype = args.cache_dtype(weight_dtype), args.mla_cache_dtype(weight_dtype)
        mesh = getattr(model, "mesh", None)
        seqs_asked = args.max_num_seqs
        num_pages, num_slots = size_pools(args, c, weight_bytes, cache_dtype,
                                          self._activation_bytes(c, weight_bytes, cache_dtype, mesh, mla_dtype),
                                          mla_dtype=mla_dtype)
        if args.max_num_seqs != seqs_asked:     # lowered to the KDA slots beside a long max_model_len
            self.token_buckets, self.seq_buckets = step_buckets(
                args.max_num_seqs, args.max_num_batched_tokens, on_cpu=jax.default_backend() == "cpu",
                token_buckets=args.token_buckets, seq_buckets=args.seq_buckets)
        shards = 1
        if mesh is not None:           # pages and slots split evenly over the data x expert shards
            shards = mesh.shape["data"] * mesh.shape["expert"]
            num_pages, num_slots = (-(-n // shards) * shards for n in (num_pages, num_slots))
        if chosen:
            self.max_model_len, why = default_max_model_len(window, num_pages // shards, args.page_size,
                                                            on_cpu=jax.default_backend() == "cpu")
            if self.max_model_len < 2:
                raise ValueError(f"the cache holds {num_pages // shards - 1} pages of {args.page_size} tokens: no room "
                                 f"for a sequence; raise the cache budget")
            log.info("max_model_len %d: %s", self.max_model_len, why)
        args.max_model_len = self.max_model_len
        # several decode steps per launch for small all-decode batches (see _decode_steps)
        self.decode_steps = args.decode_steps_per_launch or decode_steps_default()
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            page_size=args.page_size, max_model_len=self.max_model_len, prefix_match_unit=args.prefix_match_unit,
            enable_prefix_caching=args.enable_prefix_caching, max_waiting=args.max_waiting,
            state_block_size=args.state_block_size, cache_finished_state=args.cache_finished_state,
            prefix_wait_steps=args.prefix_wait_steps, interactive_prefill_pairs=args.interactive_prefill_pairs,
            long_prefill_tokens=args.long_prefill_tokens,
            encoder_budget=args.encoder_budget or args.max_num_batched_tokens), num_pages, num_slots)
        self.runner = ModelRunner(
            c, model.params, num_pages=num_pages, num_slots=num_slots, page_size=args.page_size,
            max_model_len=self.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_logprobs=args.max_logprobs, seed=args.seed,
            cache_dtype=cache_dtype, mla_cache_dtype=mla_dtype, token_buckets=self.token_buckets,
            seq_buckets=self.seq_buckets, mesh=mesh,
            backend=getattr(model, "backend", None), dense_in_place=args.dense_in_place,
            executable_cache=ExecutableCache(os.path.join(args.compilation_cache_dir, "executables"))
            if args.compilation_cache_dir and args.executable_cache else None,
            spec_width=args.num_speculative_tokens + 1 if args.speculative != "off" else 0,
            decode_steps=self.decode_steps, decode_steps_max_seqs=args.decode_steps_max_seqs,
            long_prefill_tokens=args.long_prefill_tokens)
        self.tokenizer = model.tokenizer
        eos = list(self.tokenizer.stop_ids) if self.tokenizer is not None else [c.eos_token_id]
        self.eos_ids = [e for e in eos if e is not None]
        self.requests: dict[str, Request] = {}
        self._sync_ids: set = set()      # requests that need synchronous steps (see step)
        self._pending = None             # the launched step whose tokens are not fetched yet
        self._ids = itertools.count()
        self._rng = random.Random(args.seed)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "step_time": 0.0,
                         "multi_step_launches": 0}
        self.verifier = (PrefixCacheVerifier(args.verify_prefix_cache, args.verify_prefix_cache_tolerance, seed=args.seed)
                         if args.verify_prefix_cache and args.enable_prefix_caching else None)
        self.host_io = None
        if args.host_cache_bytes and self.scheduler.cache is not None:
            from serving import multihost
            from serving.host_tier import HostCacheIO, HostTier
            if multihost.is_multiprocess():
                raise ValueError("host_cache_bytes: the host-memory tier needs a single-process engine")
            self.host_io = HostCacheIO(self.runner, HostTier(args.host_cache_bytes))
            self.scheduler.attach_host_tier(self.host_io.tier, self.host_io.save)
        self.encoder = None
        if args.vision and getattr(model, "vision", None) is not None:
            from serving.vision_encoder import VisionEncoder
            self.encoder = VisionEncoder(model.vision, cache_bytes=args.encoder_cache_bytes,
                                         out_dtype=weight_dtype, mesh=mesh)
            self.scheduler.is_encoded = self.encoder.cache.__contains__
        self._compiling = False          # programs compile in the background (see _follow_compiles)
        if args.warmup:
            self.runner.warmup(multimodal=self.encoder is not None, threads=args.compile_threads,
                               all_sampler_variants=args.forbid_compile_after_warmup,
                               background=self._background_compile(), gate=compile_gate)
            self._compiling = self.runner.compiles_pending() > 0
            self._follow_compiles()
            if self.encoder is not None:
                self.encoder.warmup()
        self.runner.guard = args.forbid_compile_after_warmup
        if self.encoder is not None:
            self.encoder.guard = args.forbid_compile_after_warmup

    def _background_compile(self) -> bool:
        """EngineArgs.background_compile, resolved: on by default with an accelerator in a single process (in a
        multi-process run every process compiles the same programs in lockstep, at warm-up)."""
        from serving import multihost
        on = self.args.background_compile
        if on and multihost.is_multiprocess():
            raise ValueError("background_compile: a multi-process run compiles every program at warm-up")
        return on if on is not None else jax.default_backend() != "cpu" and not multihost.is_multiprocess()

    def _follow_compiles(self):
        """While programs compile in the background: a lone long prompt's steps only as long as a landed program."""
        if self._compiling:
            self._compiling = self.runner.compiles_pending() > 0
            self.scheduler.long_prefill_tokens = self.runner.long_prefill_limit()

    def compiles_pending(self) -> int:
        """Step programs still compiling in the background (0: every program is ready)."""
        return self.runner.compiles_pending()

    def wait_for_compiles(self, timeout: Optional[float] = None) -> bool:
        """Block until the background compile has ended (True), or `timeout` seconds passed (False). Benchmarks
        call it before timing steady state."""
        return self.runner.wait_for_compiles(timeout)

    def stop_compiles(self):
        """Start no further background compile (shutdown)."""
        self.runner.stop_compiles()

    def _activation_bytes(self, c, weight_bytes: int, cache_dtype, mesh, mla_dtype=None) -> int:
        """Scratch memory of the largest step bucket, measured by an ahead-of-time compile, when the cache
        is sized from device memory (accelerators; CPU has no memory stats and a fixed budget)."""
        args = self.args
        if (args.cache_memory_bytes is not None or (args.num_pages and args.num_slots)
                or device_free_bytes(weight_bytes) is None):
            return 0
        if mesh is not None:
            log.warning("cache sizing: the step's activation memory is not measured on a mesh; "
                        "memory_fraction %.2f of the free memory goes to the cache%s", args.memory_fraction,
                        ", and long_prefill_tokens is off (its larger step is not reserved)"
                        if args.long_prefill_tokens else "")
            args.long_prefill_tokens = 0
            return 0
        tb, sb = self.token_buckets, self.seq_buckets
        from k3jax.layer_stack import stack_layers
        params = jax.eval_shape(lambda p: stack_layers(p, c), self.model.params)   # as the runner holds them

        def measure(T: int, N: int) -> int:
            t0 = time.perf_counter()
            temp = step_temp_bytes(c, params, num_tokens=T, num_seqs=N, page_size=args.page_size,
                                   max_pages=-(-self.max_model_len // args.page_size), cache_dtype=cache_dtype,
                                   mla_cache_dtype=mla_dtype, backend=getattr(self.model, "backend", None))
            log.info("largest step (%d tokens, %d sequences): %.2f GiB of activations (compiled in %.1fs)",
                     T, N, temp / 2**30, time.perf_counter() - t0)
            return temp
        long = long_buckets(tb[-1], args.long_prefill_tokens)
        if long:
            # a lone long prompt's step has the most tokens (activations grow with them: MoE rows, KDA chunk states,
            # the MLA key window); the regular largest step's extra sequences add only their logits rows. It must
            # not cost context: kept when the cache still holds max_model_len (the model's window when unset).
            temp = measure(long[-1], sb[0]) + (sb[-1] - sb[0]) * c.vocab_size * 4
            free = device_free_bytes(weight_bytes)
            pages = split_budget(args, c, cache_budget(args, free, temp), cache_dtype, mla_dtype)[0]
            holds = (pages - 1) * args.page_size
            if holds >= self.max_model_len:
                return temp
            log.warning("long_prefill_tokens %d off: with its step's activations the cache holds %d tokens, under "
                        "the context of %d; lower it, or the context, to keep it", args.long_prefill_tokens,
                        max(holds, 0), self.max_model_len)
            args.long_prefill_tokens = 0
        return measure(tb[-1], sb[-1])

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, extra_keys=None, matcher=None, images=()) -> str:
        """Queue one sequence (params.n must be 1 here). Raises ValueError on bad input,
        serving.scheduler.QueueFullError when the waiting queue is full. `matcher` (structured
        output) gives each step's allowed-token bitmask and is advanced with every sampled token.
        `images` (serving.multimodal.ImageInput, in prompt order) pair with the prompt's
        `<|media_pad|>` placeholders, one each; each pad is widened to the image's token count."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("n: the engine takes one sequence per request; expand n first")
        vocab = self.model.config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} out of range [0, {vocab})")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = prompt
        ids = [int(t) for t in self.model.check_tokens(prompt_ids, ndim=1)]
        placed = []
        if images:
            if self.encoder is None:
                raise ValueError("images: this model has no vision tower" if getattr(self.model, "vision", None)
                                 is None else "images: the engine was started without vision (text only)")
            ids, placed = expand_image_placeholders(ids, images, self.encoder.pad_id)
            extra_keys = _merge_keys(extra_keys, image_extra_keys(placed, self.args.prefix_match_unit))
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room in the context of {self.max_model_len} "
                             f"(max_model_len)")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise ValueError(f"max_tokens: {params.max_tokens} + {len(ids)} prompt tokens exceed the context of "
                             f"{self.max_model_len}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.randrange(2**32)
        req = Request(rid, ids, params, seed, priority=priority, extra_keys=extra_keys, matcher=matcher,
                      images=placed)
        req.stop = StopChecker(params, self.eos_ids)
        if self.tokenizer is not None:
            from k3jax.tokenizer import IncrementalDetokenizer
            req.detok = IncrementalDetokenizer(self.tokenizer, skip_special=True)
        self.scheduler.add(req)
        self.requests[rid] = req
        if matcher is not None or params.uses_penalties:
            self._sync_ids.add(rid)      # the host must see each token before the next sample
        self.counters["prompt_tokens"] += len(ids)
        return rid

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._forget(req)
        self.scheduler.abort(req)
        req.finish_reason = "abort"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one model step; return the outputs of the step whose tokens are known now.

        With async scheduling the next step is scheduled and dispatched while the last one still runs
        on the device: its decode rows take their input tokens from the device (placeholders, see
        _launch), and the host fetches and processes the last step's tokens while the device works.
        Outputs therefore arrive one step() call later. A step falls back to running synchronously
        when some request needs the host to see its tokens before the next sample (structured output,
        penalties)."""
        t0 = time.perf_counter()
        prev, self._pending = self._pending, None
        outputs = []
        # speculation: drafts continue the last token, so the step before must be resolved first
        speculate = self.spec is not None and self.spec.wants_step(self.scheduler.running)
        if self.spec is not None:
            self.spec.tick()
        if prev is not None and (self._sync_ids or speculate):
            outputs += self._resolve(prev)
            prev = None
        cur = self._launch(in_flight=prev is not None, speculate=speculate)
        if prev is not None:
            outputs += self._resolve(prev)
        if cur is not None:
            if self.args.async_scheduling and not self._sync_ids and not cur[2]:
                self._pending = cur
            else:
                outputs += self._resolve(cur)
        self.counters["steps"] += cur is not None
        self.counters["step_time"] += time.perf_counter() - t0
        return outputs

    def _launch(self, in_flight: bool, speculate: bool = False):
        """Schedule and dispatch one step without waiting for it. Every sampled row gets a placeholder
        token -(row + 1) appended to its request (the step's sampled tokens stay on the device; the
        runner substitutes them into the next step's input); _resolve replaces it with the token.
        Returns (device results, [(row, request, output index)], verification rows) or None when nothing
        was scheduled; verification rows (a speculative step, resolved at once) map a row to
        (drafts, chunk start, position slots, spare slots)."""
        if speculate:
            self.spec.propose(self.scheduler.running, self.max_model_len)
        self._follow_compiles()
        out = self.scheduler.schedule()
        if speculate:                  # drafts of requests this step did not schedule are stale next step
            for r in self.scheduler.running:
                r.spec_drafts = []
            short = all(ch.end - ch.start + len(ch.drafts) <= self.runner.spec_width for ch in out.chunks)
            if any(ch.drafts for ch in out.chunks) and not self.runner.can_verify(out.num_tokens, len(out.chunks),
                                                                                  short):
                for ch in out.chunks:  # its verification program is still compiling: a plain step
                    ch.drafts = []
        if out.restores:
            self.host_io.restore(out.restores)
        if not out.chunks:
            if self.scheduler.waiting and not self.scheduler.running and not in_flight and not out.restores:
                raise RuntimeError("cannot schedule any request: the cache pools are too small for one sequence")
            return None
        steps = self._decode_steps(out, speculate)
        self.runner.copy_pages(out.page_copies)
        if out.encode:
            self.encoder.encode(out.encode)
        reqs = [ch.req for ch in out.chunks]
        verify = {}
        for i, (r, ch) in enumerate(zip(reqs, out.chunks)):
            if ch.drafts:              # the state after each fed token: a spare slot each, the last in r.slot
                d = len(ch.drafts)
                verify[i] = (list(ch.drafts), ch.start, r.spec_slots[:d] + [r.slot], r.spec_slots[d:])
        chunks = [SeqChunk(r.token_slice(ch.start, ch.end) + ch.drafts, ch.start, r.page_array(), ch.state_src, r.slot,
                           ch.ckpt_dst, mm=chunk_rows(r.images, ch.start, ch.end, self.encoder.embeddings) if r.images
                           else (), spec_slots=verify[i][2] if i in verify else ())
                  for i, (r, ch) in enumerate(zip(reqs, out.chunks))]
        sampled = [(i, ch.req) for i, ch in enumerate(out.chunks) if ch.sample]
        masks = [r.matcher.allowed_mask() if r.matcher is not None and ch.sample else None
                 for r, ch in zip(reqs, out.chunks)]
        kw = dict(prompt_ids=[r.prompt_ids for r in reqs], output_ids=[r.output_ids for r in reqs], allowed_masks=masks,
                  top_logprobs=self.verifier is not None)       # the prefix-cache check compares top logprobs
        if steps > 1:
            results = self.runner.launch_decode_steps(chunks, [r.params for r in reqs], [r.seed for r in reqs],
                                                      [len(r.output_ids) for r in reqs])
            self.counters["multi_step_launches"] += 1
        elif verify:
            results = self.runner.launch_verify(chunks, [ch.drafts for ch in out.chunks], [r.params for r in reqs],
                                                [r.seed for r in reqs], [len(r.output_ids) for r in reqs], **kw)
            self.spec.stats["spec_steps"] += 1
        else:
            results = self.runner.launch(chunks, [r.params for r in reqs], [r.seed for r in reqs],
                                         [len(r.output_ids) for r in reqs], **kw)
        self.scheduler.after_step(out)
        rows = []
        for i, req in sampled:
            rows.append((i, req, len(req.output_ids)))
            # one placeholder per sampled token; the last one is the next step's input
            req.output_ids.extend([-(i + 1)] * steps)
            req.tokens_in_flight = steps > 1
            req.num_computed += steps - 1            # the launch also fed its first steps-1 sampled tokens
            # its last token is sampled now: nothing more to schedule for it
            req.final_sampled = len(req.output_ids) >= req.params.max_tokens
        return results, rows, verify, steps

    def _decode_steps(self, out, speculate: bool) -> int:
        """How many decode steps the scheduled step runs in one launch: self.decode_steps when nothing
        needs the host between them (every scheduled chunk a plain decode of a request that samples at least
        that many more tokens, with no logprobs, logit bias, penalties or structured output; no speculation, no
        waiting request, no copies, restores or images) and its program is compiled (background_compile), else 1.
        Reserves the pages the extra steps write.
        Stop strings and EOS are checked after the launch (_resolve): a request that stops inside it
        finishes and its surplus tokens are dropped (its KDA state is then not cached, see _append)."""
        k = self.decode_steps
        if (k <= 1 or speculate or self.verifier is not None or not out.chunks or self.scheduler.waiting
                or out.page_copies or out.restores or out.encode or out.preempted
                or not self.runner.can_launch_decode_steps(len(out.chunks))):
            return 1
        for ch in out.chunks:
            r = ch.req
            if (ch.end - ch.start != 1 or not ch.sample or ch.drafts or ch.ckpt_dst or not r.slot
                    or ch.state_src != r.slot or not r.is_decode or r.request_id in self._sync_ids
                    or r.params.logprobs is not None or r.params.logit_bias
                    or r.params.max_tokens - len(r.output_ids) < k):
                return 1
        for ch in out.chunks:
            if not self.scheduler.reserve_pages(ch.req, ch.end + k - 1):
                return 1                 # pages reserved for earlier rows stay with them (used by later steps)
        return k

    def _resolve(self, launched) -> list[RequestOutput]:
        """Fetch a launched step's tokens (waits for the device) and account them to their requests."""
        results, rows, verify, steps = launched
        if verify:
            return self._resolve_verify(results, rows, verify)
        if steps > 1:
            return self._resolve_steps(results, rows, steps)
        toks, lps, top_ids, top_vals = self.runner.fetch(results)
        now = time.monotonic()
        outputs = []
        for i, req, at in rows:
            if req.status == Status.FINISHED:     # aborted, or finished by its previous token
                continue
            if self.verifier is not None and self.verifier.owns(req):
                self.verifier.recomputed(req, top_ids[i], top_vals[i])
                self.scheduler.finish(req)
                continue
            outputs.append(self._append(req, at, int(toks[i]), float(lps[i]), top_ids[i], top_vals[i], now))
        return outputs

    def _resolve_steps(self, results, rows, steps: int) -> list[RequestOutput]:
        """A launch of several decode steps: each row's tokens one by one through the stop checks; the
        tokens after a stop are dropped."""
        toks, lps, top_ids, top_vals = self.runner.fetch(results)
        now = time.monotonic()
        outputs = []
        for i, req, at in rows:
            req.tokens_in_flight = False
            if req.status == Status.FINISHED:
                continue
            new, out = [], None
            for j in range(steps):
                tok = int(toks[i, j])
                new.append(tok)
                out = self._append(req, at + j, tok, float(lps[i, j]), top_ids[i, j], top_vals[i, j], now)
                if req.status == Status.FINISHED:
                    break
            out.metrics["new_token_ids"] = new
            outputs.append(out)
        return outputs

    def _resolve_verify(self, results, rows, verify) -> list[RequestOutput]:
        """A speculative step's tokens: each row's accepted drafts and its bonus or corrected token, one by
        one through the stop checks; the KDA state kept is the one after the last token kept, and pages
        past it go back (serving/spec)."""
        toks, accepted, lps, top_ids, top_vals = self.runner.fetch(results)
        now = time.monotonic()
        outputs = []
        for i, req, at in rows:
            if req.status == Status.FINISHED:
                continue
            if self.verifier is not None and self.verifier.owns(req):
                self.verifier.recomputed(req, top_ids[i, 0], top_vals[i, 0])
                self.scheduler.finish(req)
                continue
            spec = verify.get(i)
            m = int(accepted[i]) if spec is not None else 0
            if spec is not None:
                self.spec.observe(req, len(spec[0]), m)
            new, out = [], None
            for j in range(m + 1):
                tok = int(toks[i, j])
                if spec is not None:
                    self.scheduler.select_position(req, spec[1], spec[2], spec[3], j)
                if j:
                    req.output_ids.append(-1)
                new.append(tok)
                out = self._append(req, at + j, tok, float(lps[i, j]), top_ids[i, j], top_vals[i, j], now)
                if req.status == Status.FINISHED:
                    break
            if spec is not None and req.status != Status.FINISHED:
                self.scheduler.trim_pages(req)
            out.metrics["new_token_ids"] = new
            outputs.append(out)
        return outputs

    def _append(self, req: Request, at: int, tok: int, lp: float, top_ids, top_vals, now: float) -> RequestOutput:
        req.output_ids[at] = tok
        if req.matcher is not None:
            req.matcher.accept(tok)
        self.counters["generation_tokens"] += 1
        if req.first_token_time is None:
            req.first_token_time = now
            if self.verifier is not None:
                self._verify(req, top_ids, top_vals)
        req.last_token_time = now
        k = req.params.logprobs
        if k is not None:
            req.logprobs.append((lp, {int(t): float(v) for t, v in zip(top_ids[:k], top_vals[:k])}))
        delta = req.detok.push(tok) if req.detok is not None else ""
        done = req.stop.append(tok, delta)
        if done is not None:
            del req.output_ids[at + 1:]           # a placeholder of a step in flight: its token is dropped
            req.finish_reason, req.stop_reason = done.finish_reason, done.stop_reason
            # its final state joins the prefix cache when every token the launched steps fed is kept (a
            # launch of several decode steps may have fed tokens past the stop)
            self.scheduler.finish(req, keep_state=req.num_computed <= req.num_tokens)
            self._forget(req)
        return self.output_of(req, new_ids=[tok])

    def _forget(self, req: Request):
        self.requests.pop(req.request_id, None)
        self._sync_ids.discard(req.request_id)
        if self.spec is not None:
            self.spec.forget(req)

    def _verify(self, req: Request, top_ids, top_vals):
        shadow = self.verifier.shadow_for(req, top_ids, top_vals)
        if shadow is not None:
            try:
                self.scheduler.add(shadow)
            except QueueFullError:
                self.verifier.dropped(shadow)

    def output_of(self, req: Request, new_ids=()) -> RequestOutput:
        finished = req.status == Status.FINISHED
        text = req.stop.text if finished or not req.params.stop else req.stop.stream_text()
        if finished and req.detok is not None and req.finish_reason == "length":
            text = req.stop.text + req.detok.flush()
        ids = req.output_ids
        if ids and ids[-1] < 0:           # the placeholder of a step in flight
            ids = ids[:-1]
        comp = CompletionOutput(0, text, list(ids), list(req.logprobs) if req.params.logprobs is not None
                                else None, req.finish_reason, req.stop_reason)
        metrics = {"arrival": req.arrival, "first_token": req.first_token_time, "last_token": req.last_token_time,
                   "new_token_ids": list(new_ids), "num_preemptions": req.num_preemptions}
        # The prompt list is shared, not copied: it never changes, and a copy per step per request
        # costs milliseconds at long contexts.
        return RequestOutput(req.request_id, None, req.prompt_ids, [comp], finished, req.num_cached_tokens, metrics)

    def cache_usage(self) -> dict:
        return self.scheduler.cache_usage()

    def stats(self) -> dict:
        s = self.scheduler.stats()
        s.update(self.counters)
        s["num_compiles"] = self.runner.num_compiles
        s["compiles_pending"] = self.runner.compiles_pending()
        if self.verifier is not None:
            s.update(self.verifier.stats)
        if self.encoder is not None:
            s.update(self.encoder.stats())
        if self.spec is not None:
            s.update(self.spec.metrics())
        return s


def _merge_keys(user, images: dict) -> dict:
    """Per-unit extra keys of the caller (mapping or sequence) plus the images' keys."""
    if user is None:
        return images
    merged = dict(user) if isinstance(user, dict) else {u: tuple(k or ()) for u, k in enumerate(user)}
    for u, keys in images.items():
        merged[u] = tuple(merged.get(u, ())) + tuple(keys)
    return merged
