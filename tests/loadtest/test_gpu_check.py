"""``python -m loadtest.gpu.check``, the Python half of the GPU checks (``loadtest/gpu/gpu_check.sh``),
on the CPU: so that the script a GPU session runs, once and against the clock, is known to work.
A tiny random Llama stands in for SmolLM2's sizes."""

from __future__ import annotations

import json

import pytest

from loadtest.gpu import check as gpu_check


def test_report_counts_positions_and_fails_under_the_bound(capsys):
    refs = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert gpu_check.report("same", [[1, 2, 3, 4], [5, 6, 7, 8]], refs, 1.0) == 0
    out = capsys.readouterr().out
    assert "2/2 prompts identical, 8/8 tokens agree (100.0%)" in out and "PASS" in out
    # one token off in the second prompt: 7 of 8 agree, enough for 0.85, not for 0.9
    assert gpu_check.report("near", [[1, 2, 3, 4], [5, 9, 7, 8]], refs, 0.85) == 0
    assert gpu_check.report("near", [[1, 2, 3, 4], [5, 9, 7, 8]], refs, 0.9) == 1
    out = capsys.readouterr().out
    assert "prompt 1: 3/4 tokens agree, the first difference at token 1" in out
    assert "prompt 0" not in out and "7/8 tokens agree (87.5%)" in out and "FAIL" in out
    assert gpu_check.report("short", [[1, 2, 3, 4]], refs, 0.0) == 1  # a missing answer never passes


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A tiny Llama's config and SmolLM2's tokenizer: what ``export-config`` writes, smaller."""
    from tests.doubles.fake_scheduler import cached_tokenizer
    from tests.doubles.engine import tiny_llama

    tokenizer = cached_tokenizer()
    path = tmp_path_factory.mktemp("config")
    tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=256).config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow  # loads and runs a model through the whole check
def test_model_then_greedy_on_the_cpu(config_dir, tmp_path, capsys):
    """``model`` saves seeded random weights of the config's sizes (the same seed, the same
    weights); ``greedy`` runs the offline engine against transformers and passes in float32."""
    from safetensors.torch import load_file

    for name in ("a", "b"):
        assert gpu_check.main(["model", "--config", str(config_dir), "--out", str(tmp_path / name)]) == 0
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["hidden_size"] == 96
    code = gpu_check.main(["greedy", "--model", str(tmp_path / "a"), "--device", "cpu", "--dtype", "float32",
                           "--attention-backend", "numba", "--prompts", "3", "--tokens", "12"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "device cpu, attention numba" in out
    assert "3/3 prompts identical, 36/36 tokens agree (100.0%); needed 100%: PASS" in out


@pytest.mark.slow
def test_compare_against_a_running_server(tiny_f32_server, tiny_model_dir, capsys):
    """``compare``: the server's greedy completions, sent at once, equal transformers' in float32."""
    url, _ = tiny_f32_server
    code = gpu_check.main(["compare", "--url", url, "--model", str(tiny_model_dir), "--device", "cpu",
                           "--dtype", "float32", "--prompts", "4", "--tokens", "10"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4 completions at once" in out and "4/4 prompts identical, 40/40 tokens agree" in out
