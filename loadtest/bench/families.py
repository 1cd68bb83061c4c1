"""Each model family at SmolLM2-135M's sizes, random weights, in the offline engine:

    python -m loadtest.bench.families [--dtype auto] [--families llama,qwen3,...] [--tokens 32] [--streams 64]

Prints per family: weight memory, KV tokens per GiB, output tokens per second at 1 and at
``--streams`` streams (greedy, EOS ignored, prompts of 64 tokens), and that speed per FLOP relative
to the Llama path's (FLOPs per token: twice the matmul weights plus the attention over the
context). Windowed families get a window of 256 (Gemma 2 and 3 alternate windowed and global
layers as they do). Nothing is asserted: the figures depend on the machine, whose CPU is printed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from shared.hub_kernels import hide_hub_kernels

SIZES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
             rms_norm_eps=1e-5, tie_word_embeddings=True)
WINDOW = 256
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {}),
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW, pad_token_id=0)),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=64, pad_token_id=0)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=WINDOW, query_pre_attn_scalar=64, pad_token_id=0)),
}
PROMPT_LEN = 64


def say(msg: str) -> None:
    print(msg, flush=True)


def build(name: str, dtype: str, num_blocks: int):
    """(runner, engine) for family ``name`` at SmolLM2's sizes with random weights."""
    hide_hub_kernels()
    import transformers

    from services.executor.loader import RunnerOptions, build_runner
    from services.offline import EngineCore, SchedulingOptions

    config_name, own = FAMILIES[name]
    hf = getattr(transformers, config_name)(**{**SIZES, **own})
    state = random_state(hf)
    runner = build_runner(hf, state, RunnerOptions(dtype=dtype, num_kv_blocks=num_blocks))
    return runner, EngineCore(runner, SchedulingOptions(max_num_seqs=256, max_num_batched_tokens=4096))


def random_state(hf) -> dict[str, torch.Tensor]:
    """Random weights under the names transformers' model of ``hf`` has (built on the meta device
    for its names and shapes only)."""
    hide_hub_kernels()
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(p.shape, generator=gen) * (0.02 if p.dim() > 1 else 0.1) + (p.dim() == 1)
            for name, p in model.state_dict().items() if "rotary_emb" not in name}


def flops_per_token(cfg, context: int) -> float:
    s = cfg
    attn_w = s.hidden_size * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)
    mlp_w = 3 * s.hidden_size * s.intermediate_size
    windows = [cfg.window(i) for i in range(s.num_layers)]
    attended = sum(min(context, w) if w else context for w in windows)
    return 2.0 * (s.num_layers * (attn_w + mlp_w) + s.vocab_size * s.hidden_size) + 4.0 * s.num_heads * s.head_dim * attended


def run(engine, streams: int, tokens: int) -> float:
    """Output tokens per second of ``streams`` greedy requests of ``tokens`` tokens each."""
    from shared.messages import AddRequest, SamplingParams

    rng = np.random.default_rng(streams)
    for i in range(streams):
        prompt = rng.integers(3, 49152, PROMPT_LEN).astype(np.int32)
        engine.add_request(AddRequest(f"s{streams}-{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True), time.time()))
    engine.step()  # the prefills
    start, produced = time.perf_counter(), 0
    while engine.has_work():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    from services.executor.runner import kv_block_bytes
    from shared.cpu_features import read_cpu_features
    from shared.hf_config import weight_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=64)
    args = parser.parse_args(argv)
    say(f"cpu: {read_cpu_features().summary()}")
    rows = {}
    for name in args.families.split(","):
        say(f"{name}: building at SmolLM2-135M's sizes ...")
        runner, engine = build(name, args.dtype, num_blocks=(args.streams + 1) * (PROMPT_LEN + args.tokens) // 16 + 8)
        cfg = runner.model.config
        weights = weight_bytes(cfg, runner.kv_caches[0][0].element_size())  # as the memory plan counts them
        per_gib = 2**30 // kv_block_bytes(cfg, runner.block_size, runner.kv_caches[0][0].dtype) * runner.block_size
        run(engine, 1, 4)  # warm: kernels compiled, pools touched
        one, many = run(engine, 1, args.tokens), run(engine, args.streams, args.tokens)
        flops = flops_per_token(cfg, PROMPT_LEN + args.tokens // 2)
        rows[name] = (weights, per_gib, one, many, flops)
        say(f"{name}: weights {weights / 2**20:.1f} MiB, KV {per_gib:,} tokens/GiB, out tok/s: 1 stream {one:.1f}, "
            f"{args.streams} streams {many:.1f} ({runner.kv_caches[0][0].dtype})")
    base = rows.get("llama")
    say("\nfamily        weights MiB  KV tok/GiB  tok/s@1  tok/s@N  GFLOP/tok  speed per FLOP vs llama (1, N)")
    for name, (weights, per_gib, one, many, flops) in rows.items():
        rel = "" if base is None else f"{one * flops / (base[2] * base[4]):.2f}, {many * flops / (base[3] * base[4]):.2f}"
        say(f"{name:13s} {weights / 2**20:11.1f} {per_gib:11,} {one:8.1f} {many:8.1f} {flops / 1e9:10.3f}  {rel}")


if __name__ == "__main__":
    main()
