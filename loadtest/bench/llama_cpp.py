"""pagedserve against llama.cpp on the same GGUF files: next-token agreement and perplexity.

    python -m loadtest.bench.llama_cpp [--variants Q4_1,Q8_0,Q4_K_M] [--dtypes float32,bfloat16]

llama.cpp runs from llama-cpp-python built by ``loadtest/llama_cpp/setup.sh`` (outside the repo,
about 20 minutes the first time), in its own virtualenv (``loadtest/llama_cpp/scores.py``). Files:
the embedded SmolLM2-135M-Instruct Q4_1; a Q8_0 copy requantized by the ``gguf`` package
(``loadtest.bench.quantized``); a Q4_K_M copy made by llama.cpp's own quantizer from the Q8_0 one.
pagedserve serves each in its blocks (``--quantization gguf``, the offline engine) in each dtype.
On a fixed set of English, code and list texts (token ids from SmolLM2's tokenizer, the same ids to
both): at every position, whether the two engines' most likely next token is the same (top-1
agreement, issue target >= 98 %), and the perplexity of the texts under each (target: within 1 %).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np

from loadtest.common.machine_state import print_cpu

HERE = os.path.dirname(os.path.abspath(__file__))
SETUP = os.path.join(HERE, "..", "llama_cpp", "setup.sh")
SCORES = os.path.join(HERE, "..", "llama_cpp", "scores.py")
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "requantized")
TEXTS = [
    "The PagedAttention algorithm divides the key-value cache of each sequence into blocks, each holding the "
    "keys and values of a fixed number of tokens. The blocks need not be contiguous in memory, much as pages "
    "of virtual memory are mapped to frames by a page table.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "Ingredients for a simple bread: 500 g of flour, 350 ml of warm water, 10 g of salt and 7 g of dried yeast. "
    "Mix, knead for ten minutes, let it rise for an hour, shape, rise again, and bake at 230 degrees.",
    "Lisbon is the capital and largest city of Portugal. It lies on the Atlantic coast at the mouth of the Tagus "
    "river, and it is one of the oldest cities in western Europe.",
    "Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius, or 212 degrees Fahrenheit.\n"
    "Q: Which planet is known as the red planet?\nA: Mars.",
    "1. Open the settings page.\n2. Choose the network tab.\n3. Turn on the option named automatic updates.\n"
    "4. Restart the application so that the change takes effect.",
]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def llama_python() -> str:
    out = subprocess.run(["sh", SETUP], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def call(python: str, request: dict):
    out = subprocess.run([python, SCORES], input=json.dumps(request), check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def variant_path(name: str, embedded: str, python: str) -> str:
    from loadtest.bench.quantized import requantized_copy

    if name == "Q4_1":
        return embedded
    q8 = requantized_copy(embedded, "Q8_0")
    if name == "Q8_0":
        return q8
    target = os.path.join(CACHE, f"{os.path.basename(embedded)[:-5]}-{name}.gguf")
    if not os.path.isfile(target):
        say(f"writing {target} (llama.cpp's quantizer, from the Q8_0 copy)")
        if call(python, {"command": "quantize", "source": q8, "target": target + ".tmp", "ftype": name})["rc"]:
            raise SystemExit(f"llama.cpp could not quantize to {name}")
        os.rename(target + ".tmp", target)
    return target


def ours(path: str, dtype: str, prompts: list[list[int]]) -> list[dict]:
    """pagedserve's top-1 and actual-token logprobs at every prompt position (``prompt_logprobs``)."""
    import torch

    from services.executor.loader import RunnerOptions, build_runner
    from services.executor.weights import load_hf_config, load_weights
    from services.offline import EngineCore
    from shared.messages import AddRequest, SamplingParams
    from shared.model_source import resolve_model

    source = resolve_model(path)
    config = load_hf_config(source)
    options = RunnerOptions(dtype=getattr(torch, dtype), num_kv_blocks=256, num_cpu_blocks=0, quantization="gguf")
    engine = EngineCore(build_runner(config, load_weights(source, config, "gguf")[0], options))
    for i, ids in enumerate(prompts):
        engine.add_request(AddRequest(f"p{i}", np.array(ids, dtype=np.int32),
                                      SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), 0.0))
    got = {}
    while engine.has_work():
        for out in engine.step():
            if out.prompt_logprobs:
                got[out.request_id] = {"top1": [t[0] for t in out.prompt_top_token_ids], "logprobs": out.prompt_logprobs}
    return [got[f"p{i}"] for i in range(len(prompts))]


def compare(a: list[dict], b: list[dict]) -> tuple[float, float, float]:
    """(top-1 agreement, perplexity under a, under b)."""
    same = sum(int(x == y) for pa, pb in zip(a, b) for x, y in zip(pa["top1"], pb["top1"]))
    total = sum(len(p["top1"]) for p in a)
    ppl = [math.exp(-sum(sum(p["logprobs"]) for p in s) / total) for s in (a, b)]
    return same / total, ppl[0], ppl[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="Q4_1,Q8_0,Q4_K_M")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-amx", action="store_true", help="let llama.cpp repack weights for its AMX kernels "
                    "(off: on the Intel Xeon KVM guest they died with SIGILL; see loadtest/llama_cpp/scores.py)")
    args = ap.parse_args(argv)
    print_cpu()
    from shared.model_source import load_tokenizer, resolve_model

    embedded = resolve_model(None)
    tokenizer = load_tokenizer(embedded)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    say(f"{len(prompts)} texts, {sum(map(len, prompts))} tokens; llama.cpp from {SETUP}")
    python = llama_python()
    print("| file | pagedserve dtype | top-1 agreement | perplexity pagedserve | perplexity llama.cpp | ratio |")
    print("|---|---|---|---|---|---|")
    for name in args.variants.split(","):
        path = variant_path(name, embedded.where, python)
        theirs = call(python, {"command": "scores", "model": path, "prompts": prompts, "threads": args.threads,
                               "no_extra_buffers": not args.llama_amx})
        for dtype in args.dtypes.split(","):
            agree, p_ours, p_theirs = compare(ours(path, dtype, prompts), theirs)
            print(f"| {name} | {dtype} | {agree:.1%} | {p_ours:.3f} | {p_theirs:.3f} | {p_ours / p_theirs:.4f} |",
                  flush=True)


if __name__ == "__main__":
    main()
