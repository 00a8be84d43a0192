"""The FastAPI application: routes, API-key check, error bodies."""
from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.openai import chat, completions
from serving.openai.errors import APIError, bad_request
from serving.openai.generation import ServerState
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

_OPEN_PATHS = {"/health", "/metrics", "/docs", "/openapi.json"}


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="k3jax", version="0.1.0")
    app.state.k3 = state

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = f"{loc}: {first.get('msg')}" if loc else str(first.get("msg", "invalid request"))
        return _error(bad_request(msg, param=loc))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if state.api_key and request.url.path not in _OPEN_PATHS:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {state.api_key}".encode()):
                return _error(APIError(401, "invalid or missing API key", type_="authentication_error",
                                       code="invalid_api_key"))
        return await call_next(request)

    def _check_model(name):
        if name and name != state.model_name:
            raise APIError(400, f"model {name!r} is not served here (serving {state.model_name!r})",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return JSONResponse({"status": "engine dead"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(state.engine.stats_snapshot), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "k3jax", "max_model_len": state.max_model_len}]}

    async def respond(req, raw: Request, stream, whole):
        """SSE for stream=true, else one JSON body (aborted if the client leaves first)."""
        _check_model(req.model)
        if req.stream:
            return StreamingResponse(await stream(state, req), media_type="text/event-stream")
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
        if req.messages is not None:
            ids, images = await asyncio.to_thread(chat.render_with_images, state, req.messages, None, {})
            if images:                   # each image's placeholder widened to its token count
                from serving.multimodal import expand_image_placeholders
                ids, _ = expand_image_placeholders(ids, images, state.vision.pad_id)
        else:
            ids = state.tokenizer.encode(req.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        _check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < state.tokenizer.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} out of range [0, {state.tokenizer.vocab_size})", param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    return app


async def _until_disconnect(raw: Request, coro):
    """Await a non-streaming handler, aborting it (and freeing its cache) if the client goes away."""
    import asyncio
    task = asyncio.create_task(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            return Response(status_code=499)
