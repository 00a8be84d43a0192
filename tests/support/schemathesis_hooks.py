"""Schemathesis hooks for the server's schema run (tests/serving/test_server.py): loaded by `st run` through
SCHEMATHESIS_HOOKS. Replaces the positive-data check with one that knows the server's documented
semantic refusals (serving.openai.openapi.SEMANTIC_400_CODES)."""
import schemathesis

from serving.openai.openapi import SEMANTIC_400_CODES


@schemathesis.check
def schema_valid_accepted_or_documented_refusal(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or any(
            c.mode.is_negative for c in meta.components.values()):      # coverage cases negate single parts
        return None
    status = response.status_code
    if status < 300 or status in (413, 429):      # body limit and full queue are documented and not about the data
        return None
    code = None
    if status == 400:
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            pass
        if code in SEMANTIC_400_CODES:
            return None
    raise AssertionError(f"schema-valid request refused with {status} (code {code!r}): {response.text[:400]}")


# Generation runs to the context limit when max_tokens is absent: on the 2-core CPU test machine
# that is a minute per request. Schema-valid lengths are capped so the run covers more cases.
@schemathesis.hook
def map_body(ctx, body):
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if v is None or (isinstance(v, int) and not isinstance(v, bool) and 4 < v <= 2**53):
                body[key] = 4
    return body
