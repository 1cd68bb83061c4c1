"""Bad models fail before anything is built, in one line, with exit code 2; transformers never runs a
model's own code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.executor.memory_plan import plan_memory
from shared.hf_config import GIB, ModelCheckError, check_memory, load_hf_config, model_shape
from shared.model_source import ModelSource, resolve_model

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
}
ABSURD = {**TINY, "vocab_size": 10_000_000, "hidden_size": 1_048_576, "intermediate_size": 4_194_304,
          "num_hidden_layers": 1000, "num_attention_heads": 8192, "num_key_value_heads": 1}

# (config.json text, what the one-line error must say)
BAD_CONFIGS = {
    "bad-json": ('{"model_type": "llama", "hidden_size": 64,', "config.json is not valid JSON"),
    "not-an-object": ("[1, 2, 3]", "config.json must hold a JSON object"),
    "zero-heads": (json.dumps({**TINY, "num_attention_heads": 0}), "num_attention_heads must be a positive integer"),
    "heads-do-not-divide-hidden": (json.dumps({**TINY, "num_attention_heads": 5}),
                                   "hidden_size 64 is not divisible by num_attention_heads 5"),
    "kv-heads-do-not-divide-heads": (json.dumps({**TINY, "num_key_value_heads": 3}),
                                     "num_attention_heads 4 is not divisible by num_key_value_heads 3"),
    "zero-vocab": (json.dumps({**TINY, "vocab_size": 0}), "vocab_size must be a positive integer"),
    "zero-positions": (json.dumps({**TINY, "max_position_embeddings": 0}), "max_position_embeddings must be"),
    "negative-layers": (json.dumps({**TINY, "num_hidden_layers": -2}), "num_hidden_layers must be"),
    "string-size": (json.dumps({**TINY, "hidden_size": "64"}), "hidden_size must be a positive integer"),
    "nan-eps": (json.dumps({**TINY, "rms_norm_eps": float("nan")}), "rms_norm_eps must be a positive number"),
}


def model_dir(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(text)
    return path


def plan(config, **overrides):
    kwargs = dict(dtype_bytes=4, block_size=16, num_kv_blocks=None, kv_cache_memory_bytes=GIB // 64,
                  kv_cache_memory="16MiB", swap_space_gib=0.0, max_model_len=None)
    return plan_memory(config, "the executor", **{**kwargs, **overrides})


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_one_line(tmp_path, case):
    text, needle = BAD_CONFIGS[case]
    with pytest.raises(ModelCheckError) as info:
        load_hf_config(ModelSource(case, str(model_dir(tmp_path, case, text))))
    message = str(info.value)
    assert needle in message and "\n" not in message, message


def test_good_config_passes_and_sizes_are_planned(tmp_path):
    config = load_hf_config(ModelSource("tiny", str(model_dir(tmp_path, "tiny", json.dumps(TINY)))))
    shape = model_shape(config.to_dict(), "tiny")
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (4, 2, 16)
    memory = plan(config, max_model_len=100_000)
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K and V, layers, kv heads, block size, head dim, float32
    assert (memory.max_model_len, memory.block_bytes, memory.num_blocks) == (256, block_bytes, GIB // 64 // block_bytes)


def test_absurd_sizes_are_refused_before_allocating(tmp_path):
    config = load_hf_config(ModelSource("absurd", str(model_dir(tmp_path, "absurd", json.dumps(ABSURD)))))
    with pytest.raises(ModelCheckError, match=r"needs \d.* GiB \(weights .* GiB \+ KV pool") as info:
        plan(config)
    assert "\n" not in str(info.value)
    tiny = load_hf_config(ModelSource("tiny", str(model_dir(tmp_path, "tiny", json.dumps(TINY)))))
    with pytest.raises(ModelCheckError, match="KV pool"):
        plan(tiny, num_kv_blocks=10**12)  # a pool of petabytes
    with pytest.raises(ModelCheckError, match="holds no block"):
        plan(tiny, kv_cache_memory_bytes=10, kv_cache_memory="10")
    check_memory({"weights": 3 * GIB}, "x", available_bytes=4 * GIB)  # fits
    with pytest.raises(ModelCheckError, match=r"x needs 5\.0 GiB \(weights 3\.0 GiB \+ KV pool 2\.0 GiB\) but this "
                                              r"machine has 4\.0 GiB available"):
        check_memory({"weights": 3 * GIB, "KV pool": 2 * GIB}, "x", available_bytes=4 * GIB)


def test_a_gpu_pool_is_checked_against_the_gpu_and_swap_against_the_host(tmp_path):
    """On a GPU (``device_free_bytes``): weights, KV pool and rope tables must fit its free memory;
    the swap space is host memory, so a swap larger than the GPU is not refused for it."""
    tiny = load_hf_config(ModelSource("tiny", str(model_dir(tmp_path, "tiny", json.dumps(TINY)))))
    with pytest.raises(ModelCheckError, match=r"KV pool .* but cuda:0 has 0\.0 GiB available"):
        plan(tiny, device_free_bytes=GIB // 1024, device_name="cuda:0", kv_cache_memory_bytes=GIB // 64)
    memory = plan(tiny, device_free_bytes=GIB // 32, device_name="cuda:0", swap_space_gib=0.25)
    assert memory.num_cpu_blocks == GIB // 4 // memory.block_bytes


def _run_cli(tmp_path: Path, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path), "PAGEDSERVE_LOG_FORMAT": "json"}
    return subprocess.Popen([sys.executable, "-m", "services.cli", *argv], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # starts an executor and a server process
def test_executor_and_serve_exit_2_with_one_line(tmp_path):
    """As a user runs them: no traceback, the error as the last line, exit code 2."""
    endpoints = ["--step-endpoint", f"ipc://{tmp_path}/step", "--result-endpoint", f"ipc://{tmp_path}/result"]
    runs = {}
    for case in ("bad-json", "zero-heads"):
        directory = model_dir(tmp_path, case, BAD_CONFIGS[case][0])
        runs[case] = _run_cli(tmp_path, "executor", "--model", str(directory), *endpoints)
    absurd = model_dir(tmp_path, "absurd", json.dumps(ABSURD))
    runs["absurd"] = _run_cli(tmp_path, "executor", "--model", str(absurd), *endpoints)
    runs["serve"] = _run_cli(tmp_path, "serve", "--model", str(tmp_path / "zero-heads"), "--port", "0")
    runs["serve-device"] = _run_cli(tmp_path, "serve", "--device", "gpu", "--port", "0")
    needles = {"bad-json": "config.json is not valid JSON", "zero-heads": "num_attention_heads must be",
               "absurd": "needs", "serve": "num_attention_heads must be",
               "serve-device": "--device must be auto, cpu, cuda or cuda:N; got 'gpu'"}
    import torch

    if not torch.cuda.is_available():  # a GPU that is not there: the executor says so and exits 2
        tiny = model_dir(tmp_path, "tiny", json.dumps(TINY))
        runs["no-gpu"] = _run_cli(tmp_path, "executor", "--model", str(tiny), "--device", "cuda", *endpoints)
        needles["no-gpu"] = "--device cuda: torch"
    for case, proc in runs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (case, stderr[-2000:])
        assert "Traceback" not in stderr, (case, stderr[-2000:])
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("pagedserve") and needles[case] in last, (case, last)


def test_transformers_never_runs_model_code(monkeypatch, tmp_path):
    """Every call into transformers' Auto classes pins ``trust_remote_code=False``."""
    import transformers

    from services.executor import weights
    from services.frontend import served_model

    calls = []

    class Recorder:
        def __init__(self, result):
            self.result = result

        def from_pretrained(self, *args, **kwargs):
            calls.append(kwargs)
            return self.result

    class Model:
        def state_dict(self):
            return {}

    real_config = transformers.AutoConfig.from_pretrained(str(model_dir(tmp_path, "tiny", json.dumps(TINY))))
    monkeypatch.setattr(transformers, "AutoConfig", Recorder(real_config))
    monkeypatch.setattr(transformers, "AutoTokenizer", Recorder(object()))
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", Recorder(Model()))
    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", "off")  # the GGUF file itself (the cache's loads pin it too)
    gguf = resolve_model(None)
    served_model.load_tokenizer(gguf)
    served_model.model_max_len(gguf)
    weights.load_hf_config(gguf)
    weights.load_state_dict(gguf)
    assert len(calls) == 4 and all(kwargs.get("trust_remote_code") is False for kwargs in calls), calls


def test_pickled_weights_are_refused_with_the_reason(tmp_path):
    """A directory with only ``pytorch_model.bin`` (the older Hugging Face checkpoints) is refused in
    one line that says why and what to do; nothing unpickles it."""
    from services.executor.weights import load_state_dict
    from shared.model_source import ModelSource

    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"has no \*\.safetensors files \(pytorch_model\.bin: pickle files are "
                                         r"never read.*save the model as safetensors first"):
        load_state_dict(ModelSource("m", str(tmp_path)))
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match=r"has no \*\.safetensors files$"):
        load_state_dict(ModelSource("m", str(tmp_path)))
