"""Guide engines compared on SmolLM2's 49,152-token vocabulary: llguidance (pagedserve's), xgrammar and
outlines-core (what vLLM and SGLang use), each on one thread; and pagedserve's executor over
llguidance (``executor``: ``GuidedSequences.masks``, the rows filled together; ``executor-alone``:
row by row), history fed and masks read into token sets as the sampler takes them.

    python -m loadtest.grammars [--engines xgrammar,llguidance,outlines,executor,executor-alone] [--batch 64] [--suite DIR]
                                [--walks 2] [--skip-coverage]

Prints, per engine: the mask time per sequence per step with ``--batch`` sequences walking
different documents valid under a small schema (cold: a fresh guide; warm: the same guide again);
the compile time of schemas of three sizes, a regex and a GBNF grammar; and coverage of the
JSON-Schema-Test-Suite's draft 2020-12 cases: schemas compiled, valid instances let through,
invalid ones refused, and random outputs under the guide that the ``jsonschema`` validator (formats
checked) accepts. Random outputs under the regex and the grammar are checked with Python's ``re``
and ``ast``. Nothing is asserted: the figures depend on the machine, whose CPU is printed.
"""

from __future__ import annotations

import argparse
import ast
import re

import numpy as np

from shared.hub_kernels import hide_hub_kernels

VOCAB_SIZE = 49152
SHORT = re.compile(r'[\s"{}\[\],:.0-9a-zA-Z+\-*/()@]{1,2}')  # short tokens a random walk prefers


def say(msg: str) -> None:
    print(msg, flush=True)


def load_tokenizer():
    hide_hub_kernels()
    from shared.model_source import load_tokenizer as load, resolve_model

    return load(resolve_model(None))


def check_walks(engine, kind: str, spec: str, accept, rng, short, walks: int = 20) -> str:
    from loadtest.grammars.measure import walk

    compiled = engine.compile(kind, spec)
    outputs = [walk(engine, compiled, rng, short, 40) for _ in range(walks)]
    done = [o for o in outputs if o is not None]
    return f"{sum(accept(engine.decode(o)) for o in done)}/{len(done)} of {walks} finished"


def main(argv: list[str] | None = None) -> None:
    from loadtest.grammars.engines import ENGINES
    from loadtest.grammars.measure import compile_ms, coverage, mask_times
    from loadtest.grammars.suite import load_cases, suite_dir
    from loadtest.grammars.workloads import GRAMMAR, PERSON, REGEX, SCHEMAS, person_docs
    from shared.cpu_features import read_cpu_features

    parser = argparse.ArgumentParser(prog="python -m loadtest.grammars", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--suite", default=None, help="the suite's tests/draft2020-12 folder (default: fetched)")
    parser.add_argument("--walks", type=int, default=2, help="random outputs per suite schema")
    parser.add_argument("--skip-coverage", action="store_true")
    parser.add_argument("--coverage-engines", default="xgrammar,llguidance",
                        help="engines run over the suite (outlines-core compiles a schema in seconds: left out)")
    args = parser.parse_args(argv)
    say(f"cpu: {read_cpu_features().summary()}")
    tokenizer = load_tokenizer()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids)  # noqa: E731
    short = np.zeros(VOCAB_SIZE, bool)
    for token in range(VOCAB_SIZE):
        short[token] = bool(SHORT.fullmatch(tokenizer.decode([token])))
    docs = [encode(d) for d in person_docs(args.batch)]
    cases = [] if args.skip_coverage else load_cases(suite_dir(args.suite))
    for name in args.engines.split(","):
        say(f"\n== {name}: loading the vocabulary")
        engine = ENGINES[name](tokenizer, VOCAB_SIZE)
        engine.decode, engine.stop_ids = decode, set(tokenizer.all_special_ids)
        masks = mask_times(engine, PERSON, docs)
        say(f"mask per sequence per step, batch {args.batch} ({masks['tokens']} masks): cold {masks['cold_us']:.1f} us, "
            f"warm {masks['warm_us']:.1f} us")
        for label, spec in SCHEMAS.items():
            say(f"compile {label}: {_ms(compile_ms(engine, 'json', spec))}")
        say(f"compile regex: {_ms(compile_ms(engine, 'regex', REGEX))}")
        say(f"compile GBNF grammar: {_ms(compile_ms(engine, 'grammar', GRAMMAR))}")
        rng = np.random.default_rng(1)
        for kind, spec, ok in (("regex", REGEX, lambda s: re.fullmatch(REGEX, s) is not None),
                               ("grammar", GRAMMAR, _parses)):
            try:
                say(f"random outputs under the {kind} that match it: {check_walks(engine, kind, spec, ok, rng, short)}")
            except Exception as exc:  # noqa: BLE001 - the engine has no such guides
                say(f"random outputs under the {kind}: none ({str(exc).splitlines()[0][:60]})")
        if cases and name in args.coverage_engines.split(","):
            say(f"coverage of {len(cases)} suite cases ...")
            say(f"coverage: {coverage(engine, cases, encode, decode, short, walks=args.walks)}")


def _ms(value) -> str:
    return value if isinstance(value, str) else f"{value:.2f} ms"


def _parses(text: str) -> bool:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(node, allowed) for node in ast.walk(tree)) and " " not in text


if __name__ == "__main__":
    main()
