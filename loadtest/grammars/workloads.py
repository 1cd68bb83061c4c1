"""What the grammar comparison compiles and walks: schemas of three sizes, a regex, a GBNF grammar,
and the batch's documents (each valid under ``PERSON``, all different)."""

from __future__ import annotations

import json

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}

ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern":
           "^[0-9]{5}$"}, "country": {"enum": ["PT", "JP", "KE", "US", "DE"]}}, "required": ["street", "country"]}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "format": "uuid"}, "placed": {"type": "string", "format": "date-time"},
    "customer": PERSON, "ship_to": ADDRESS, "bill_to": ADDRESS,
    "lines": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1},
        "price": {"type": "number"}, "gift": {"type": "boolean"}}, "required": ["sku", "qty", "price"]}},
    "status": {"enum": ["new", "paid", "shipped", "done"]}, "notes": {"type": ["string", "null"]}},
    "required": ["id", "customer", "lines", "status"]}


def wide(n: int) -> dict:
    """An object of ``n`` properties of every kind, a third of them nested objects of five."""
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"type": "array", "items": {"type": "integer"}}, {"enum": ["a", "b", "c"]}]
    properties = {}
    for i in range(n):
        if i % 3 == 2:
            properties[f"group_{i}"] = {"type": "object", "properties": {
                f"f{j}": kinds[(i + j) % len(kinds)] for j in range(5)}, "required": ["f0"]}
        else:
            properties[f"field_{i}"] = kinds[i % len(kinds)]
    return {"type": "object", "properties": properties, "required": list(properties)[: n // 2]}


SCHEMAS = {"small (person, 4 keys)": PERSON, "medium (order, nested, formats)": ORDER,
           "large (120 keys, nested)": wide(120)}
REGEX = r"(\+\d{1,3} )?\(\d{3}\) \d{3}-\d{4}|\d{4}-[01]\d-[0-3]\d(T[0-2]\d:[0-5]\d(:[0-5]\d)?Z)?"
GRAMMAR = r'''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= ("0" | [1-9] [0-9]*) ("." [0-9]+)?'''

NAMES = ["Ana María", "Kenji", "Wanjiru", "Ola", "Lucía", "Min-jun", "Dmitri", "Chloé", "Tomasz", "Aiyana", "Zoë"]
CITIES = ["Lisbon", "Osaka", "Nairobi", "Oslo", "Lima", "Lyon", "Seoul", "Iowa City", "Dublin", "Manila"]
HOBBIES = ["chess", "rowing 🚣", "tea", "go", "knitting", "jazz", "bouldering", "birding", "origami"]


def person_docs(n: int) -> list[str]:
    docs = []
    for i in range(n):
        value = {"name": NAMES[i % len(NAMES)] + ("" if i < len(NAMES) else f" {i}"), "age": 18 + (i * 7) % 70,
                 "city": CITIES[(i * 3) % len(CITIES)], "hobbies": [HOBBIES[(i + k) % len(HOBBIES)]
                                                                   for k in range(i % 4)]}
        docs.append(json.dumps(value, ensure_ascii=False, indent=None if i % 2 else 1))
    return docs
