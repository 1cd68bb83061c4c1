"""The guide engines compared (``python -m loadtest.grammars``): structured-output libraries, llguidance (the
one pagedserve uses), xgrammar and outlines-core; see ``__main__`` and docs/grammars.md."""
