"""Request bodies parsed, limited and validated off the event loop; responses rendered there too.

FastAPI parses a JSON body (json.loads), validates it (pydantic) and renders the response
(jsonable_encoder + json.dumps) on the event loop: for a large body (millions of token ids, 100,000s
of messages, a 30 MiB prompt) that stalled every other request, /health included, for seconds.
`offloaded_route_class` makes routes whose endpoint takes a pydantic body do all three in a bounded
thread pool (`ServerState.offload`), with cheap limits checked on the parsed JSON before pydantic
sees it (`BodyLimits`: ids, prompts, messages and characters against the model's context).

A thread only helps where the work returns to the interpreter often enough to hand the GIL over:
json.loads is one C call that holds it throughout (5M token ids: ~1 s). So a body over LARGE_BODY
is parsed with Python hooks for numbers and objects, which the C parser calls per value (the
interpreter switches threads there) and which count the numbers, stopping the parse once a route
that carries token ids (/v1/completions, /detokenize) has more than can fit. Bodies up to INLINE_BODY are parsed on the loop (a few ms at most;
no queueing behind large ones in the pool).
"""
from __future__ import annotations

import dataclasses
import email.message
import json
from typing import Callable, Optional

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from serving.openai.errors import APIError, bad_request

INLINE_BODY = 64 << 10
LARGE_BODY = 1 << 20
_OTHER_NUMBERS = 4096        # numbers a body may hold besides its token ids (sampling fields, extras)


def max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: its longest ordinary token's bytes, or special
    token's name. A text of C characters is at least C / this many tokens."""
    longest = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.num_ordinary))
    return max([longest, *map(len, getattr(tokenizer, "special_ids", ()))])


@dataclasses.dataclass(frozen=True)
class BodyLimits:
    """What a request can hold and still fit the model: checked on the parsed JSON, before validation,
    tokenizing or rendering. Each check is exact (never refuses what could fit): a chat message renders to
    at least one token, and C characters of text to at least C / max_token_chars tokens."""
    max_model_len: int
    max_prompts: int
    max_token_chars: int

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.max_token_chars

    def too_long(self, param: str, what: str) -> APIError:
        return bad_request(f"{param}: {what}; the context is {self.max_model_len} tokens", param=param,
                           code="context_length_exceeded")

    def check_text(self, text, param: str) -> None:
        if isinstance(text, str) and len(text) > self.max_chars:
            raise self.too_long(param, f"{len(text)} characters are more than {self.max_model_len} tokens (a "
                                       f"token stands for at most {self.max_token_chars} characters)")

    def check_ids(self, ids, param: str) -> None:
        if isinstance(ids, list) and len(ids) >= self.max_model_len and type(ids[0]) is int:
            raise bad_request(f"prompt has {len(ids)} tokens; the context is {self.max_model_len}", param=param,
                              code="context_length_exceeded")

    def check_messages(self, messages) -> None:
        if not isinstance(messages, list):
            return
        if len(messages) > self.max_model_len:
            raise self.too_long("messages", f"{len(messages)} messages (each at least one token)")
        chars = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p) if isinstance(p, str) else len(p.get("text") or "")
                             if isinstance(p, dict) and isinstance(p.get("text"), str) else 0 for p in content)
        if chars > self.max_chars:
            raise self.too_long("messages", f"{chars} characters of content are more than {self.max_model_len} "
                                            f"tokens (a token stands for at most {self.max_token_chars} characters)")

    # per route: (the check of the parsed body, the most numbers the body may hold, its main field)
    def chat(self, body: dict) -> None:
        self.check_messages(body.get("messages"))

    def tokenize(self, body: dict) -> None:
        self.check_messages(body.get("messages"))
        self.check_text(body.get("prompt"), "prompt")

    def completions(self, body: dict) -> None:
        p = body.get("prompt")
        if isinstance(p, list) and p and type(p[0]) is not int:      # a list of prompts
            if len(p) > self.max_prompts:
                raise bad_request(f"prompt: at most {self.max_prompts} prompts per request, got {len(p)}",
                                  param="prompt", code="too_many_prompts")
            for x in p:
                self.check_text(x, "prompt")
                self.check_ids(x, "prompt")
        else:
            self.check_text(p, "prompt")
            self.check_ids(p, "prompt")

    def detokenize(self, body: dict) -> None:
        ids = body.get("tokens")
        if isinstance(ids, list) and len(ids) > self.max_model_len:
            raise self.too_long("tokens", f"{len(ids)} token ids")

    def for_path(self, path: str):
        """(check, number budget or None, param) of a route, or None. Only where token ids are what the body
        carries is there a budget: a chat request's numbers (tool schemas, extras) say nothing of its length."""
        return {"/v1/chat/completions": (self.chat, None, "messages"),
                "/tokenize": (self.tokenize, None, "prompt"),
                "/v1/completions": (self.completions, self.max_prompts * self.max_model_len, "prompt"),
                "/detokenize": (self.detokenize, self.max_model_len, "tokens")}.get(path)


class _TooManyNumbers(Exception):
    pass


def _loads_yielding(body: bytes, budget: Optional[int]):
    """json.loads with per-value Python hooks (the GIL can pass to other threads at each) that stop the
    parse after `budget` numbers (None: no limit)."""
    count = 0
    budget = float("inf") if budget is None else budget

    def number(kind):
        def parse(text):
            nonlocal count
            count += 1
            if count > budget:
                raise _TooManyNumbers
            return kind(text)
        return parse
    return json.loads(body, parse_int=number(int), parse_float=number(float), object_pairs_hook=lambda kv: dict(kv))


def _is_json(content_type: Optional[str]) -> bool:
    # FastAPI's rule: application/json or application/*+json; anything else is not parsed
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_body(body: bytes, content_type: Optional[str], model, limits=None):
    """Raw request body -> a validated `model`, as FastAPI would (the same errors, which the app turns into
    its 400s), with `limits` = (check, number budget, param) applied on the way."""
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    if not _is_json(content_type):
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",), "input": body,
                                       "msg": "Input should be a valid dictionary or object to extract fields from"}])
    check, budget, param = limits or (None, None, None)
    try:
        if len(body) > LARGE_BODY:
            data = _loads_yielding(body, None if budget is None else budget + _OTHER_NUMBERS)
        else:
            data = json.loads(body)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from None
    except _TooManyNumbers:
        raise bad_request(f"{param}: the request holds more than {budget} numbers, more token ids than can fit",
                          param=param, code="context_length_exceeded") from None
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})",
                          code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body nests too deep to parse", code="invalid_json") from None
    except ValueError as e:     # e.g. an integer of more digits than Python converts
        raise bad_request(f"the request body is not valid JSON: {str(e).splitlines()[0][:200]}",
                          code="invalid_json") from None
    except Exception as e:  # noqa: BLE001 - anything else the parser refuses
        raise bad_request(f"the request body could not be parsed ({type(e).__name__})", code="invalid_json") from e
    if check is not None and isinstance(data, dict):
        check(data)
    try:
        return model.model_validate(data, from_attributes=True)     # (as FastAPI validates a body)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors(include_url=False)]) from None


def offloaded_route_class(offload: Callable, limits: Optional[BodyLimits]) -> type:
    """An APIRoute class: an endpoint `async def f(req: Model, raw: Request)` gets its body read on the loop,
    then parsed, limited and validated through `offload` (an async fn(callable, *args) running it in the
    pool), and a plain (dict) result rendered to JSON there too. Other routes are FastAPI's own."""

    class OffloadedRoute(APIRoute):
        def get_route_handler(self):
            d, params = self.dependant, self.dependant.body_params
            if len(params) != 1 or d.path_params or d.query_params or d.header_params or d.cookie_params \
                    or d.dependencies or d.background_tasks_param_name or d.response_param_name:
                return super().get_route_handler()     # (only `f(req: Model[, raw: Request])` is taken over)
            body_name, model = params[0].name, params[0].field_info.annotation
            request_name = self.dependant.request_param_name
            endpoint, path_limits = self.endpoint, limits.for_path(self.path) if limits else None

            async def handler(request: Request) -> Response:
                body = await request.body()
                args = (body, request.headers.get("content-type"), model, path_limits)
                req = parse_body(*args) if len(body) <= INLINE_BODY else await offload(parse_body, *args)
                kwargs = {body_name: req, **({request_name: request} if request_name else {})}
                result = await endpoint(**kwargs)
                if isinstance(result, Response):
                    return result
                return await offload(lambda: JSONResponse(jsonable_encoder(result)))
            return handler
    return OffloadedRoute
