"""loadtest.profile.main on a tiny model: every part of a step is timed, the timing wrappers come off
afterwards, and the table and JSON are written."""

import json

import pytest

import torch

from loadtest.profile import main as profile, report as profile_report
from loadtest.profile.costs import MatmulRoofline, RooflinePasses, matmul_roofline, roofline_of
from loadtest.profile.step_timer import EXECUTOR_PARTS, RegionTimer, breakdown, install
from services.executor.loader import RunnerOptions, build_runner
from services.executor.architectures import model_config
from tests.doubles.engine import tiny_llama


def tiny_runner():
    hf = tiny_llama(seed=3)
    return build_runner(hf.config, hf.state_dict(), RunnerOptions(
        dtype=torch.float32, num_kv_blocks=64, num_cpu_blocks=0, max_model_len=200, attention_backend="torch"))


def test_every_part_of_a_decode_and_a_mixed_step_is_timed():
    runner = tiny_runner()
    bench = profile.StepBench(runner, max_num_seqs=8, max_num_batched_tokens=256)
    try:
        decode = profile.run_scenario(bench, "decode 4", 4, 20, (), warmup=1, steps=2)
        mixed = profile.run_scenario(bench, "mixed", 3, 20, (40,), warmup=0, steps=2)
        burst = profile.run_scenario(bench, "burst", 2, 20, (25, 3, 12), warmup=0, steps=1)
    finally:
        bench.close()
    assert len(decode) == 2 and len(mixed) == 2 and len(burst) == 1
    for parts in decode + mixed + burst:
        assert set(parts) == {key for key, _ in EXECUTOR_PARTS} | {"scheduler", "messages"}
        assert all(parts[key] > 0 for key in ("matmul", "attention", "norm", "rotary", "lm_head", "sampling",
                                              "scheduler", "messages"))
        assert parts["other_layer"] >= 0 and parts["runner"] >= 0
    assert not bench.scheduler.has_work()  # every request was aborted at the end of its scenario


def test_the_numba_backends_fused_decode_is_attention():
    """On the numba backend a decode-only step's attention is the fused decode of the backend's
    view of the pass (``for_pass``): timed as attention, not left to "other"; the wrappers come off."""
    hf = tiny_llama(seed=3)
    runner = build_runner(hf.config, hf.state_dict(), RunnerOptions(
        dtype=torch.float32, num_kv_blocks=64, num_cpu_blocks=0, max_model_len=200, attention_backend="numba"))
    bench = profile.StepBench(runner, max_num_seqs=8, max_num_batched_tokens=256)
    views = []
    for_pass = runner.backend.for_pass
    runner.backend.for_pass = lambda *args: views.append(for_pass(*args)) or views[-1]
    try:
        decode = profile.run_scenario(bench, "decode 4", 4, 20, (), warmup=0, steps=2)
    finally:
        bench.close()
        del runner.backend.for_pass
    assert all(parts["attention"] > 0 for parts in decode)
    assert views and all("decode_qkv" in vars(view) for view in views)  # the view's own, wrapped
    assert "for_pass" not in vars(runner.backend) and "decode_qkv" not in vars(runner.backend)


def test_the_roofline_is_timed_between_the_measured_steps():
    """A pass (or ``--roofline-repeats``) after each measured step, none after a warm-up step; the
    roofline is the best pass, and each step is set against the best pass of its own moment."""
    runner = tiny_runner()
    cfg = runner.model.config
    passes = RooflinePasses(cfg, torch.float32, num_tokens=3, num_sampled=3)
    groups = []
    bench = profile.StepBench(runner, max_num_seqs=4, max_num_batched_tokens=256)
    try:
        samples = profile.run_scenario(bench, "decode 3", 3, 20, (), warmup=2, steps=3,
                                       after_step=lambda: groups.append([passes.time_pass() for _ in range(2)]))
    finally:
        bench.close()
    assert len(samples) == 3 and [len(g) for g in groups] == [2, 2, 2]
    assert all(layers > 0 and head > 0 for g in groups for layers, head in g)
    steps = [sum(parts.values()) for parts in samples]
    roof = roofline_of(groups, steps)
    assert roof.layers_s == min(a for g in groups for a, _ in g) / 1e9
    assert roof.lm_head_s == min(b for g in groups for _, b in g) / 1e9
    assert roof.paired_ratios == tuple(s / min(a + b for a, b in g) for s, g in zip(steps, groups))
    # the pairing by hand: step 2's moment was slow, its ratio is not
    roof = roofline_of([[(2, 1), (3, 1)], [(6, 3)]], [6, 18])
    assert (roof.layers_s, roof.lm_head_s, roof.paired_ratios) == (2e-9, 1e-9, (2.0, 2.0))
    assert roofline_of([[(2, 1)]]).paired_ratios == ()
    with pytest.raises(ValueError):
        roofline_of([[(2, 1)]], [5, 6])


def test_a_mixed_step_of_several_prompts():
    lengths = profile.split_prompt(2032, 15)
    assert len(lengths) == 15 and sum(lengths) == 2032 and min(lengths) >= 1
    assert len(set(lengths)) > 1 and lengths == profile.split_prompt(2032, 15)  # varied, and the same each run
    assert profile.split_prompt(7, 1) == (7,) and profile.split_prompt(3, 3) == (1, 1, 1)
    with pytest.raises(ValueError):
        profile.split_prompt(3, 4)
    args = profile.parse_args(["--prefill", "100", "--prefill-prompts", "4", "--prefill-decodes", "8", "--batches", "2"])
    (_, _, ()), (label, decodes, prompts) = profile.scenarios(args)
    assert label == "prefill 100 in 4 + 8 dec" and decodes == 8 and sum(prompts) == 100 and len(prompts) == 4
    with pytest.raises(SystemExit):
        profile.parse_args(["--prefill", "10", "--prefill-prompts", "11"])


def test_the_wrappers_come_off():
    runner = tiny_runner()
    timer = RegionTimer()
    uninstall = install(runner, timer)
    linear = runner.model.model.layers[0].self_attn.qkv_proj
    assert "forward" in vars(linear) and "execute" in vars(runner)
    uninstall()
    assert "forward" not in vars(linear) and "execute" not in vars(runner) and "sample" not in vars(runner.sampler)
    assert not any("forward" in vars(m) for m in runner.model.modules())


def test_breakdown_derives_the_rest():
    parts = breakdown({"execute": 100, "forward": 70, "matmul": 30, "attention": 20, "norm": 5, "rotary": 5,
                       "lm_head": 10, "sampling": 5})
    assert parts["other_layer"] == 10 and parts["runner"] == 15


def test_roofline_times_the_model_shapes(tmp_path):
    cfg = model_config(tiny_llama(seed=3).config)
    roof = matmul_roofline(cfg, torch.float32, num_tokens=8, num_sampled=2, repeats=2)
    assert roof.layers_s > 0 and roof.lm_head_s > 0 and roof.total_s == roof.layers_s + roof.lm_head_s
    parts = {"matmul": 3e6, "attention": 1e6}
    results = [("decode 8", parts, MatmulRoofline(0.002, 0.001))]
    args = profile.parse_args(["--roofline-repeats", "2"])
    table = profile_report.format_table({}, results, args)
    assert "x1.33" in table  # step 4 ms / roofline 3 ms
    paired = profile_report.format_table({}, [("decode 8", parts, MatmulRoofline(0.002, 0.001, (1.5, 1.25, 1.375)))], args)
    assert "x1.38 (1.25-1.50)" in paired.splitlines()[-2]  # median (range) of each step's own ratio
    assert "best of 20 passes" in table  # 10 steps, 2 passes after each
    long_label = "prefill 2032 in 15 + 16 dec"
    header = profile_report.format_table({}, [*results, (long_label, parts, MatmulRoofline(0.002, 0.001))], args)
    assert f"decode 8  {long_label}" in header.splitlines()[0]  # the columns stay apart
    out = tmp_path / "profile.json"
    profile_report.write_json(str(out), {"dtype": "float32"}, results, {"outputs": 1e4, "detokenize": 2e4, "sse": 3e4})
    body = json.loads(out.read_text())
    assert body["scenarios"]["decode 8"]["parts_ms"] == {"matmul": 3.0, "attention": 1.0}
    assert body["frontend_ms_per_1000_tokens"]["sse"] == 30.0


@pytest.mark.slow
def test_frontend_costs_on_smollm2_streams():
    from loadtest.profile.costs import frontend_costs, stream_token_ids
    from shared.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    streams = stream_token_ids(tokenizer, 3, 50)
    assert [len(s) for s in streams] == [50, 50, 50] and streams[0] != streams[1]
    costs = frontend_costs(tokenizer, num_streams=3, num_tokens=50)
    assert set(costs) == {"outputs", "detokenize", "sse"} and all(v > 0 for v in costs.values())


def test_header_names_the_dtype_reason_and_the_matmul_kernel():
    args = profile.parse_args(["--dtype", "auto"])
    facts = {"model": "tiny", "dtype": "bfloat16", "reason": "AVX-512 BF16 matmuls (vdpbf16ps)",
             "backend": "numba", "linear": "numba", "prefill_kind": "numba"}
    first = profile_report.header(facts, args, (0.5, 0.5, 0.5)).splitlines()[0]
    assert "tiny in bfloat16 (auto: AVX-512 BF16 matmuls (vdpbf16ps))" in first
    assert "matmuls numba, attention backend numba" in first


def test_an_opt_model_is_profiled_too():
    """OPT (no rotary table, LayerNorms, two MLP matrices, narrower embeddings): its step's parts
    are timed, the prefill without maths runs, and the roofline has its shapes."""
    from loadtest.profile.costs import layer_shapes
    from tests.executor.test_opt import tiny_opt

    hf = tiny_opt(seed=3, word_embed_proj_dim=32)
    runner = build_runner(hf.config, hf.state_dict(), RunnerOptions(
        dtype=torch.float32, num_kv_blocks=64, num_cpu_blocks=0, max_model_len=100))
    bench = profile.StepBench(runner, max_num_seqs=8, max_num_batched_tokens=256)
    try:
        mixed = profile.run_scenario(bench, "mixed", 3, 20, (30,), warmup=0, steps=2)
    finally:
        bench.close()
    for parts in mixed:
        assert all(parts[key] > 0 for key in ("matmul", "attention", "norm", "lm_head", "sampling"))
        assert parts["rotary"] == 0
    cfg = runner.model.config
    assert layer_shapes(cfg) == [(64, 64), (64, 64), (64, 64), (64, 64), (64, 96), (96, 64)]
    passes = RooflinePasses(cfg, torch.float32, num_tokens=3, num_sampled=3)
    assert all(t > 0 for t in passes.time_pass())


def test_a_gpu_profile_synchronizes_every_reading_and_names_its_device(monkeypatch):
    """``--device cuda``: each clock reading waits for the GPU first (faked here: no GPU), and the
    header says the regions are synchronized; the CPU's header does not."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    ticks = iter(range(10, 100, 10))
    clock = profile.synchronized(lambda: next(ticks))
    assert (clock(), clock()) == (10, 20) and calls == ["sync", "sync"]
    args = profile.parse_args(["--device", "cuda", "--dtype", "float32"])
    facts = {"model": "tiny", "dtype": "float32", "reason": "--dtype float32", "backend": "cuda",
             "linear": "torch", "prefill_kind": "cuda", "device": "cuda:0"}
    lines = profile_report.header(facts, args, (0.5, 0.5, 0.5)).splitlines()
    assert any(line.startswith("device cuda:0: every timed region synchronized") for line in lines)
    cpu = profile_report.header({**facts, "device": "cpu"}, profile.parse_args([]), (0.5, 0.5, 0.5))
    assert "synchronized" not in cpu
