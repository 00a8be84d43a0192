"""POST /v1/completions (legacy text completions), streaming and not."""
from __future__ import annotations

import time
from typing import AsyncIterator

from serving.openai.errors import APIError, bad_request, from_value_error
from serving.openai.generation import ServerState, admit_choices, new_id, stream_choices
from serving.openai.protocol import CompletionRequest
from serving.openai.sse import DONE, error_event, event


def _prompts(state: ServerState, req: CompletionRequest) -> list:
    """Each prompt's ids. Text is plain text: a special-token string in it stays text, as in chat messages
    (k3jax/tokenizer/client_text.py); a client that wants control tokens sends token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [state.tokenizer.encode(p)]
    if not p:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(x, str) for x in p):
        return [state.tokenizer.encode(x) for x in p]
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return [list(x) for x in p]


def _logprobs(state, out, k, start: int = 0, offset: int = 0):
    """The legacy logprobs object of the choice's tokens from `start` on (a stream sends each token's
    entry once); `offset`: where those tokens' text starts in the completion."""
    if k is None:
        return None
    c = out.outputs[0]
    toks = [state.tokenizer.decode([t]) for t in c.token_ids[start:]]
    offs, pos = [], offset
    for t in toks:
        offs.append(pos)
        pos += len(t)
    return {"tokens": toks, "token_logprobs": [lp for lp, _ in c.logprobs[start:]],
            "top_logprobs": [{state.tokenizer.decode([i]): v for i, v in top.items()} for _, top in c.logprobs[start:]],
            "text_offset": offs}


def prepare(state: ServerState, req: CompletionRequest):
    """Validate a request: (SamplingParams, [prompt ids], matcher factory or None); APIError for what a
    client must fix."""
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_request("logprobs must be between 0 and 20", param="logprobs")
    try:
        params = req.sampling_params(req.max_tokens if req.max_tokens is not None else 16, req.logprobs)
    except ValueError as e:
        raise from_value_error(e)
    prompts = _prompts(state, req)
    for ids in prompts:
        if len(ids) >= state.max_model_len:
            raise bad_request(f"prompt has {len(ids)} tokens; the context is {state.max_model_len}", param="prompt",
                              code="context_length_exceeded")
    return params, prompts, state.response_format_matcher(req.response_format)


async def _admit(state: ServerState, req: CompletionRequest, rid: str):
    """Validate (off the event loop: tokenizing is CPU work) and have the engine accept every prompt's
    choices, so refusals are a 4xx before any output, streaming or not. Returns (params, [(ids, streams)])."""
    params, prompts, matcher_factory = await state.offload(prepare, state, req)
    admitted = []
    try:
        for p_i, ids in enumerate(prompts):
            admitted.append((ids, await admit_choices(state, ids, params, f"{rid}-{p_i}", matcher_factory,
                                                      priority=req.priority)))
    except BaseException:
        _close(admitted)
        raise
    return params, admitted


def _close(admitted):
    for _, streams in admitted:
        for s in streams:
            s.close()


async def complete(state: ServerState, req: CompletionRequest) -> dict:
    rid = new_id("cmpl")
    params, admitted = await _admit(state, req, rid)
    results = []
    for p_i, (ids, streams) in enumerate(admitted):
        finals = {}
        try:
            async for i, out in stream_choices(state, ids, params, f"{rid}-{p_i}", streams=streams):
                if out.finished:
                    finals[i] = out
        except BaseException:             # disconnect or engine error: the later prompts' choices go too
            _close(admitted)
            raise
        results.append((ids, finals))
    return completion_body(state, req, params, results, rid, int(time.time()))


def completion_body(state: ServerState, req: CompletionRequest, params, results: list, rid: str, created: int) -> dict:
    """The text_completion object of one request: results = [(prompt ids, {choice index: RequestOutput})]."""
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for p_i, (ids, finals) in enumerate(results):
        usage["prompt_tokens"] += len(ids)
        usage["cached_tokens"] += max((o.num_cached_tokens for o in finals.values()), default=0)
        for i in sorted(finals):
            c = finals[i].outputs[0]
            usage["completion_tokens"] += len(c.token_ids)
            text = (state.tokenizer.decode(ids) if req.echo else "") + c.text
            choices.append({"index": p_i * params.n + i, "text": text, "logprobs": _logprobs(state, finals[i], req.logprobs),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
            "choices": choices, "usage": _usage(usage)}


def _usage(u: dict) -> dict:
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


async def complete_stream(state: ServerState, req: CompletionRequest) -> tuple[AsyncIterator[str], list]:
    """(SSE events, the admitted engine streams: whoever sends the events closes them when done)."""
    rid = new_id("cmpl")
    params, admitted = await _admit(state, req, rid)   # errors here become a normal 4xx response
    created = int(time.time())

    async def gen():
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        try:
            for p_i, (ids, streams) in enumerate(admitted):
                sent, sent_lp = {}, {}       # per choice: chars of text, (tokens, chars) of logprobs sent
                echoed = set()
                usage["prompt_tokens"] += len(ids)
                async for i, out in stream_choices(state, ids, params, f"{rid}-{p_i}", streams=streams):
                    c = out.outputs[0]
                    text = c.text[sent.get(i, 0):]
                    sent[i] = len(c.text)
                    idx = p_i * params.n + i
                    if req.echo and i not in echoed:     # (a choice's first output may hold several tokens)
                        echoed.add(i)
                        text = state.tokenizer.decode(ids) + text
                    if text or out.finished:
                        start, offset = sent_lp.get(i, (0, 0))
                        lp = _logprobs(state, out, req.logprobs, start, offset)
                        if lp is not None:
                            sent_lp[i] = (len(c.token_ids), offset + sum(map(len, lp["tokens"])))
                        yield event({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                                     "choices": [{"index": idx, "text": text, "logprobs": lp,
                                                  "finish_reason": c.finish_reason if out.finished else None}]})
                    if out.finished:
                        usage["completion_tokens"] += len(c.token_ids)
                        usage["cached_tokens"] = max(usage["cached_tokens"], out.num_cached_tokens)
            if req.stream_options and req.stream_options.include_usage:
                yield event({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                             "choices": [], "usage": _usage(usage)})
        except APIError as e:
            yield error_event(e)
        finally:
            _close(admitted)
        yield DONE
    return gen(), [s for _, streams in admitted for s in streams]
