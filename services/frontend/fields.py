"""How a request field is declared once, and what is derived from that declaration: reading it
from a JSON body (its type, its range, the 400 that names it), its JSON Schema in /openapi.json,
and how it reaches ``SamplingParams``.

A declared field is a dataclass field made with ``declare(kind, default, ...)``. Its JSON name is
the attribute's name unless ``json_name`` says otherwise; its ``FieldSpec`` (kept in the field's
metadata) says which routes accept it and under which names, how it is described and how it
reaches the engine. Its ``Kind`` (``field_kinds``) reads one JSON
value and describes it in JSON Schema. ``null`` is never handed to a kind: everywhere in this
API, as in OpenAI's, ``null`` means "left out". A field made with ``nested(cls)`` holds another
declared dataclass read from the same (flat) JSON object.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from services.frontend.errors import bad_request
from services.frontend.field_kinds import Kind

_SPEC = "pagedserve.field"
_NESTED = "pagedserve.nested"
T = TypeVar("T")


class Route(enum.Flag):
    """The generation routes a field belongs to."""

    COMPLETIONS = enum.auto()  # /v1/completions
    CHAT = enum.auto()  # /v1/chat/completions
    BOTH = COMPLETIONS | CHAT


@dataclass(frozen=True)
class FieldSpec:
    """Everything about one request field but its attribute name and default (see ``declare``).

    ``aliases``: other JSON names, tried before the field's own on ``alias_routes`` (the first one
    given wins; OpenAI's ``max_completion_tokens`` for ``max_tokens``). ``convert``: applied to
    the value read (top_k's "off" values to ``None``). ``sampling``: ``True`` copies the value to
    the ``SamplingParams`` field of the same name; a function ``(value, options) -> {field: value}``
    converts it; ``False`` keeps it in the frontend. ``pending``: the field is read and advertised
    but any value other than its default is refused, for this reason, until it is supported.
    ``requires``: a boolean field declared before this one that must be true when this one is given.
    ``route_kinds``: the kind on a route where it differs (``max_tokens`` may be 0 on completions).
    """

    kind: Kind
    description: str = ""
    routes: Route = Route.BOTH
    json_name: str | None = None
    aliases: tuple[str, ...] = ()
    alias_routes: Route = Route.BOTH
    nullable: bool = False
    required: bool = False
    convert: Callable[[Any], Any] | None = None
    sampling: bool | Callable[[Any, Any], dict[str, Any]] = False
    pending: str | None = None
    requires: str | None = None
    route_kinds: dict[Route, Kind] = dataclasses.field(default_factory=dict)

    def kind_on(self, route: Route) -> Kind:
        return next((kind for r, kind in self.route_kinds.items() if route & r), self.kind)


def declare(kind: Kind, default: Any = None, *, factory: Callable[[], Any] | None = None, **spec: Any) -> Any:
    """A dataclass field declared as a request field; ``factory`` for a list or dict default."""
    metadata = {_SPEC: FieldSpec(kind, **spec)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def nested(cls: type) -> Any:
    """A dataclass field holding the declared fields of ``cls``, read from the same JSON object."""
    return dataclasses.field(default_factory=cls, metadata={_NESTED: cls})


@dataclass(frozen=True)
class Declared:
    """One declared field as the derivations see it."""

    attr: str
    spec: FieldSpec
    field: dataclasses.Field

    @property
    def name(self) -> str:
        return self.spec.json_name or self.attr

    @property
    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default

    def names(self, route: Route) -> tuple[str, ...]:
        """The JSON names it is read under on ``route``, in the order they are tried."""
        return (*self.spec.aliases, self.name) if route & self.spec.alias_routes else (self.name,)

    def read(self, body: dict[str, Any], route: Route, earlier: dict[str, Any]) -> tuple[str, Any] | None:
        """(the JSON name it came under, its value), or ``None`` when left out. ``earlier``: the
        values of the fields read before it."""
        for name in self.names(route):
            raw = body.get(name)
            if raw is None:
                continue
            if self.spec.requires is not None and not earlier.get(self.spec.requires):
                raise bad_request(f"{name} is only allowed when {self.spec.requires} is true", name)
            value = self.spec.kind_on(route).read(name, raw)
            if self.spec.convert is not None:
                value = self.spec.convert(value)
            if self.spec.pending is not None and value != self.default:
                raise bad_request(f"{name} is not supported yet: {self.spec.pending}", name)
            return name, value
        if self.spec.required:
            raise bad_request(f"{self.name} is required", self.name)
        return None


def _declared(f: dataclasses.Field, route: Route) -> Declared | None:
    spec = f.metadata.get(_SPEC)
    return Declared(f.name, spec, f) if spec is not None and spec.routes & route else None


def declared_fields(cls: type, route: Route = Route.BOTH) -> list[Declared]:
    """The declared fields of ``cls`` (not of those nested in it) that ``route`` accepts, in order."""
    return [d for d in (_declared(f, route) for f in dataclasses.fields(cls)) if d is not None]


def read_declared(cls: type[T], body: dict[str, Any], route: Route) -> T:
    """An instance of ``cls`` from ``body``'s fields, read in declaration order (nested classes at
    their place); raises ``APIError`` at the first bad one. A class with a ``given`` field gets
    ``{attribute: the JSON name it came under}`` for every field the body set."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        declared = _declared(f, route)
        if _NESTED in f.metadata:
            values[f.name] = read_declared(f.metadata[_NESTED], body, route)
        elif declared is not None and (found := declared.read(body, route, values)) is not None:
            given[f.name], values[f.name] = found
    if "given" in {f.name for f in dataclasses.fields(cls)}:
        values["given"] = given
    return cls(**values)


def schema_properties(cls: type, route: Route) -> tuple[dict[str, Any], list[str]]:
    """The JSON Schema ``properties`` and ``required`` names of ``cls``'s fields on ``route``."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            more, more_required = schema_properties(f.metadata[_NESTED], route)
            properties |= more
            required += more_required
            continue
        declared = _declared(f, route)
        schema = declared.spec.kind_on(route).schema() if declared is not None else None
        if schema is None:
            continue
        for name in declared.names(route):
            properties[name] = _property(declared, copy.deepcopy(schema), route)
        if declared.spec.required:
            required.append(declared.name)
    return properties, required


def _property(declared: Declared, schema: dict[str, Any], route: Route) -> dict[str, Any]:
    spec = declared.spec
    if spec.nullable:
        schema["type"] = [schema["type"], "null"]
    default = declared.default
    if spec.kind_on(route).has_default and default is not None:
        schema["default"] = int(default) if isinstance(default, float) and default.is_integer() else default
    if spec.description:
        schema["description"] = spec.description
    return schema


def sampling_values(options: Any) -> dict[str, Any]:
    """The ``SamplingParams`` fields that ``options``' declared fields carry (``FieldSpec.sampling``)."""
    values: dict[str, Any] = {}
    for declared in declared_fields(type(options)):
        how = declared.spec.sampling
        value = getattr(options, declared.attr)
        if how is True:
            values[declared.attr] = copy.copy(value)
        elif how:
            values |= how(value, options)
    return values
