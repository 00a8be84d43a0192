"""Server-sent events framing for OpenAI streams."""
from __future__ import annotations

import json


def event(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def error_event(err) -> str:
    return event(err.body())
