"""The kinds of value a request field can hold: how one JSON value is read (or refused with a 400
naming the field) and how it is described in JSON Schema. ``fields`` declares fields with them."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from services.frontend.errors import as_bool, bad_request, describe, is_int, json_type


class Kind(Protocol):
    """Reads one JSON value (never ``None``) or raises ``APIError`` naming ``name``; ``schema`` is
    its JSON Schema, or ``None`` for a field that is read but not advertised. ``has_default``: a
    field's default is a JSON value of this kind, so the schema states it."""

    has_default: bool

    def read(self, name: str, value: Any) -> Any: ...
    def schema(self) -> dict[str, Any] | None: ...


def _number_text(value: float) -> float | int:
    """2.0 -> 2 in schemas (the bounds read as the messages say them)."""
    return int(value) if float(value).is_integer() else value


@dataclass(frozen=True)
class Integer:
    """An integer (``16.0`` reads as 16, as some JSON encoders write it) in ``[minimum, maximum]``.
    ``rule`` words the range when the bounds alone would not say it well."""

    minimum: int | None = None
    maximum: int | None = None
    rule: str | None = None
    has_default = True

    def read(self, name: str, value: Any) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not is_int(value):
            raise bad_request(f"{name} must be an integer, got {describe(value)}", name)
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            raise bad_request(f"{name} {self.rule or self._range_words()}, got {value}", name)
        return value

    def _range_words(self) -> str:
        if self.maximum is None:
            return f"must be at least {self.minimum}"
        return f"must be between {self.minimum} and {self.maximum}"

    def schema(self) -> dict[str, Any]:
        bounds = {"minimum": self.minimum, "maximum": self.maximum}
        return {"type": "integer"} | {k: v for k, v in bounds.items() if v is not None}


@dataclass(frozen=True)
class Number:
    """A finite number in ``[minimum, maximum]``, or ``(minimum, maximum]``."""

    minimum: float
    maximum: float
    exclusive_minimum: bool = False
    has_default = True

    def read(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"{name} must be a number, got {describe(value)}", name)
        try:
            number = float(value)
        except OverflowError:  # an integer with hundreds of digits
            number = math.inf
        if not math.isfinite(number):
            raise bad_request(f"{name} must be a finite number, got {describe(value)}", name)
        above = number > self.minimum if self.exclusive_minimum else number >= self.minimum
        if not (above and number <= self.maximum):
            low, high = f"{self.minimum:g}", f"{self.maximum:g}"
            words = f"must be in ({low}, {high}]" if self.exclusive_minimum else f"must be between {low} and {high}"
            raise bad_request(f"{name} {words}, got {number}", name)
        return number

    def schema(self) -> dict[str, Any]:
        low = "exclusiveMinimum" if self.exclusive_minimum else "minimum"
        return {"type": "number", low: _number_text(self.minimum), "maximum": _number_text(self.maximum)}


@dataclass(frozen=True)
class Boolean:
    has_default = True

    def read(self, name: str, value: Any) -> bool:
        return as_bool(name, value)

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


@dataclass(frozen=True)
class String:
    has_default = False

    def read(self, name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise bad_request(f"{name} must be a string, got {json_type(value)}", name)
        return value

    def schema(self) -> dict[str, Any]:
        return {"type": "string"}


@dataclass(frozen=True)
class Custom:
    """A value with a shape of its own: ``reader(name, value)`` checks and converts it."""

    reader: Callable[[str, Any], Any]
    json_schema: dict[str, Any]
    has_default: bool = False

    def read(self, name: str, value: Any) -> Any:
        return self.reader(name, value)

    def schema(self) -> dict[str, Any]:
        return copy.deepcopy(self.json_schema)


def _as_is(name: str, value: Any) -> Any:
    return value


def ignored(json_schema: dict[str, Any]) -> Custom:
    """Accepted, advertised and unused (OpenAI's ``user``)."""
    return Custom(_as_is, json_schema)


@dataclass(frozen=True)
class Refused:
    """A field OpenAI defines that we cannot honour: any value ``is_off`` does not call "off" is a
    400. Not advertised."""

    is_off: Callable[[Any], bool]
    has_default = False

    def read(self, name: str, value: Any) -> Any:
        try:
            off = self.is_off(value)
        except TypeError:
            off = False
        if not off:
            raise bad_request(f"{name}={json.dumps(value)[:80]} is not supported yet", name)
        return value

    def schema(self) -> None:
        return None
