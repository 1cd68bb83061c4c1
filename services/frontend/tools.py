"""Tool calling on /v1/chat/completions: the fields read, defaulted and settled, and the guide of a
named or "required" choice (the responses' calls: ``tool_responses``; "auto"'s parsers, written
per model family: ``tool_parsers``).

- ``tools``: at most ``MAX_TOOLS`` function tools, ``{"type": "function", "function": {"name",
  "description", "parameters", "strict"}}``; names match ``^[a-zA-Z0-9_-]{1,64}$`` and are unique;
  ``parameters`` is a JSON schema (left out: an object with no properties) compiled when the request
  is read, as a guide is, so a schema the guide cannot follow is a 400 naming ``tools``. ``strict``
  is accepted and unused: decoding is always constrained. ``[]`` is no tools.
- ``tool_choice``: ``"none"`` (plain text; the tools still go to the chat template), ``"required"``
  (one call or more, each to one of the tools), ``{"type": "function", "function": {"name": N}}``
  (one call to N), or ``"auto"``: free output, its calls told from its text by the parser for the
  model's own tool-call format (``tool_parsers``), so refused unless the server was started with
  ``--enable-auto-tool-choice`` (as vLLM refuses it); it sets no guide. Left out: ``"none"``
  without tools, ``"auto"`` with them, as in OpenAI's API.
- A named or ``"required"`` choice guides decoding (``SamplingParams.guided``, through
  ``GenerationOptions.tool_guide``): named, by the tool's parameters; required, by an array of
  ``{"name": <a tool's name>, "parameters": <its parameters>}`` objects (``required_schema``). So
  neither goes with ``response_format``, ``guided_json`` or ``guided_choice`` (one guide per
  request) nor with beam search; ``"none"`` goes with both.
- The response (``ChatShapes``): named, the text is the call's ``arguments`` (``content`` null,
  ``finish_reason`` as the engine says: cut short by ``length`` or a ``stop`` string, the arguments
  are incomplete JSON, as in vLLM); required, the array parsed into one call per item with
  ``finish_reason`` ``"tool_calls"`` when it finished (OpenAI's reason when the model called tools;
  vLLM leaves ``"stop"``), or, when the text cannot be parsed (cut short), the text as ``content``
  and no calls. Streamed: a named call's header (id, name) comes in the opening chunk and its
  arguments as they are generated; a required choice's calls come whole in one chunk when it
  finishes (the array is known to be complete only then), then the finish chunk. "auto": see
  ``responses.ChatShapes`` and ``tool_parsers.streaming``.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from services.frontend.errors import bad_request, describe, json_type
from services.frontend.field_kinds import Custom
from services.frontend.guides import GUIDE_FIELDS, checked

MAX_TOOLS = 128  # OpenAI's limit
MAX_REQUIRED_TOOLS = 64  # the tools tool_choice "required" joins into one guide (an alternative each)
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}  # a tool's parameters left out (OpenAI's default)
NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
CHOICE_WORDS = (NONE, AUTO, REQUIRED)
AUTO_REFUSED = ('"auto" tool choice needs a tool-call parser, which this server was started without '
                '(--enable-auto-tool-choice, with --tool-call-parser when the chat template does not show the '
                'format): use tool_choice "required" or a named function, or "none"')


@dataclass(frozen=True)
class ToolChoice:
    """A request's ``tool_choice``: ``mode`` one of none, auto, required, named (``name``: the function)."""

    mode: str
    name: str | None = None
    parser: str | None = None  # "auto": the tool-call parser its output is read with (``tool_parsers``)

    @property
    def calls(self) -> bool:
        """The output is tool calls (named or required), not text."""
        return self.mode in (REQUIRED, NAMED)

    def words(self) -> str:
        return f"tool_choice naming {self.name}" if self.mode == NAMED else f'tool_choice "{self.mode}"'


# ---------------------------------------------------------------- reading the fields


def read_tools(name: str, value: Any) -> list[dict[str, Any]]:
    """The tools in OpenAI's shape, as the chat template takes them (``parameters`` filled in)."""
    if not isinstance(value, list):
        raise bad_request(f"{name} must be a list of tools, got {json_type(value)}", name)
    if len(value) > MAX_TOOLS:
        raise bad_request(f"{name} takes at most {MAX_TOOLS} tools, got {len(value)}", name)
    tools: list[dict[str, Any]] = []
    for idx, tool in enumerate(value):
        where = f"{name}[{idx}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object, got {json_type(tool)}", name)
        if tool.get("type", "function") != "function":
            raise bad_request(f'{where}.type must be "function" (only function tools are supported), got '
                              f"{describe(tool['type'])}", name)
        function = tool.get("function")
        if not isinstance(function, dict):
            got = "nothing" if function is None else json_type(function)
            raise bad_request(f"{where}.function must be an object, got {got}", name)
        tools.append({"type": "function", "function": _read_function(name, f"{where}.function", function, tools)})
    return tools


def _read_function(name: str, where: str, function: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    tool_name = function.get("name")
    if not isinstance(tool_name, str) or not TOOL_NAME.fullmatch(tool_name):
        got = "nothing" if tool_name is None else describe(tool_name)
        raise bad_request(f"{where}.name must be 1 to 64 letters, digits, _ or -, got {got}", name)
    if any(t["function"]["name"] == tool_name for t in earlier):
        raise bad_request(f"{where}.name: {tool_name} names two tools; tool names must be unique", name)
    out: dict[str, Any] = {"name": tool_name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise bad_request(f"{where}.description must be a string, got {json_type(description)}", name)
        out["description"] = description
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be a boolean, got {json_type(strict)}", name)
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:  # OpenAI's default: an object with no properties
        parameters = copy.deepcopy(NO_PARAMETERS)
    elif not isinstance(parameters, dict):
        raise bad_request(f"{where}.parameters must be a JSON schema (an object), got {json_type(parameters)}", name)
    elif parameters.get("type", "object") != "object":
        raise bad_request(f'{where}.parameters must describe an object (arguments are a JSON object), got type '
                          f"{describe(parameters['type'])}", name)
    # compiled only where it guides (settle_tool_choice): a tool the request does not call may use
    # keywords the guide cannot follow, as the chat template reads them
    out["parameters"] = parameters
    return out


def _read_tool_choice(name: str, value: Any) -> ToolChoice:
    if isinstance(value, str) and value in CHOICE_WORDS:
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type", "function") == "function":
        function = value.get("function")
        tool_name = function.get("name") if isinstance(function, dict) else None
        if isinstance(tool_name, str):
            return ToolChoice(NAMED, tool_name)
    raise bad_request(f'{name} must be "none", "auto", "required" or {{"type": "function", "function": {{"name": '
                      f'...}}}}, got {describe(value)}', name)


def settle_tool_choice(tools: list[dict[str, Any]], choice: ToolChoice | None, options: Any, parallel: bool = True,
                       auto_parser: str | None = None) -> tuple[ToolChoice, dict[str, Any] | None]:
    """The request's tool choice (its default settled) and the guide it sets (a named or required
    choice: the called tools' parameters compiled here), once every field has been read; each
    conflict a 400 naming ``tool_choice`` (or ``stop``). ``parallel`` false: "required" makes one call.
    ``auto_parser``: the server's parser for "auto" (None: refused), which sets no guide."""
    given = choice is not None
    if choice is None:
        choice = ToolChoice(AUTO if tools else NONE)
    if not tools and choice.mode != NONE:
        raise bad_request(f"{choice.words()} needs tools: give tools, or leave tool_choice out", "tool_choice")
    if choice.mode == AUTO and auto_parser is not None:
        return ToolChoice(AUTO, parser=auto_parser), None
    if choice.mode == AUTO:
        default = "" if given else " (the default when tools are given)"
        raise bad_request(f'tool_choice "auto"{default}: {AUTO_REFUSED}', "tool_choice")
    if choice.mode == NONE:
        return choice, None
    names = [t["function"]["name"] for t in tools]
    if choice.mode == NAMED and choice.name not in names:
        raise bad_request(f"tool_choice names the function {choice.name!r}, which is not among the tools "
                          f"({', '.join(names)})", "tool_choice")
    other = next((options.param(attr) for attr in GUIDE_FIELDS if getattr(options, attr) is not None), None)
    if other is not None:
        raise bad_request(f"{choice.words()} cannot be combined with {other}: both guide the output (one guide per "
                          f'request); tool_choice "none" keeps the tools and lets {other} guide it', "tool_choice")
    if options.use_beam_search:
        raise bad_request(f"{choice.words()} is not supported with use_beam_search", "tool_choice")
    if options.stop:
        raise bad_request(f"stop is not supported with {choice.words()}: a stop string would cut the call's "
                          "arguments short and the call would look finished", "stop")
    called = [(i, t) for i, t in enumerate(tools) if choice.mode == REQUIRED or t["function"]["name"] == choice.name]
    if len(called) > MAX_REQUIRED_TOOLS:
        raise bad_request(f'tool_choice "required" takes at most {MAX_REQUIRED_TOOLS} tools (the alternatives of '
                          f"its guide), got {len(called)}: name one, or send fewer", "tool_choice")
    for i, tool in called:
        checked({"json_schema": tool["function"]["parameters"]}, "tools", f"tools[{i}].function.parameters")
    if choice.mode == NAMED:
        return choice, {"json_schema": called[0][1]["function"]["parameters"]}
    return choice, checked({"json_schema": required_schema(tools, parallel)}, "tools",
                           'tools (as tool_choice "required" joins them)')


TOOLS = Custom(read_tools, {"type": "array", "maxItems": MAX_TOOLS, "items": {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": f"^{TOOL_NAME.pattern}$"},
            "description": {"type": "string"},
            "parameters": {"type": "object", "description": "A JSON schema; left out: an object with no properties."},
            "strict": {"type": ["boolean", "null"]}}}}}})
TOOL_CHOICE = Custom(_read_tool_choice, {"oneOf": [
    {"enum": list(CHOICE_WORDS)},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
]})


# ---------------------------------------------------------------- the guide of "required"


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """An array of one call or more (exactly one without ``parallel``), each ``{"name": <a tool's
    name>, "parameters": <its parameters>}``. Parameters holding references (``$ref``, which point from the root of the
    schema) go in the root's ``$defs`` under the tool's name, their references moved there (a
    reference cannot point into ``anyOf``'s list); the others stand in place."""
    calls, defs = [], {}
    for tool in tools:
        function = tool["function"]
        parameters = function["parameters"]
        moved = _moved(parameters, f"/$defs/{function['name']}")
        if moved != parameters:
            defs[function["name"]] = moved
            parameters = {"$ref": f"#/$defs/{function['name']}"}
        calls.append({"type": "object", "properties": {"name": {"const": function["name"]}, "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({} if parallel else {"maxItems": 1})
    return schema | {"$defs": defs} if defs else schema


_SUBSCHEMA = frozenset({"items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else"})
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SUBSCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})


def _moved(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#...``) pointing under ``base``; values (``const``,
    ``enum``, ``default``...) are data and are left as they are."""
    if isinstance(schema, list):
        return [_moved(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rest = value[1:]
            value = f"#{base}{rest if not rest or rest.startswith('/') else '/' + rest}"
        elif key in _SUBSCHEMA or key in _SUBSCHEMA_LISTS:
            value = _moved(value, base)
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {k: _moved(v, base) for k, v in value.items()}
        out[key] = value
    return out
