"""The OpenAPI document as the server really answers: errors are 400 (not FastAPI's 422) in the
OpenAI error shape, plus 401 / 404 / 413 / 429 / 503 where they can happen; /metrics is
Prometheus text; streamed completions are text/event-stream."""
from __future__ import annotations

from fastapi.openapi.utils import get_openapi

_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERROR_REF = {"$ref": "#/components/schemas/OpenAIError"}

# Schema-valid requests can still get a 400 for what only the model and the content decide; the
# error's code says which (schemathesis' positive-data check in the tests accepts exactly these).
SEMANTIC_400_CODES = {
    "context_length_exceeded": "prompt (+ max_tokens) longer than the model's context",
    "invalid_prompt": "token ids the model cannot take",
    "invalid_logit_bias": "logit_bias token ids outside the model's vocabulary",
    "invalid_conversation": "a conversation the chat template cannot render (e.g. a tool result answering no call)",
    "invalid_image": "an image part whose URL is not a usable image (or is not allowed)",
    "images_not_supported": "image parts sent to a text-only model",
    "invalid_tool_choice": "tool_choice naming a tool that is not in tools",
    "invalid_tools": "a forced tool whose parameters schema cannot be compiled",
    "invalid_response_format": "a response_format schema that cannot be compiled to a grammar",
    "model_not_found": "a model name other than the served one",
    "too_many_choices": "n x the number of prompts over the server's waiting queue (--max-waiting)",
    "invalid_unicode": "a string holding a lone UTF-16 surrogate (JSON \\ud800-\\udfff unpaired)",
    "unsupported_template_kwargs": "chat_template_kwargs keys this model's chat template does not take",
}

_ERRORS = {
    "400": "Invalid request: a bad field, type, value or body; or (schema-valid, see error.code) "
           + "; ".join(f"{k}: {v}" for k, v in SEMANTIC_400_CODES.items()),
    "401": "Missing or wrong API key",
    "413": "Request body over the server's limit",
}
_GENERATION_ERRORS = {
    "429": "The waiting queue is full; retry later",
    "503": "The engine is not running",
}
_STREAMING = {"/v1/chat/completions", "/v1/completions"}
_OPEN = {"/health", "/metrics"}


def _error_response(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def build_openapi(app, vocab_size: int, max_n: int, max_prompts: int = None, model_name: str = None) -> dict:
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _served_limits(schema, vocab_size, max_n, max_prompts)
    schema.setdefault("components", {}).setdefault("schemas", {})["OpenAIError"] = _ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path in _OPEN:
                continue
            errors = dict(_ERRORS) if method == "post" else {"401": _ERRORS["401"]}
            if path in _STREAMING:
                errors.update(_GENERATION_ERRORS)
                # no type: each event's data is a chunk object, an error object or the string [DONE]
                # (schemathesis validates every event against this; "string" failed every chunk)
                responses["200"]["content"]["text/event-stream"] = {
                    "schema": {"description": "server-sent events when stream is true: chat.completion.chunk / "
                                              "text_completion objects, an error object, then [DONE]"}}
            if "{" in path:
                errors["404"] = "No such model"
                for param in op.get("parameters", ()):
                    if param.get("name") == "model_id" and model_name:
                        param["schema"]["enum"] = [model_name]
            for code, text in errors.items():
                responses.setdefault(code, _error_response(text))
    paths = schema.get("paths", {})
    if "/metrics" in paths:
        paths["/metrics"]["get"]["responses"]["200"] = {
            "description": "Prometheus metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}
    if "/health" in paths:
        paths["/health"]["get"]["responses"]["503"] = {
            "description": "The engine has stopped", "content": {"application/json": {"schema": {"type": "object"}}}}
    app.openapi_schema = schema
    return schema


def _served_limits(schema: dict, vocab_size: int, max_n: int, max_prompts: int = None):
    """Bounds that depend on the served model and flags: token ids below the vocabulary size, n <= --max-n,
    at most --max-prompts-per-request prompts."""
    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0 and node.get("title") is None \
                    and "maximum" not in node:
                node["maximum"] = vocab_size - 1           # TokenId items (the only untitled ints >= 0)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    comps = schema.get("components", {}).get("schemas", {})
    walk(comps)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        if name in comps:
            n = comps[name]["properties"]["n"]
            for alt in n.get("anyOf", [n]):       # n is an integer or null (null = 1)
                if alt.get("type") == "integer":
                    alt["maximum"] = max_n
    if max_prompts and "CompletionRequest" in comps:
        for alt in comps["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
            if alt.get("type") == "array" and alt["items"].get("type") != "integer":   # a list of prompts
                alt["maxItems"] = max_prompts
