"""``pagedserve serve --speculative-config`` (ngram) on the tiny random model in float32, through the
official openai client: greedy completions (whole and streamed) are transformers' text, max_tokens
and stop strings are exact, and /metrics counts the drafts consistently. A bad config stops the
command at start with a one-line error."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest
import torch

from tests.doubles.engine import hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["one two three four one two three four one two three four one two",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
           "The capital of France is"]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory, tiny_model_dir):
    from tests.doubles.serve import tiny_server

    yield from tiny_server(tmp_path_factory, "serve-spec", "--served-model-name", "tiny", "--dtype", "float32",
                           "--kv-cache-memory", "16MiB", "--speculative-config", json.dumps(SPEC),
                           model_dir=tiny_model_dir)


def _metric(text: str, name: str) -> dict[str, float]:
    """position label (or "") -> value of ``pagedserve:name``."""
    out = {}
    for m in re.finditer(rf'^pagedserve:{name}(?:{{position="(\d+)"}})?\s+(\S+)$', text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


@pytest.mark.slow  # starts the whole server
def test_served_greedy_with_speculation_is_transformers_text(spec_server, tiny_model_dir):
    _check_completions(spec_server, tiny_model_dir)


@pytest.mark.slow  # starts the whole server with two executor ranks
def test_two_ranks_with_speculation_are_transformers_text(tmp_path, tiny_model_dir):
    """-tp 2: rank 1 never samples; its token histories take each step's drafts and are put right
    by the next step's tokens (``TokenHistories.observe``)."""
    from tests.doubles.serve import start_server, stop

    proc, url = start_server(tmp_path, "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--dtype",
                             "float32", "--kv-cache-memory", "16MiB", "-tp", "2", "--speculative-config",
                             json.dumps(SPEC))
    try:
        _check_completions(url, tiny_model_dir)
    finally:
        stop(proc)


def _check_completions(url: str, model_dir) -> None:
    """Greedy completions (whole, streamed, with a stop string) of ``PROMPTS`` are transformers'
    text, and /metrics counts drafts consistently."""
    from transformers import AutoModelForCausalLM

    from tests.doubles.fake_scheduler import cached_tokenizer
    from tests.doubles.serve import openai_client

    tokenizer = cached_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    client = openai_client(url)
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        want_ids = hf_greedy(model, prompt, 24)
        want = tokenizer.decode(want_ids)
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == want and resp.usage.completion_tokens == 24
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
        stop = tokenizer.decode(want_ids[10:12])  # a stop string inside the continuation
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == want[:want.index(stop)] and resp.choices[0].finish_reason == "stop"
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    proposed = _metric(metrics, "spec_decode_num_draft_tokens_per_pos_total")
    accepted = _metric(metrics, "spec_decode_num_accepted_tokens_per_pos_total")
    assert sum(proposed.values()) > 0 and set(accepted) == set(proposed)
    for pos in proposed:
        assert accepted[pos] <= proposed[pos]
    assert _metric(metrics, "spec_decode_num_draft_tokens_total")[""] == sum(proposed.values())


def test_a_bad_speculative_config_stops_serve_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": -1}'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    (error,) = [line for line in proc.stderr.splitlines() if "error" in line]  # argparse's one line
    assert "--speculative-config" in error and "num_speculative_tokens must be a positive integer" in error
