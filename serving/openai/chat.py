"""POST /v1/chat/completions: prompt rendering, tool choice, structured output, output parsing.

Generated ids go through the reasoning parser (`<think>` ... `</think>`) and, when tools are
offered, the Kimi tool-call parser; both work on ids, so markers never split across deltas.
"""
from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from serving.openai.errors import APIError, bad_request, from_value_error
from serving.openai.generation import ServerState, admit_choices, new_id, stream_choices
from serving.openai.k2_grammar import required_call_grammar as k2_required_call_grammar
from serving.openai.k3_grammar import tool_call_grammar as k3_tool_call_grammar
from serving.openai.k3_parser import count_tool_calls
from serving.openai.protocol import ChatCompletionRequest
from serving.openai.reasoning_parser import OutputStreamParser, parse_output, thinking_started_from_prompt
from serving.openai.sse import DONE, error_event, event
from serving.openai.tool_parser import forced_tool_prefix, merge_deltas, tool_call_to_openai
from serving.stop import StopStringStream, cut_at_stop


def _image_part(part) -> bool:
    # The same test the chat renderer uses to emit an image placeholder.
    return isinstance(part, dict) and (part.get("type") in ("image", "image_url")
                                       or (part.get("type") is None and ("image" in part or "image_url" in part)))


def image_sources(messages) -> list:
    """(message index, part index, url) of every image part, in prompt order."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not _image_part(part):
                continue
            src = part.get("image_url", part.get("image"))
            if isinstance(src, dict):
                src = src.get("url")
            if not isinstance(src, str) or not src:
                raise bad_request(f"messages[{i}].content[{j}]: an image part needs image_url.url",
                                  param=f"messages.{i}.content.{j}", code="invalid_image")
            out.append((i, j, src))
    return out


def render_prompt(state: ServerState, messages, tools, template_kwargs: dict) -> list:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise bad_request(f"messages[{i}]: role must be one of system, user, assistant, tool", param=f"messages.{i}.role")
    extra = sorted(k for k in template_kwargs if k != "thinking")
    try:
        return state.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                   **template_kwargs)
    except TypeError as e:
        if extra and getattr(state.tokenizer, "chat_template", None) is None:   # the built-in template takes `thinking` only
            raise bad_request(f"chat_template_kwargs: this model's chat template takes only 'thinking', not "
                              f"{', '.join(map(repr, extra))}", param="chat_template_kwargs",
                              code="unsupported_template_kwargs")
        raise bad_request(f"messages: cannot render the chat template ({e})", param="messages",
                          code="invalid_conversation")
    except (ValueError, KeyError) as e:
        raise bad_request(f"messages: cannot render the chat template ({e})", param="messages",
                          code="invalid_conversation")


def load_images(state: ServerState, messages) -> list:
    """The request's images (ImageInput, prompt order); bad images are a 400 naming the part."""
    sources = image_sources(messages)
    if not sources:
        return []
    if state.vision is None:
        raise bad_request("this model does not accept images", param="messages", code="images_not_supported")
    from k3jax.vision.media import ImageInputError
    images = []
    for i, j, src in sources:
        try:
            images.append(state.vision.load(src))
        except ImageInputError as e:
            raise bad_request(f"messages[{i}].content[{j}]: {e}", param=f"messages.{i}.content.{j}",
                              code="invalid_image")
    return images


def render_with_images(state: ServerState, messages, tools, template_kwargs: dict) -> tuple[list, list]:
    """(prompt ids, images in prompt order). K3's prompt names each image's size, so its images
    are loaded first and passed to the renderer as K3 image prompts; Kimi's after rendering."""
    if getattr(state.tokenizer, "message_format", "kimi") != "k3":
        prompt = render_prompt(state, messages, tools, template_kwargs)
        return prompt, load_images(state, messages)
    images = load_images(state, messages)
    if images:
        from k3jax.tokenizer.k3_format import image_prompt
        template_kwargs = {**template_kwargs, "image_prompts": [image_prompt(img.size) for img in images]}
    return render_prompt(state, messages, tools, template_kwargs), images


class Plan:
    """Everything decided before generation."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest):
        tok = state.tokenizer
        kwargs = dict(req.chat_template_kwargs or {})
        if req.response_format and req.response_format.get("type") != "text":
            kwargs["thinking"] = False       # the grammar constrains the answer from its first token
        choice = req.tool_choice
        tools = req.tools if req.tools and choice != "none" else None
        k3 = getattr(tok, "message_format", "kimi") == "k3"
        if k3:   # K3's prompt itself states tool_choice and response_format (spec 8b)
            tools = req.tools or None
            if choice in ("required", "none"):
                kwargs.setdefault("tool_choice", choice)
            if req.response_format:
                kwargs.setdefault("response_format", req.response_format)
            effort = (req.model_extra or {}).get("reasoning_effort")   # OpenAI's field: low/high/max, none
            if effort is not None:
                kwargs.setdefault("reasoning_effort", effort)
        self.forced_name: Optional[str] = None
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            names = {(t.get("function") or {}).get("name") for t in (req.tools or [])}
            if not name or name not in names:
                raise bad_request(f"tool_choice names unknown tool {name!r}", param="tool_choice",
                                  code="invalid_tool_choice")
            self.forced_name = name
        if choice in ("required",) or isinstance(choice, dict):
            if not req.tools:
                raise bad_request("tool_choice requires tools", param="tool_choice", code="invalid_tool_choice")
        prompt, self.images = render_with_images(state, req.messages, tools, kwargs)
        self.thinking = thinking_started_from_prompt(tok, prompt, default=state.thinks_by_default)
        self.forced: list = []
        if choice == "required" or self.forced_name:
            self.forced = forced_tool_prefix(tok, self.forced_name, prompt)
            if not k3:   # (K3's prefix closes the open channel itself)
                self.thinking = None              # the forced prefix starts the answer itself
        self.prompt = prompt + self.forced
        self.parse_tools = tools is not None and choice != "none"
        self.call_number = count_tool_calls(req.messages)   # K3 numbers its call ids over the conversation
        # each image's single placeholder becomes num_tokens placeholders in the engine
        self.num_prompt_tokens = len(self.prompt) + sum(img.num_tokens - 1 for img in self.images)
        if self.num_prompt_tokens >= state.max_model_len:
            raise bad_request(f"prompt has {self.num_prompt_tokens} tokens; the context is {state.max_model_len}",
                              param="messages", code="context_length_exceeded")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = req.top_logprobs
        if top is not None and not 0 <= top <= 20:
            raise bad_request("top_logprobs must be between 0 and 20", param="top_logprobs")
        try:
            self.params = req.sampling_params(max_tokens, (top or 0) if req.logprobs else None)
        except ValueError as e:
            raise from_value_error(e)
        self.matcher_factory = None
        fmt = req.response_format
        if self.forced and (k3 or self.forced_name is None):
            # The forced prefix ends inside the tools channel (K3) or the call section (Kimi); a grammar of
            # the calls takes it from there: of the named tool (K3), or of any offered tool ("required"),
            # each call's arguments valid for its tool's schema.
            try:
                if k3:
                    source = k3_tool_call_grammar(tok, req.tools, self.forced_name, req.parallel_tool_calls)
                else:
                    source = k2_required_call_grammar(tok, req.tools, req.parallel_tool_calls)
                self.matcher_factory = state.structured_compiler().compile_lark(source).matcher
            except ImportError as e:
                raise APIError(500, f"structured output unavailable: {e}", type_="server_error")
            except ValueError as e:
                raise bad_request(str(e), param="tools", code="invalid_tools")
            fmt = None
        elif self.forced_name:
            # Named tool choice: the forced prefix ends at <|tool_call_argument_begin|>, so the grammar of
            # that tool's parameters constrains the arguments from the first generated token.
            from serving.structured import grammar_for_tool_call
            try:
                fmt = grammar_for_tool_call(req.tools, self.forced_name)
            except ValueError as e:
                raise bad_request(str(e), param="tools", code="invalid_tools")
        if fmt is not None:     # (non-K3 named tool: the tool's arguments, not a response_format)
            self.matcher_factory = state.response_format_matcher(fmt, self.forced_name)
        try:
            self.matcher_factory = state.request_matcher_factory(req) or self.matcher_factory
        except ValueError as e:
            raise from_value_error(e)

    def parse(self, tok, ids):
        return parse_output(tok, self.forced + list(ids), thinking_started=self.thinking, tools=self.parse_tools
                            or bool(self.forced), first_call_number=self.call_number)

    def stream_parser(self, tok):
        p = OutputStreamParser(tok, thinking_started=self.thinking, tools=self.parse_tools or bool(self.forced),
                               first_call_number=self.call_number)
        first = p.feed(self.forced) if self.forced else []
        return p, first


def _logprob_entries(tok, token_ids, logprobs) -> list:
    """OpenAI chat logprob entries for (token id, (logprob, {top id: logprob})) pairs."""
    def entry(tid, lp):
        text = tok.decode([tid])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    return [{**entry(tid, lp), "top_logprobs": [entry(i, v) for i, v in top.items()]}
            for tid, (lp, top) in zip(token_ids, logprobs)]


def _logprobs(tok, comp) -> Optional[dict]:
    if comp.logprobs is None:
        return None
    return {"content": _logprob_entries(tok, comp.token_ids, comp.logprobs)}


def _finish_reason(comp, calls) -> Optional[str]:
    if comp.finish_reason == "stop" and calls:
        return "tool_calls"
    return comp.finish_reason


def _usage(prompt_len: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _make_plan(state: ServerState, req: ChatCompletionRequest) -> Plan:
    # Rendering, tokenizing and image decoding are CPU work (seconds for a large body): keep them off the
    # event loop that serves /health and streams other requests.
    return await state.offload(Plan, state, req)


async def chat(state: ServerState, req: ChatCompletionRequest) -> dict:
    plan = await _make_plan(state, req)
    rid = new_id("chatcmpl")
    finals = {}
    async for i, out in stream_choices(state, plan.prompt, plan.params, rid, plan.matcher_factory, req.priority,
                                          images=plan.images):
        if out.finished:
            finals[i] = out
    return chat_body(state, plan, finals, rid, int(time.time()))


def chat_body(state: ServerState, plan: Plan, finals: dict, rid: str, created: int) -> dict:
    """The chat.completion object of one request's finished choices ({choice index: RequestOutput})."""
    tok = state.tokenizer
    choices = []
    for i in sorted(finals):
        comp = finals[i].outputs[0]
        parsed = plan.parse(tok, comp.token_ids)
        content = cut_at_stop(parsed.content, comp.stop_reason, plan.params.include_stop_str_in_output)
        msg = {"role": "assistant", "content": content if content or not parsed.tool_calls else None}
        if parsed.reasoning:
            msg["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            msg["tool_calls"] = [tool_call_to_openai(c) for c in parsed.tool_calls]
        choices.append({"index": i, "message": msg, "logprobs": _logprobs(tok, comp),
                        "finish_reason": _finish_reason(comp, parsed.tool_calls), "stop_reason": comp.stop_reason})
    completion = sum(len(f.outputs[0].token_ids) for f in finals.values())
    cached = max((f.num_cached_tokens for f in finals.values()), default=0)
    return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": choices, "usage": _usage(plan.num_prompt_tokens, completion, cached)}


async def chat_stream(state: ServerState, req: ChatCompletionRequest) -> tuple[AsyncIterator[str], list]:
    """(SSE events, the admitted engine streams: whoever sends the events closes them when done)."""
    plan = await _make_plan(state, req)   # request errors surface as a normal 4xx before the stream starts
    rid = new_id("chatcmpl")
    # ... and so do the engine's refusals (ids, context, queue full): admitted before the first byte.
    streams = await admit_choices(state, plan.prompt, plan.params, rid, plan.matcher_factory, req.priority,
                                  images=plan.images)
    created = int(time.time())
    tok = state.tokenizer

    def chunk(i, delta, finish=None, logprobs=None):
        return event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                      "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

    async def gen():
        parsers, sent_lp, contents = {}, {}, {}
        completion, cached = 0, 0
        try:
            for i in range(plan.params.n):
                parsers[i], first = plan.stream_parser(tok)
                contents[i] = StopStringStream(plan.params.stop, plan.params.include_stop_str_in_output)
                merged = merge_deltas(first) or {}
                yield chunk(i, {"role": "assistant", "content": "", **merged})
            async for i, out in stream_choices(state, plan.prompt, plan.params, rid, images=plan.images,
                                               streams=streams):
                comp = out.outputs[0]
                p = parsers[i]
                deltas = p.feed(out.metrics.get("new_token_ids", ()))
                if out.finished:
                    deltas += p.finish()
                delta = merge_deltas(deltas) or {}
                content = contents[i].feed(delta.pop("content", ""), out.finished, comp.stop_reason)
                if content:          # held back while it could be the start of a stop string
                    delta["content"] = content
                lp = None
                if comp.logprobs is not None:               # only the entries not sent yet
                    start = sent_lp.get(i, 0)
                    lp = {"content": _logprob_entries(tok, comp.token_ids[start:], comp.logprobs[start:])}
                    sent_lp[i] = len(comp.logprobs)
                if delta or lp:
                    yield chunk(i, delta or {}, logprobs=lp)
                if out.finished:
                    completion += len(comp.token_ids)
                    cached = max(cached, out.num_cached_tokens)
                    yield chunk(i, {}, finish=_finish_reason(comp, p.tool_calls))
            if req.stream_options and req.stream_options.include_usage:
                yield event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                             "choices": [], "usage": _usage(plan.num_prompt_tokens, completion, cached)})
        except APIError as e:
            yield error_event(e)
        yield DONE
    return gen(), streams
