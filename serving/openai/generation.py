"""Run the n choices of one API request on the AsyncEngine and merge their streams (with metrics)."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Optional

from serving.openai.errors import APIError, bad_request, from_value_error
from serving.sampling_params import SamplingParams
from serving.scheduler import QueueFullError
from serving.async_engine import EngineDeadError


@dataclasses.dataclass
class ServerState:
    engine: object                  # AsyncEngine
    tokenizer: object
    model_name: str
    max_model_len: int
    metrics: object
    api_key: Optional[str] = None
    # request_matcher(req, state) -> matcher factory | None: constrains a chat request's output beyond its
    # response_format (None: no such hook; the tests script outputs through it). ValueError: a 400.
    request_matcher: Optional[Callable] = None
    thinks_by_default: bool = True  # output starts inside reasoning unless the prompt says otherwise
    structured: object = None       # StructuredOutputCompiler, built on first use
    vision: object = None           # serving.image_inputs.ImageLoader, when the model has a tower
    max_n: int = 128                # most choices one request may ask for (OpenAI's own cap)
    max_prompts: int = 256          # most prompts in one /v1/completions request
    max_waiting: Optional[int] = None   # the engine's waiting queue: n x prompts of one request must fit
    stream_send_timeout: Optional[float] = None   # end a stream whose client read nothing this long
    max_body_bytes: Optional[int] = 32 << 20   # larger request bodies get 413 (None: no limit)
    prefill_service: object = None  # serving.openai.disagg.PrefillService (--role prefill)
    prefill_peer: object = None     # serving.openai.disagg.PrefillPeer (--role decode)
    # threads for a request's CPU work (parsing, validation, rendering, tokenizing, image decoding), so
    # none of it runs on the event loop; bounded, as Python's default executor is
    workers: int = min(32, (os.cpu_count() or 1) + 4)
    _pool: object = dataclasses.field(default=None, repr=False)
    response_store_size: int = 1024     # Responses API: most stored responses (0: none stored)
    response_store_ttl_s: float = 3600.0   # ... each dropped this long after its last use

    async def offload(self, fn, *args):
        """fn(*args) in the request worker pool."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="k3jax-request")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def request_matcher_factory(self, req):
        """The request_matcher hook's matcher factory for this request (None: none, or no hook)."""
        return None if self.request_matcher is None else self.request_matcher(req, self)

    def response_format_matcher(self, fmt: Optional[dict], tool: Optional[str] = None) -> Optional[Callable]:
        """The matcher factory constraining output to a response_format (None: unconstrained); APIError
        400 for a format llguidance refuses, naming `tools` when `fmt` is the named tool's arguments."""
        if not fmt or fmt.get("type") in (None, "text"):
            return None
        try:
            grammar = self.structured_compiler().compile(fmt)
        except ImportError as e:
            raise APIError(500, f"structured output unavailable: {e}", type_="server_error")
        except ValueError as e:
            if tool is not None:
                raise bad_request(str(e).replace("response_format", f"tools: parameters of {tool!r}", 1),
                                  param="tools", code="invalid_tools")
            raise bad_request(str(e), param="response_format", code="invalid_response_format")
        return grammar.matcher if grammar is not None else None

    def structured_compiler(self):
        if self.structured is None:
            from serving.structured import StructuredOutputCompiler
            self.structured = StructuredOutputCompiler(self.tokenizer)
        return self.structured


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def engine_error(e: BaseException) -> APIError:
    """An engine-side refusal -> the HTTP error a client gets (the same with and without streaming)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, f"server busy: {e}", type_="rate_limit_error", code="queue_full")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), type_="server_error", code="engine_unavailable")
    if isinstance(e, ValueError):
        # The engine refuses what only the model can judge: ids outside its vocabulary, or prompt +
        # max_tokens over its context.
        head = str(e).split(":", 1)[0]
        if head in ("max_tokens", "prompt"):
            return from_value_error(e, "context_length_exceeded")
        if head == "logit_bias":                                   # a biased token id outside the vocabulary
            return from_value_error(e, "invalid_logit_bias")
        return APIError(400, str(e), param="prompt", code="invalid_prompt")   # ("token id 9 out of range": the prompt's)
    raise e


async def admit_choices(state: ServerState, prompt_ids: list, params: SamplingParams, request_id: str,
                        matcher_factory: Optional[Callable] = None, priority: int = 0,
                        extra_keys=None, images=()) -> list:
    """Submit the n choices of one request and wait until the engine has accepted all of them.
    Raises APIError (400 bad ids / too long, 429 queue full, 503) and submits nothing then, so a
    stream can answer with a plain 4xx before its first byte."""
    streams = []
    if state.prefill_peer is not None:
        await state.prefill_peer.prefetch(state.engine, prompt_ids, has_images=bool(images))
    try:
        for i in range(params.n):
            streams.append(state.engine.submit(
                prompt_ids, params.for_child(i), f"{request_id}-{i}", priority=priority, extra_keys=extra_keys,
                matcher=matcher_factory() if matcher_factory else None, images=images))
        results = await asyncio.gather(*(s.admitted() for s in streams), return_exceptions=True)
    except BaseException as e:        # a refusal while submitting, or the client left while waiting
        for s in streams:
            s.close()
        raise engine_error(e) if isinstance(e, Exception) else e
    refused = next((r for r in results if isinstance(r, BaseException)), None)
    if refused is not None:
        for s in streams:
            s.close()
        raise engine_error(refused)
    return streams


class LatestOutputs:
    """The queue between a request's choices and its response: (choice, RequestOutput), errors, and None
    (a choice is done). A choice has at most one output waiting: a newer one replaces it (outputs are
    cumulative, each carrying all ids, text and logprobs so far; their new_token_ids are joined), so a
    response that falls behind its client (a stalled reader) holds O(tokens), not one output per token."""

    def __init__(self):
        self._items: collections.deque = collections.deque()   # [choice, output] slots, errors, None
        self._waiting: dict = {}                                 # choice -> its slot in _items
        self._ready = asyncio.Event()

    def put_output(self, i: int, out):
        slot = self._waiting.get(i)
        if slot is None:
            self._waiting[i] = slot = [i, out]
            self.put(slot)
            return
        new_ids = slot[1].metrics.get("new_token_ids", []) + out.metrics.get("new_token_ids", [])
        out.metrics["new_token_ids"] = new_ids
        slot[1] = out

    def put(self, item):
        self._items.append(item)
        self._ready.set()

    async def get(self):
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, list):
            del self._waiting[item[0]]
            return tuple(item)
        return item


async def stream_choices(state: ServerState, prompt_ids: list, params: SamplingParams, request_id: str,
                         matcher_factory: Optional[Callable] = None, priority: int = 0,
                         extra_keys=None, images=(), streams=None) -> AsyncIterator[tuple]:
    """Yield (choice index, RequestOutput) as tokens arrive, for the n choices of one request
    (admitted here unless `streams` come from admit_choices). Engine-side errors become APIError;
    leaving early (disconnect) aborts every choice."""
    if streams is None:
        streams = await admit_choices(state, prompt_ids, params, request_id, matcher_factory, priority,
                                      extra_keys, images)
    queue = LatestOutputs()
    model = state.metrics.model
    start = time.monotonic()

    async def consume(i: int, stream):
        last = None
        try:
            async for out in stream:
                now = time.monotonic()
                if last is None:
                    state.metrics.ttft.labels(model).observe(now - start)
                else:
                    state.metrics.itl.labels(model).observe(now - last)
                last = now
                state.metrics.generation_tokens.labels(model).inc(len(out.metrics.get("new_token_ids", ())))
                if out.finished:
                    state.metrics.e2e.labels(model).observe(now - start)
                    state.metrics.requests.labels(model, out.outputs[0].finish_reason or "unknown").inc()
                queue.put_output(i, out)
        except (ValueError, QueueFullError, EngineDeadError) as e:
            queue.put(engine_error(e))
        finally:
            stream.close()
            queue.put(None)

    tasks = [asyncio.create_task(consume(i, s)) for i, s in enumerate(streams)]
    state.metrics.prompt_tokens.labels(model).inc(len(prompt_ids) + sum(img.num_tokens - 1 for img in images))
    done = 0
    try:
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for s in streams:
            s.close()
