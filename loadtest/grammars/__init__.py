"""The guide engines compared (``python -m loadtest.grammars``): pagedserve's own structured-output
automaton against xgrammar, llguidance and outlines-core; see ``__main__``."""
