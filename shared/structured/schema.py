"""A guide's spec (``{"json_object": true}``, ``{"json_schema": {...}}``, ``{"choice": [...]}``)
compiled into the nodes that ``guide.Guide`` walks byte by byte.

Nodes are tuples in one list, referred to by index, so that a recursive schema (a ``$ref`` to an
enclosing definition) is a cycle of indices rather than an endless tree:

- ``(ANY,)``: any JSON value;
- ``(OBJECT, props, extra)``: ``props`` a tuple of ``(key, node, required)``, ``key`` the property's
  name as JSON text (quotes included, bytes), written in this order, the optional ones may be left
  out; ``extra`` (when there are no properties) the node of every value of an object with free keys;
- ``(ARRAY, item, min_items, max_items)`` (``max_items`` -1: no bound);
- ``(STRING, min_length, max_length)`` in characters (-1: no bound);
- ``(NUMBER, integer)``;
- ``(LITERALS, texts)``: one of a few JSON texts (bytes): ``enum``, ``const``, ``true``/``false``, ``null``;
- ``(UNION, nodes)``: any of several (``anyOf``, ``oneOf``, a list of types);
- ``(CHOICE, texts)``: one of a few raw texts (``choice``; not JSON).

A schema keyword that would constrain values in a way the nodes cannot say (``pattern``, ``format``,
``minimum``...) is refused with a ``ValueError`` naming it, rather than ignored: output that claims
to follow a schema must follow it. Annotations (``title``, ``description``, ``default``...) are read
past.
"""

from __future__ import annotations

import json
from typing import Any

ANY, OBJECT, ARRAY, STRING, NUMBER, LITERALS, UNION, CHOICE = range(8)

# Keywords that say nothing about which values are valid.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "strict", "name", "discriminator",
})
# Read past wherever they stand (definitions are reached through $ref).
_PASSIVE = _ANNOTATIONS | {"$defs", "definitions"}
# Keywords read below, by where they apply.
_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "minLength", "maxLength", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
    "definitions", "nullable",
}) | _ANNOTATIONS
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
MAX_CHOICES = 1024
MAX_DEPTH = 64  # schemas nested deeper (through $refs too) are refused


def _fail(path: str, why: str) -> ValueError:
    return ValueError(f"{path}: {why}" if path else why)


def _json_text(value: Any) -> bytes:
    """A value as the guide writes it: compact JSON, non-ASCII characters as they are."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class SchemaCompiler:
    """Turn one root (a schema, or ``choice``) into the node list; ``compile`` returns the root's index."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.nodes: list[tuple] = []
        self._refs: dict[str, int] = {}  # "$ref" string -> node index (made before it is filled in)
        self._depth = 0

    def compile(self, schema: Any) -> int:
        """The root schema's node; refuses a ``$ref`` that comes back to itself before any value starts."""
        root = self.schema(schema)
        self._check_ref_loops()
        return root

    def _check_ref_loops(self) -> None:
        """A union whose members lead back to it through unions alone (``{"$ref": "#"}``) would
        expand without end: a value must start between two visits of one reference."""
        for start, node in enumerate(self.nodes):
            if node[0] != UNION:
                continue
            seen, todo = set(), list(node[1])
            while todo:
                index = todo.pop()
                if index == start:
                    raise ValueError("schema: a $ref leads back to itself before any value (it describes nothing)")
                if index not in seen and self.nodes[index][0] == UNION:
                    seen.add(index)
                    todo.extend(self.nodes[index][1])

    def _add(self, node: tuple) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def any(self) -> int:
        return self._add((ANY,))

    def free_object(self, value: int) -> int:
        return self._add((OBJECT, (), value))

    def choice(self, texts: Any) -> int:
        if not isinstance(texts, list) or not texts:
            raise _fail("choice", "must be a non-empty list of strings")
        if len(texts) > MAX_CHOICES:
            raise _fail("choice", f"at most {MAX_CHOICES} choices, got {len(texts)}")
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text:
                raise _fail(f"choice[{i}]", "must be a non-empty string")
        return self._add((CHOICE, tuple(dict.fromkeys(t.encode() for t in texts))))

    def schema(self, schema: Any, path: str = "schema") -> int:
        if self._depth >= MAX_DEPTH:
            raise _fail(path, f"the schema nests deeper than {MAX_DEPTH} levels")
        self._depth += 1
        try:
            return self._schema(schema, path)
        finally:
            self._depth -= 1

    def _schema(self, schema: Any, path: str) -> int:
        if schema is True or schema == {}:
            return self.any()
        if not isinstance(schema, dict):
            raise _fail(path, f"a schema must be an object, got {type(schema).__name__}")
        unknown = sorted(set(schema) - _KEYWORDS)
        if unknown:
            raise _fail(path, f"the keyword {unknown[0]!r} is not supported (supported: "
                              f"{', '.join(sorted(_KEYWORDS - _ANNOTATIONS))})")
        if "$ref" in schema:
            if set(schema) - _PASSIVE - {"$ref"}:
                raise _fail(path, "$ref with other keywords beside it is not supported")
            return self._ref(schema["$ref"], path)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not (isinstance(parts, list) and len(parts) == 1) or set(schema) - _PASSIVE - {"allOf"}:
                raise _fail(path, "allOf is supported only with one schema and nothing beside it")
            return self.schema(parts[0], f"{path}.allOf[0]")
        for key in ("anyOf", "oneOf"):
            if key in schema:
                parts = schema[key]
                if not isinstance(parts, list) or not parts:
                    raise _fail(f"{path}.{key}", "must be a non-empty list of schemas")
                if set(schema) - _PASSIVE - {key}:  # e.g. {"type": "object", "anyOf": [...]}: not supported
                    raise _fail(path, f"{key} with other keywords beside it is not supported")
                members = [self.schema(p, f"{path}.{key}[{i}]") for i, p in enumerate(parts)]
                if key == "oneOf":
                    self._check_exclusive(members, path)
                return self._union(members)
        if "const" in schema or "enum" in schema:
            return self._literals(schema, path)
        types = schema.get("type")
        if types is None:
            return self._untyped(schema, path)
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types or any(t not in _TYPES for t in types):
            raise _fail(f"{path}.type", f"must be one of {', '.join(_TYPES)} or a list of them, got {types!r}")
        if schema.get("nullable") is True and "null" not in types:
            types = [*types, "null"]
        made = [self._typed(t, schema, path) for t in dict.fromkeys(types)]
        return made[0] if len(made) == 1 else self._union(made)

    def _untyped(self, schema: dict, path: str) -> int:
        """A schema without ``type``: the kind its keywords imply, else any value."""
        if "properties" in schema or "required" in schema or "additionalProperties" in schema:
            return self._typed("object", schema, path)
        if "items" in schema or "minItems" in schema or "maxItems" in schema:
            return self._typed("array", schema, path)
        if "minLength" in schema or "maxLength" in schema:
            return self._typed("string", schema, path)
        return self.any()

    def _typed(self, kind: str, schema: dict, path: str) -> int:
        if kind == "object":
            return self._object(schema, path)
        if kind == "array":
            return self._array(schema, path)
        if kind == "string":
            low, high = _bounds(schema, "minLength", "maxLength", path)
            return self._add((STRING, low, high))
        if kind in ("number", "integer"):
            return self._add((NUMBER, kind == "integer"))
        if kind == "boolean":
            return self._add((LITERALS, (b"true", b"false")))
        return self._add((LITERALS, (b"null",)))

    def _literals(self, schema: dict, path: str) -> int:
        """``enum`` or ``const``: its values as compact JSON texts, those of the ``type`` beside it."""
        if "const" in schema and "enum" in schema:
            raise _fail(path, "const and enum together are not supported")
        key = "const" if "const" in schema else "enum"
        values = [schema["const"]] if key == "const" else schema["enum"]
        if not isinstance(values, list) or not values:
            raise _fail(f"{path}.enum", "must be a non-empty list")
        beside = sorted(set(schema) - _PASSIVE - {key, "type", "nullable"})
        if beside:
            raise _fail(path, f"{key} with {beside[0]!r} beside it is not supported")
        if "type" in schema:
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if schema.get("nullable") is True:
                types = [*types, "null"]
            values = [v for v in values if _json_kind(v) in types
                      or (_json_kind(v) == "integer" and "number" in types)
                      or (isinstance(v, float) and v.is_integer() and "integer" in types)]
            if not values:
                raise _fail(path, f"no {key} value is of the type {schema['type']!r}")
        return self._add((LITERALS, tuple(dict.fromkeys(_json_text(v) for v in values))))

    def _check_exclusive(self, members: list[int], path: str) -> None:
        """``oneOf`` holds when exactly one member does: taken as a union only when no value can
        match two members (different kinds, different literals, or objects told apart by a
        required property's different constants, as pydantic's discriminated unions are)."""
        shapes = [self._shape(m) for m in members]
        for i in range(len(members)):
            for j in range(i + 1, len(members)):
                if not _apart(shapes[i], shapes[j], self.nodes):
                    raise _fail(f"{path}.oneOf", f"members {i} and {j} may match the same value, which oneOf "
                                                 f"forbids; use anyOf if either may match")

    def _shape(self, index: int, seen: frozenset = frozenset()) -> dict[str, Any] | None:
        """The values a node may start: kind -> literal texts (a set), object node ids (a list) or
        None (any value of that kind); None when unknown (a reference still being compiled)."""
        node = self.nodes[index]
        kind = node[0]
        if kind == ANY:
            return {k: None for k in ("object", "array", "string", "number", "boolean", "null")}
        if kind == OBJECT:
            return {"object": [index]}
        if kind == ARRAY:
            return {"array": None}
        if kind == STRING:
            return {"string": None}
        if kind == NUMBER:
            return {"number": None}
        if kind == LITERALS:
            out: dict[str, Any] = {}
            for text in node[1]:
                out.setdefault(_json_kind(json.loads(text)).replace("integer", "number"), set()).add(text)
            return out
        if kind == UNION:
            if not node[1] or index in seen:
                return None
            merged: dict[str, Any] = {}
            for member in node[1]:
                shape = self._shape(member, seen | {index})
                if shape is None:
                    return None
                for k, v in shape.items():
                    if k not in merged:
                        merged[k] = v
                    elif merged[k] is None or v is None:
                        merged[k] = None
                    else:
                        merged[k] = merged[k] + v if isinstance(v, list) else merged[k] | v
            return merged
        return None

    def _object(self, schema: dict, path: str) -> int:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise _fail(f"{path}.properties", "must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise _fail(f"{path}.required", "must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise _fail(f"{path}.required", f"names {missing[0]!r}, which is not among the properties")
        extra = schema.get("additionalProperties", True)
        if not props:
            if extra is False:
                return self._add((OBJECT, (), None))  # only {}
            value = self.any() if extra is True else self.schema(extra, f"{path}.additionalProperties")
            return self.free_object(value)
        index = self._add((OBJECT, (), None))  # filled in below, so that a $ref back to it resolves
        fields = tuple(
            (_json_text(name), self.schema(sub, f"{path}.properties.{name}"), name in required)
            for name, sub in props.items()
        )
        self.nodes[index] = (OBJECT, fields, None)
        return index

    def _array(self, schema: dict, path: str) -> int:
        low, high = _bounds(schema, "minItems", "maxItems", path)
        items = schema.get("items", True)
        index = self._add((ARRAY, -1, low, high))
        self.nodes[index] = (ARRAY, self.schema(items, f"{path}.items"), low, high)
        return index

    def _union(self, members: list[int]) -> int:
        return members[0] if len(members) == 1 else self._add((UNION, tuple(members)))

    def _ref(self, ref: Any, path: str) -> int:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise _fail(f"{path}.$ref", f"only references inside the schema (#/...) are supported, got {ref!r}")
        if ref in self._refs:
            return self._refs[ref]
        target: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise _fail(f"{path}.$ref", f"{ref!r} points at nothing in the schema")
            target = target[part]
        # A placeholder union of one member, filled in once the target is compiled: the target may
        # refer back to this same reference.
        index = self._add((UNION, ()))
        self._refs[ref] = index
        self.nodes[index] = (UNION, (self.schema(target, ref),))
        return index


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _apart(a: dict | None, b: dict | None, nodes: list[tuple]) -> bool:
    """Whether no value starts both shapes (``SchemaCompiler._shape``)."""
    if a is None or b is None:
        return False
    for kind in a.keys() & b.keys():
        x, y = a[kind], b[kind]
        if x is None or y is None:
            return False
        if kind == "object":
            if not all(_told_apart(nodes[i], nodes[j], nodes) for i in x for j in y):
                return False
        elif x & y:
            return False
    return True


def _told_apart(a: tuple, b: tuple, nodes: list[tuple]) -> bool:
    """Two object nodes no object matches both: a property required by both whose values are
    different constants."""
    if a[2] is not None or b[2] is not None:  # free keys
        return False
    mine = {key: node for key, node, required in a[1] if required and nodes[node][0] == LITERALS}
    for key, node, required in b[1]:
        if required and key in mine and nodes[node][0] == LITERALS:
            if not set(nodes[node][1]) & set(nodes[mine[key]][1]):
                return True
    return False


def _bounds(schema: dict, low_key: str, high_key: str, path: str) -> tuple[int, int]:
    low, high = schema.get(low_key, 0), schema.get(high_key, -1)
    for key, value in ((low_key, low), (high_key, high)):
        if key in schema and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise _fail(f"{path}.{key}", f"must be a non-negative integer, got {value!r}")
    if high != -1 and high < low:
        raise _fail(path, f"{high_key} ({high}) is below {low_key} ({low})")
    return low, high
