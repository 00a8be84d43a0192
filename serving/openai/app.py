"""The FastAPI application: routes, API-key check, error bodies."""
from __future__ import annotations

import asyncio
import re
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.openai import anthropic_messages, chat, completions, responses
from serving.openai.auth import APIKeyMiddleware
from serving.openai.body_limit import BodyLimitMiddleware
from serving.openai.errors import APIError, InternalErrorMiddleware, bad_request
from serving.openai.generation import ServerState, engine_error
from serving.openai.openapi import build_openapi
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from serving.openai.request_body import BodyLimits, max_token_chars, offloaded_route_class
from serving.openai.sse import EventStreamResponse

_OPEN_PATHS = {"/health", "/metrics", "/docs", "/openapi.json"}


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _is_union_tag(part) -> bool:
    # pydantic names the union member that failed in `loc` ("str", "list[...]", "ContentPart",
    # "constrained-str"): not a field. (No request field has a "-" in its name.)
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or "-" in part
                                      or part in ("str", "int", "float", "bool", "none"))


def validation_error(errs: list) -> APIError:
    """pydantic / FastAPI validation errors -> one 400 naming a bad field, in JSON terms. Of a union's
    failed alternatives the deepest is the one the client most likely meant, and at equal depth one
    that got the type right but not the value ([-1] as token ids: "must be >= 0", not "not a string")."""
    def path(err):
        return [str(x) for x in err.get("loc", ())[1:] if not _is_union_tag(x)]

    def rank(err):
        return len(path(err)), not str(err.get("type", "")).endswith("_type")
    first = max(errs, key=rank) if errs else {}
    if first.get("type") == "json_invalid":          # loc holds the character position, not a field
        pos = (first.get("loc") or (None, None))[-1]
        why = (first.get("ctx") or {}).get("error", "JSON decode error").removesuffix(" at")   # ("... control character at")
        return bad_request(f"the request body is not valid JSON: {why} at character {pos}", code="invalid_json")
    # protocol.field_error: a check of the whole model that names the field below it, and its code
    field = (first.get("ctx") or {}).get("field")
    loc = ".".join(path(first) + ([field] if field else [])) or None
    if loc is None and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return bad_request("the request body must be a JSON object (with Content-Type: application/json)",
                           code="invalid_json")
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    msg = re.sub(r" or instance of \w+", "", msg)
    return bad_request(f"{loc}: {msg}" if loc else msg, param=loc, code=first.get("type") if field is not None else None)


_HTTP_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                     429: "rate_limit_error"}


def check_model(state: ServerState, name) -> None:
    if name == "":
        raise APIError(400, f"model must name the served model ({state.model_name!r}), not be empty",
                       param="model", code="model_not_found")
    if name and name != state.model_name:
        raise APIError(400, f"model {name!r} is not served here (serving {state.model_name!r})",
                       param="model", code="model_not_found")


def check_generation_request(state: ServerState, req) -> None:
    """The checks a chat or text completion request gets before its handler: model, n, number of prompts,
    stop ids."""
    check_model(state, req.model)
    if req.n > state.max_n:
        raise bad_request(f"n: at most {state.max_n} choices per request, got {req.n}", param="n")
    prompts = getattr(req, "num_prompts", 1)
    if prompts > state.max_prompts:
        raise bad_request(f"prompt: at most {state.max_prompts} prompts per request, got {prompts}", param="prompt",
                          code="too_many_prompts")
    if state.max_waiting is not None and req.n * prompts > state.max_waiting:
        # more sequences than the waiting queue holds: a 429 would say "retry", and no retry can succeed
        param = "n" if req.n > 1 else "prompt"
        what = f"n x prompts: {req.n} x {prompts} = " if req.n > 1 and prompts > 1 else f"{param}: "
        raise bad_request(f"{what}{req.n * prompts} sequences, more than the server queues ({state.max_waiting})",
                          param=param, code="too_many_choices")
    vocab = state.tokenizer.vocab_size
    if any(t >= vocab for t in req.stop_token_ids or ()):
        raise bad_request(f"stop_token_ids: ids must be below the vocabulary size {vocab}", param="stop_token_ids")


def build_app(state: ServerState) -> FastAPI:
    max_body_bytes = state.max_body_bytes
    app = FastAPI(title="k3jax", version="0.1.0")
    app.state.k3 = state
    # routes with a JSON body: parsed, limited and validated off the event loop (serving/openai/request_body.py)
    limits = BodyLimits(state.max_model_len, state.max_prompts, max_token_chars(state.tokenizer))
    app.router.route_class = offloaded_route_class(state.offload, limits)
    app.openapi = lambda: build_openapi(app, vocab_size=state.tokenizer.vocab_size, max_n=state.max_n,
                                          max_prompts=state.max_prompts, model_name=state.model_name)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        return _error(validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        # Routing and body-parsing errors (404, 405, 413, a body that is not UTF-8 or nests too deep) in
        # the OpenAI error shape rather than FastAPI's {"detail": ...}.
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        err = APIError(e.status_code, str(e.detail), type_=_HTTP_ERROR_TYPES.get(e.status_code, "invalid_request_error"),
                       code=code)
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    if max_body_bytes:
        async def refuse(scope, receive, send, exc):
            await (await _http_error(None, exc))(scope, receive, send)
        app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, refuse=refuse)

    if state.api_key:
        async def unauthorized(scope, receive, send):
            await _error(APIError(401, "invalid or missing API key", type_="authentication_error",
                                  code="invalid_api_key"))(scope, receive, send)
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key, open_paths=_OPEN_PATHS, refuse=unauthorized)

    app.add_middleware(InternalErrorMiddleware)     # last: outermost, so it sees every other layer's errors

    def _check_model(name):
        check_model(state, name)

    @app.head("/health", include_in_schema=False)        # load balancers probe with HEAD too
    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return JSONResponse({"status": "engine dead", "error": state.engine.dead_reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        stats = state.engine.stats_snapshot
        if state.prefill_peer is not None:
            stats = {**stats, **state.prefill_peer.stats}
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4")

    if state.prefill_service is not None:
        @app.post("/internal/prefill", include_in_schema=False)
        async def internal_prefill(request: Request):
            """--role prefill: compute a prompt and offer its prefix-cache entry (serving/openai/disagg.py)."""
            try:
                body = await request.json()
                ids = body["prompt_token_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                    raise ValueError
            except Exception:  # noqa: BLE001 - any malformed body is the same 400
                raise APIError(400, "prompt_token_ids: expected a non-empty list of token ids",
                               param="prompt_token_ids") from None
            try:
                return await state.prefill_service.prefill(state.engine, ids)
            except Exception as e:  # noqa: BLE001 - engine refusals become their 4xx / 503
                raise engine_error(e) from e

    def model_card():
        return {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "k3jax",
                "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")        # :path: served names may hold "/" (org/model)
    async def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(404, f"model {model_id!r} is not served here (serving {state.model_name!r})",
                           type_="not_found_error", param="model", code="model_not_found")
        return model_card()

    async def respond(req, raw: Request, stream, whole):
        """SSE for stream=true, else one JSON body (aborted if the client leaves first)."""
        check_generation_request(state, req)
        if req.stream:
            events, streams = await stream(state, req)
            return EventStreamResponse(events, streams, send_timeout=state.stream_send_timeout)
        return await _until_disconnect(raw, whole(state, req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await respond(req, raw, chat.chat_stream, chat.chat)

    @app.post("/v1/completions")
    async def text_completions(req: CompletionRequest, raw: Request):
        return await respond(req, raw, completions.complete_stream, completions.complete)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        _check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        return await state.offload(_tokenize, req)

    def _tokenize(req: TokenizeRequest) -> dict:
        if req.messages is not None:
            ids, images = chat.render_with_images(state, req.messages, None, {})
            if images:                   # each image's placeholder widened to its token count
                from serving.multimodal import expand_image_placeholders
                ids, _ = expand_image_placeholders(ids, images, state.vision.pad_id)
        else:
            ids = state.tokenizer.encode(req.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        _check_model(req.model)
        return await state.offload(_detokenize, req.tokens)

    def _detokenize(ids: list) -> dict:
        vocab = state.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} out of range [0, {vocab})", param="tokens", code="invalid_token_id")
        return {"prompt": state.tokenizer.decode(ids)}

    # (last: the Messages API's error-shape middleware must wrap the key check and the body limit)
    responses.add_routes(app, state, until_disconnect=_until_disconnect, check=check_generation_request)
    anthropic_messages.add_routes(app, state, until_disconnect=_until_disconnect, check=check_generation_request)
    return app


async def _until_disconnect(raw: Request, coro):
    """Await a non-streaming handler, aborting it (and freeing its cache) as soon as the client goes away."""
    task = asyncio.create_task(coro)
    left = asyncio.create_task(_disconnected(raw))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        left.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return Response(status_code=499)


async def _disconnected(raw: Request):
    # the body has been read: what the server sends next is http.disconnect
    while (await raw.receive())["type"] != "http.disconnect":
        pass
