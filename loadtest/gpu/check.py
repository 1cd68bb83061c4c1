"""The GPU checks' Python parts (``loadtest/gpu/gpu_check.sh`` runs them on a machine with a GPU).

    python -m loadtest.gpu.check export-config --out DIR      # here: SmolLM2's config and tokenizer
    python -m loadtest.gpu.check model --config DIR --out DIR  # there: random weights of those sizes
    python -m loadtest.gpu.check greedy --model DIR --device cuda --dtype float32 --attention-backend cuda
    python -m loadtest.gpu.check compare --url URL --model DIR --device cuda --dtype float32

SmolLM2's weights come in a 98 MB GGUF file, more than a GPU machine here can be sent, so the GPU
runs a model of SmolLM2's sizes with random weights (seeded; the same matmuls, KV bytes and
tokenizer): its text is noise, which suits comparing two engines token by token.

``greedy`` runs the offline engine (``services.offline.LLM``) and transformers, both on
``--device`` in ``--dtype``, on the same prompts, greedy, EOS ignored; ``compare`` does the same
against a running ``pagedserve serve`` (its completions, all sent at once so that they decode as
one batch; their tokens read from the logprobs' ``tokens``, each one token's text). Both print the
prompts whose first ``--tokens`` tokens differ and how many agree (position by position) in all,
and exit 1 when that share is under ``--min-agreement`` (default: 1.0 in float32, where outputs
must be identical; 0.9 in 16-bit types, issue 14's bound for bf16 against transformers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request

from shared.hub_kernels import hide_hub_kernels

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a kingdom by the sea,",
    "The three laws of thermodynamics are",
    "To make a cup of tea, first",
    "In 1969, the first humans to walk on the Moon",
    "A paged KV cache stores keys and values in fixed-size blocks so that",
    "SELECT name, COUNT(*) FROM orders GROUP BY",
    "Photosynthesis converts light energy into",
    "The quick brown fox",
]


def say(*parts) -> None:
    print(*parts, flush=True)


def export_config(out: str) -> None:
    """SmolLM2-135M-Instruct's config.json and tokenizer files (from the embedded GGUF), no weights."""
    hide_hub_kernels()
    from transformers import AutoConfig, AutoTokenizer

    from shared.model_source import resolve_model

    src = resolve_model(None)
    AutoConfig.from_pretrained(src.directory, **src.pretrained_kwargs()).save_pretrained(out)
    AutoTokenizer.from_pretrained(src.directory, **src.pretrained_kwargs()).save_pretrained(out)
    say(f"wrote SmolLM2's config and tokenizer to {out}")


def make_model(config_dir: str, out: str, seed: int) -> None:
    """A Llama of ``config_dir``'s sizes with seeded random weights, saved with its tokenizer."""
    import torch
    hide_hub_kernels()
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(config_dir)).eval()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(config_dir).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    say(f"random model of {params / 1e6:.1f} M parameters (seed {seed}) saved to {out} "
        f"in {time.perf_counter() - t0:.1f} s")


def _prompt_ids(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(count)]


def hf_greedy(model_dir: str, device: str, dtype_name: str, prompt_ids: list[list[int]], tokens: int):
    """transformers' greedy continuations (EOS ignored), one prompt at a time, on ``device``."""
    import torch
    hide_hub_kernels()
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dtype).to(device).eval()
    refs = []
    t0 = time.perf_counter()
    for ids in prompt_ids:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(ids):].tolist())
    say(f"transformers ({dtype_name} on {device}): {len(refs)} greedy continuations in "
        f"{time.perf_counter() - t0:.1f} s")
    del model
    return refs


def report(label: str, ours: list[list[int]], refs: list[list[int]], min_agreement: float) -> int:
    agree = total = identical = 0
    for i, (a, b) in enumerate(zip(ours, refs)):
        same = sum(x == y for x, y in zip(a, b))
        agree, total, identical = agree + same, total + len(b), identical + (a == b)
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is not None:  # the prompts that agree in full go unsaid
            say(f"  prompt {i}: {same}/{len(b)} tokens agree, the first difference at token {first}")
    share = agree / max(total, 1)
    ok = share >= min_agreement and len(ours) == len(refs)
    say(f"{label}: {identical}/{len(refs)} prompts identical, {agree}/{total} tokens agree ({share:.1%}); "
        f"needed {min_agreement:.0%}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _min_agreement(args) -> float:
    if args.min_agreement is not None:
        return args.min_agreement
    return 1.0 if args.dtype == "float32" else 0.9


def greedy(args) -> int:
    hide_hub_kernels()
    from transformers import AutoTokenizer

    from services.offline import LLM
    from shared.messages import SamplingParams

    prompt_ids = _prompt_ids(AutoTokenizer.from_pretrained(args.model), args.prompts)
    refs = hf_greedy(args.model, args.device, args.dtype, prompt_ids, args.tokens)
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
              kv_cache_memory="1GiB")
    say(f"pagedserve offline engine: device {llm.engine.runner.device}, attention "
        f"{llm.engine.runner.backend.name}, loaded in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    say(f"pagedserve offline engine: {len(outs)} prompts in one batch in {time.perf_counter() - t0:.1f} s")
    ours = [out.choices[0].token_ids for out in outs]
    return report(f"offline {args.dtype} {args.attention_backend} vs transformers", ours, refs, _min_agreement(args))


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def compare(args) -> int:
    """The server's greedy completions (token-id prompts, all at once) against transformers'."""
    hide_hub_kernels()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_ids = _prompt_ids(tokenizer, args.prompts)
    refs = hf_greedy(args.model, args.device, args.dtype, prompt_ids, args.tokens)
    with urllib.request.urlopen(f"{args.url}/v1/models", timeout=30) as resp:
        served = json.loads(resp.read())["data"][0]["id"]

    async def send_all():
        loop = asyncio.get_running_loop()
        bodies = [{"model": served, "prompt": ids, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True,
                   "logprobs": 0} for ids in prompt_ids]
        return await asyncio.gather(*(loop.run_in_executor(None, _post, f"{args.url}/v1/completions", b)
                                      for b in bodies))

    t0 = time.perf_counter()
    answers = asyncio.run(send_all())
    say(f"pagedserve at {args.url}: {len(answers)} completions at once in {time.perf_counter() - t0:.1f} s")
    # position by position through each token's text (the logprobs' ``tokens``: one token's decode)
    ours = [answer["choices"][0]["logprobs"]["tokens"] for answer in answers]
    ref_pieces = [[tokenizer.decode([t], skip_special_tokens=False) for t in ref] for ref in refs]
    return report(f"serve {args.dtype} vs transformers", ours, ref_pieces, _min_agreement(args))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.gpu.check", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export-config", help="SmolLM2's config and tokenizer, no weights")
    e.add_argument("--out", required=True)
    m = sub.add_parser("model", help="a random model of a config's sizes")
    m.add_argument("--config", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    for name in ("greedy", "compare"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--device", default="cuda")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        p.add_argument("--prompts", type=int, default=10)
        p.add_argument("--tokens", type=int, default=32)
        p.add_argument("--min-agreement", type=float, default=None)
        if name == "greedy":
            p.add_argument("--attention-backend", default="auto")
        else:
            p.add_argument("--url", required=True)
    args = ap.parse_args(argv)
    if args.command == "export-config":
        export_config(args.out)
        return 0
    if args.command == "model":
        make_model(args.config, args.out, args.seed)
        return 0
    return greedy(args) if args.command == "greedy" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
