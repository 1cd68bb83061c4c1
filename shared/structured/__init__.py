"""Structured output: a guide spec turned into an llguidance grammar (``grammars``); the executor
follows it with one ``llguidance.LLMatcher`` per sequence (``services/executor/guided.py``)."""

from .grammars import MAX_BLANKS, MAX_GUIDE_BYTES, compile_guide

__all__ = ["MAX_BLANKS", "MAX_GUIDE_BYTES", "compile_guide"]
