"""Structured output: a spec (a JSON schema, any JSON object, or a list of choices) compiled into a
byte-level automaton that says which bytes may come next (``Guide``); the executor turns that into a
mask over the vocabulary at every step (``services/executor/guided.py``)."""

from .guide import Guide, compile_guide

__all__ = ["Guide", "compile_guide"]
