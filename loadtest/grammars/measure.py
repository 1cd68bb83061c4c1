"""The three measurements of the grammar comparison, for one engine (``engines``): mask time per
token in a batch, compile time, and coverage of the JSON-Schema-Test-Suite (``suite``)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np

from loadtest.grammars.suite import Case


def mask_times(engine, schema: dict, token_lists: list[list[int]]) -> dict[str, float]:
    """The batch walks its documents together, one token per step: each step the engine fills every
    active sequence's mask (timed), then each accepts its document's next token. Twice: ``cold``
    from a freshly compiled guide, ``warm`` with new sequences on the same compiled guide (what a
    server sees once a schema has been used). Microseconds per sequence per step, and the accepts'."""
    compiled = engine.compile("json", schema)
    out = {}
    for run in ("cold", "warm"):
        matchers = [engine.matcher(compiled) for _ in token_lists]
        fill = accept = 0.0
        masks_made = 0
        for step in range(max(map(len, token_lists))):
            active = [i for i, tokens in enumerate(token_lists) if step < len(tokens)]
            start = time.perf_counter()
            masks = engine.fill([matchers[i] for i in active])
            fill += time.perf_counter() - start
            masks_made += len(active)
            start = time.perf_counter()
            for row, i in enumerate(active):
                token = token_lists[i][step]
                if not engine.allowed(masks, row)[token] or not engine.accept(matchers[i], token):
                    raise AssertionError(f"{engine.name} refused token {step} of document {i}")
            accept += time.perf_counter() - start
        out[f"{run}_us"] = fill / masks_made * 1e6
    out["tokens"] = masks_made
    return out


def compile_ms(engine, kind: str, spec: Any, repeats: int = 3) -> float | str:
    """Median milliseconds to compile ``spec`` (a fresh compile each time), or why it cannot."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            engine.compile(kind, spec)
        except Exception as exc:  # noqa: BLE001 - an engine's refusal is a result here
            return f"refused: {str(exc).splitlines()[0][:60]}"
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def accepts(engine, compiled: Any, tokens: list[int]) -> bool:
    """Whether the guide lets the whole token sequence through and may end after it."""
    matcher = engine.matcher(compiled)
    for token in tokens:
        if not engine.allowed(engine.fill([matcher]), 0)[token] or not engine.accept(matcher, token):
            return False
    return engine.accepting(matcher)


def walk(engine, compiled: Any, rng: np.random.Generator, short: np.ndarray, max_tokens: int) -> list[int] | None:
    """A random output under the guide: mostly short tokens (punctuation, digits, letters), so that
    strings and containers close; stops where the guide may end, or at a token with no bytes (an
    end-of-sequence token some engines allow once the guide may end). None when not done in time."""
    matcher, tokens = engine.matcher(compiled), []
    for _ in range(max_tokens):
        if tokens and engine.accepting(matcher) and rng.random() < 0.5:
            return tokens
        allowed = np.flatnonzero(engine.allowed(engine.fill([matcher]), 0))
        if allowed.size == 0:
            return tokens if engine.accepting(matcher) else None
        preferred = allowed[short[allowed]]
        pool = preferred if preferred.size and rng.random() < 0.9 else allowed
        token = int(rng.choice(pool))
        if token in engine.stop_ids:
            return tokens if engine.accepting(matcher) else None
        if not engine.accept(matcher, token):
            raise AssertionError(f"{engine.name} refused a token its own mask allowed")
        tokens.append(token)
    return tokens if engine.accepting(matcher) else None


def coverage(engine, cases: list[Case], encode, decode, short: np.ndarray, walks: int = 2,
             max_tokens: int = 48) -> dict[str, int]:
    """Over the suite's cases: schemas compiled; valid instances let through; invalid ones refused;
    random outputs finished, and those the ``jsonschema`` validator (with format checks) accepts."""
    from jsonschema import Draft202012Validator, FormatChecker

    counts = dict(cases=len(cases), compiled=0, valid=0, valid_accepted=0, invalid=0, invalid_refused=0,
                  walks=0, walks_finished=0, walks_valid=0)
    rng = np.random.default_rng(0)
    for case in cases:
        try:
            compiled = engine.compile("json", case.schema)
        except Exception:  # noqa: BLE001 - not supported: counted by what is missing from "compiled"
            continue
        counts["compiled"] += 1
        for instance, key in [(v, "valid") for v in case.valid] + [(v, "invalid") for v in case.invalid]:
            counts[key] += 1
            let_through = accepts(engine, compiled, encode(json.dumps(instance, ensure_ascii=False)))
            counts["valid_accepted" if key == "valid" else "invalid_refused"] += let_through == (key == "valid")
        validator = Draft202012Validator(case.schema, format_checker=FormatChecker())
        for _ in range(walks):
            counts["walks"] += 1
            tokens = walk(engine, compiled, rng, short, max_tokens)
            if tokens is None:
                continue
            counts["walks_finished"] += 1
            try:
                counts["walks_valid"] += validator.is_valid(json.loads(decode(tokens)))
            except ValueError:
                pass
    return counts
