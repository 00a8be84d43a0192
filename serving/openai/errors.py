"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from typing import Optional


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(e: ValueError, code: Optional[str] = None) -> APIError:
    """ValueErrors raised by validation start with the field name ("max_tokens: ..."): keep it as param."""
    msg = str(e)
    head = msg.split(":", 1)[0].split()[0] if msg else None
    param = head if head and head.replace("_", "").isalnum() and head.islower() else None
    return bad_request(msg, param=param, code=code)
