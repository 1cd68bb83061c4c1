"""GGUF weights served quantized against the same model dequantized to bfloat16: the embedded
SmolLM2-135M-Instruct (Q4_1 matrices, Q8_0 embedding) and copies requantized from its dequantized
weights by the ``gguf`` package (Q8_0, Q4_0; the package has no Q4_K quantizer), and ``int8``: the
dequantized weights quantized at load by ``--quantization int8`` (one scale per output channel).

    python -m loadtest.bench.quantized [--variants bf16,Q4_1,Q8_0,Q4_0] [--streams 1,8] [--tokens 48] [--rounds 2]

Each variant runs in a fresh process (so that its RSS is its own): the offline engine
(``services.offline.EngineCore``) in bfloat16, the weights dequantized (``--quantization none``,
the matmuls on ``--linear-kernel auto``) for ``bf16``, served quantized (``--quantization gguf``)
for the others. It prints the weights' bytes in memory, the RSS after loading, and output tokens per
second for each stream count (every stream the same 16-token prompt plus its own first token,
``--tokens`` greedy tokens each, EOS ignored; prefill included), each ``--rounds`` times, the
variants' order alternating by round, and for Q4_1 (the file bf16 dequantizes) the greedy tokens'
agreement with ``bf16`` (the share of token positions, over all streams, before which the two
outputs are still equal; the requantized copies hold other weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "requantized")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def requantized_copy(source_path: str, type_name: str) -> str:
    """The GGUF file ``source_path`` with its quantized matrices dequantized and quantized again to
    ``type_name`` (by the gguf package), made once under ``CACHE``."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    target = os.path.join(CACHE, f"{os.path.basename(source_path)[:-5]}-{type_name}.gguf")
    if os.path.isfile(target):
        return target
    os.makedirs(CACHE, exist_ok=True)
    say(f"writing {target}")
    reader = GGUFReader(source_path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    tmp = target + ".tmp"
    w = GGUFWriter(tmp, arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    qtype = GGMLQuantizationType[type_name]
    for t in reader.tensors:
        data = t.data
        if t.tensor_type.name.startswith("Q"):
            w.add_tensor(t.name, quantize(dequantize(data, t.tensor_type), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data.copy())
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    os.rename(tmp, target)
    return target


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


PROMPT = [1, 504, 3458, 282, 4649, 314, 2, 198, 1, 4093, 198, 504, 3458, 282, 4649, 314]


def generate(engine, prompts: list[list[int]], streams: int, tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """``streams`` greedy streams through the offline ``engine`` (stream ``i`` on ``prompts[i %
    len(prompts)]``), ``tokens`` each, EOS ignored: (output tok/s, prefill included; each stream's tokens)."""
    import numpy as np

    from shared.messages import AddRequest, SamplingParams

    for i in range(streams):
        engine.add_request(AddRequest(f"{tag}-{i}", np.array(prompts[i % len(prompts)], dtype=np.int32),
                                      SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), 0.0))
    got: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return streams * tokens / (time.perf_counter() - t0), [got[f"{tag}-{i}"] for i in range(streams)]


def _generate(engine, streams: int, tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """Every stream the same 16-token prompt plus its own first token."""
    return generate(engine, [PROMPT + [100 + i] for i in range(streams)], streams, tokens, tag)


def child(variant: str, path: str, streams: list[int], tokens: int) -> dict:
    """One variant, in this process: load, warm up, measure."""
    from shared.cpu_threads import configure_cpu_threads

    configure_cpu_threads(None)  # as the executor: one OpenMP runtime for torch and numba, before torch
    import torch

    from services.executor.loader import RunnerOptions, build_runner
    from services.executor.quantized import weights_summary
    from services.executor.weights import load_hf_config, load_weights
    from services.offline import EngineCore
    from shared.model_source import resolve_model

    source = resolve_model(path)
    quantization = {"bf16": "none", "int8": "int8"}.get(variant, "gguf")
    options = RunnerOptions(dtype=torch.bfloat16, num_kv_blocks=256, num_cpu_blocks=0, quantization=quantization)
    t0 = time.perf_counter()
    config = load_hf_config(source)
    runner = build_runner(config, load_weights(source, config, quantization)[0], options)
    load_s = time.perf_counter() - t0
    engine = EngineCore(runner)
    _generate(engine, 2, 4, "warm")
    result = {"variant": variant, "load_s": round(load_s, 1), "rss_mib": round(_rss_mib(), 1),
              **weights_summary(runner.model), "tok_s": {}, "tokens": {}}
    for n in streams:
        rate, toks = _generate(engine, n, tokens, f"s{n}")
        result["tok_s"][str(n)] = round(rate, 1)
        result["tokens"][str(n)] = toks
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """Token positions before the first difference, summed over streams, and all positions."""
    same = 0
    for x, y in zip(a, b):
        same += next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return same, sum(len(x) for x in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="bf16,Q4_1,Q8_0,Q4_0")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    if args.child:
        print(json.dumps(child(args.child, args.path, streams, args.tokens)))
        return
    from loadtest.common.machine_state import print_cpu
    from shared.model_source import resolve_model

    print_cpu()
    embedded = resolve_model(None).where
    variants = args.variants.split(",")
    paths = {v: embedded if v in ("bf16", "Q4_1", "int8") else requantized_copy(embedded, v) for v in variants}
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            say(f"round {r + 1}/{args.rounds}: {v} ({os.path.basename(paths[v])})")
            out = subprocess.run([sys.executable, "-m", "loadtest.bench.quantized", "--child", v, "--path", paths[v],
                                  "--streams", args.streams, "--tokens", str(args.tokens)],
                                 capture_output=True, text=True, check=True)
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            say(f"  {runs[v][-1]['tok_s']} tok/s, rss {runs[v][-1]['rss_mib']} MiB")
    report(runs, streams)


def report(runs: dict[str, list[dict]], streams: list[int]) -> None:
    base = runs.get("bf16")
    head = ["variant", "weights MiB", "RSS MiB"] + [f"{n} stream(s) tok/s" for n in streams] + ["greedy agreement with bf16"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for v, rs in runs.items():
        first = rs[0]
        rates = [" / ".join(str(r["tok_s"][str(n)]) for r in rs) for n in streams]
        agree = "-"
        if base and v != "bf16":  # the file's weights in their blocks, or requantized from bf16's weights
            pairs = [agreement(first["tokens"][str(n)], base[0]["tokens"][str(n)]) for n in streams]
            same, total = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
            agree = f"{same}/{total} ({same / total:.0%})"
        types = ", ".join(f"{k} x{c}" for k, c in first.get("quantized_types", {}).items())
        print(f"| {v}{f' ({types})' if types else ''} | {first['weight_bytes'] / 2**20:.1f} | "
              f"{' / '.join(str(r['rss_mib']) for r in rs)} | " + " | ".join(rates) + f" | {agree} |")


if __name__ == "__main__":
    main()
