"""Errors answered in OpenAI's shape, and the typed field access that raises them."""

from __future__ import annotations

import json
from typing import Any


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # extra response headers (Retry-After, WWW-Authenticate)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def optional_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    return False if value is None else as_bool(name, value)


def as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {describe(value)}", name)
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def describe(value: Any) -> str:
    text = json.dumps(value)
    return f"{json_type(value)} {text if len(text) <= 40 else text[:37] + '...'}"


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
