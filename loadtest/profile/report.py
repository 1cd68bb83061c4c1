"""The printed and written forms of ``loadtest.profile.main``'s measurements: the table of where a
step's time goes beside the matmul roofline (``format_table``), the header naming the machine and
the choices measured (``header``), the frontend's cost line (``format_frontend``) and the JSON
(``write_json``). ``results``: ``[(label, median ns per part, MatmulRoofline)]`` per scenario."""

from __future__ import annotations

import os
import statistics

EXTERNAL_PARTS = (("scheduler", "scheduler: schedule + update"),
                  ("messages", "messages: Step/StepResult/outputs msgpack + zmq"))


def format_table(facts: dict, results: list, args) -> str:
    from .step_timer import EXECUTOR_PARTS

    width = 62
    column = max(22, *(len(label) + 2 for label, _, _ in results))  # a long label keeps a space before it
    lines = [f"{'ms per step (% of step)':{width}}" + "".join(f"{label:>{column}}" for label, _, _ in results)]

    def row(name: str, values: list[str]) -> None:
        lines.append(f"{name:{width}}" + "".join(f"{v:>{column}}" for v in values))

    totals = [sum(parts.values()) / 1e6 for _, parts, _ in results]
    for key, name in (*EXTERNAL_PARTS, *(("", "executor:"),), *EXECUTOR_PARTS):
        if not key:
            row(name, [""] * len(results))
            continue
        indent = "  " if key not in dict(EXTERNAL_PARTS) else ""
        row(indent + name, [f"{parts.get(key, 0) / 1e6:8.2f} ({100 * parts.get(key, 0) / 1e6 / t:3.0f}%)"
                            for (_, parts, _), t in zip(results, totals)])
    row("step (sum of the medians)", [f"{t:8.2f}       " for t in totals])
    kernel = {"onednn": "oneDNN-packed", "numba": "Numba pairs"}.get(facts.get("linear"), "F.linear")
    row(f"matmuls alone: {kernel}, HF shapes, best of {args.steps * args.roofline_repeats} passes",
        [f"{r.total_s * 1e3:8.2f}       " for _, _, r in results])
    row("  of which the LM head", [f"{r.lm_head_s * 1e3:8.2f}       " for _, _, r in results])
    row("step / matmul roofline", [f"x{t / (r.total_s * 1e3):.2f}       " for t, (_, _, r) in zip(totals, results)])
    row("each step / the roofline pass after it: median (range)", [_paired(r.paired_ratios) for _, _, r in results])
    row("in-model matmuls + LM head / roofline",
        [f"x{(p.get('matmul', 0) + p.get('lm_head', 0)) / 1e6 / (r.total_s * 1e3):.2f}       "
         for _, p, r in results])
    return "\n".join(lines)


def _paired(ratios: tuple[float, ...]) -> str:
    if not ratios:
        return "-       "
    return f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def format_frontend(costs: dict[str, float], results: list) -> str:
    per_k = {k: v * 1000 / 1e6 for k, v in costs.items()}  # ns per token -> ms per 1000 tokens
    total = sum(per_k.values())
    text = (f"frontend, CPU-ms per 1000 output tokens: RequestOutputs decode {per_k['outputs']:.1f}, "
            f"detokenize {per_k['detokenize']:.1f}, SSE chunks {per_k['sse']:.1f}; total {total:.1f}")
    decodes = [(label, int(label.split()[-1])) for label, _, _ in results if label.startswith("decode")]
    if decodes:
        label, batch = decodes[-1]
        text += f" (at {label}: {total * batch / 1000:.2f} ms of frontend CPU per step)"
    return text


def write_json(path: str, facts: dict, results: list, costs: dict[str, float]) -> None:
    """ms per step per part and scenario, the roofline, the frontend's ms per 1000 tokens."""
    import json

    body = {"dtype": facts["dtype"], "frontend_ms_per_1000_tokens": {k: v / 1e3 for k, v in costs.items()},
            "scenarios": {label: {"parts_ms": {k: v / 1e6 for k, v in parts.items()},
                                  "roofline_ms": r.total_s * 1e3, "roofline_lm_head_ms": r.lm_head_s * 1e3,
                                  "step_over_roofline_paired": list(r.paired_ratios)}
                          for label, parts, r in results}}
    with open(path, "w") as f:
        json.dump(body, f, indent=1)


def header(facts: dict, args, load_before: tuple) -> str:
    import numba
    import torch

    from shared.cpu_features import read_cpu_features

    cpu = read_cpu_features()
    load_after = os.getloadavg()
    return "\n".join([
        f"pagedserve step profile: {facts['model']} in {facts['dtype']} ({args.dtype}: {facts['reason']}), "
        f"matmuls {facts.get('linear', '?')}, "
        f"attention backend {facts['backend']} (prefill: {facts.get('prefill_kind', facts['backend'])})",
        f"as a server's executor: {facts.get('executor_setup', '')} (here every step runs on all threads)",
        f"CPU: {cpu.model_name}, {os.cpu_count()} cores; threads: torch {torch.get_num_threads()}, "
        f"numba {numba.get_num_threads()} ({facts.get('threads_reason', '')}), "
        f"OpenMP: {facts.get('openmp', '')}; "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after",
        *([f"device {facts['device']}: every timed region synchronized (regions hold their kernels' time)"]
          if facts.get("device", "cpu") != "cpu" else []),
        f"{args.clock} clock; median of {args.steps} steps per column (after {args.warmup} warm-up), "
        f"context {args.context}; "
        "a shared machine makes absolute times noisy: compare ratios from one run",
    ])
