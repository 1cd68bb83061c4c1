"""Python calls in a list (Llama 3.2's and 4's, ToolACE): ``[get_weather(city="Paris"), f(x=1)]``,
as the whole output (Llama 4 may wrap it in ``<|python_start|>``/``<|python_end|>``, which the
detokenizer drops). Read with Python's ``ast``: keyword arguments whose values are literals only
(strings, numbers, True/False/None, lists, dicts); anything else is not a call."""

from __future__ import annotations

import ast
import json

from services.frontend.tool_parsers import ToolCall

MARKERS = ()
AT_START = ("[",)


def parse_calls(rest: str) -> list[ToolCall] | None:
    tree = ast.parse(rest.strip(), mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(kw.arg is None for kw in node.keywords):  # **kwargs
            return None
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
    return calls
