"""Data parallelism through the real ``pagedserve serve -dp 2`` processes, on a tiny random Llama.

- Both replicas answer as transformers does (greedy, float32, token for token in text); prompts
  sharing a 32-token beginning meet at the replica that has it cached (the second of each pair
  reports those tokens cached; sent at random, half of the pairs would miss); unrelated prompts
  spread over both; ``/health`` and ``/metrics`` show the two replicas.
- Each replica publishes its KV cache events on its own sockets, tagged with its rank: a prompt's
  first block is stored by the replica that answered it.
- One replica's scheduler killed while streams run on both (checked: requests in flight there at
  the kill): serve restarts it, every stream ends
  exactly as transformers' greedy text (those on the lost replica handed to its new scheduler),
  a request sent meanwhile is answered, and the restart is counted for that replica.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest
import torch

from tests.doubles.fake_scheduler import cached_tokenizer
from tests.doubles.engine import hf_greedy
from tests.doubles.serve import openai_client, start_server, save_tiny_model, stop

pytestmark = pytest.mark.slow

FLAGS = ["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "256", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory, tiny_dir):
    tmp = tmp_path_factory.mktemp("dp2")
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp}/kv",
                         "replay_endpoint": f"ipc://{tmp}/kv-replay"})  # replica i: kv_dp<i> (i > 0)
    proc, url = start_server(tmp, "--model", str(tiny_dir), "-dp", "2", *FLAGS, "--kv-events-config", events)
    yield proc, url, tmp
    stop(proc)


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as resp:
        body = resp.read().decode()
        return json.loads(body) if url.endswith("/health") else body


def _prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, len(cached_tokenizer()), (length,), generator=generator).tolist()


def test_replicas_answer_as_transformers_and_prefixes_meet(dp_server, tiny_dir, hf_model):
    _, url, _ = dp_server
    client, model = openai_client(url), tiny_dir.name
    tokenizer = cached_tokenizer()
    for k in range(4):
        prefix = _prompt(100 + k, 32)
        replies = []
        for tail in range(2):
            prompt = prefix + _prompt(200 + 10 * k + tail, 5)
            reply = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert reply.choices[0].text == tokenizer.decode(hf_greedy(hf_model, prompt, 10), skip_special_tokens=True)
            replies.append(reply)
        assert replies[1].usage.prompt_tokens_details.cached_tokens == 32, f"pair {k} missed its prefix"
    health = _get(url + "/health")
    assert health["status"] == "ok" and health["data_parallel_size"] == 2
    pids = [r["processes"]["scheduler"]["pid"] for r in health["replicas"]]
    assert len(set(pids)) == 2 and all(r["status"] == "ok" for r in health["replicas"])
    lines = _get(url + "/metrics").splitlines()
    routed = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in lines
              if line.startswith("pagedserve:replica_routed_requests_total")}
    assert sum(routed.values()) == 8
    assert routed['reason="prefix",replica="0"'] + routed['reason="prefix",replica="1"'] == 4
    # the four pairs' first requests went by turns: two to each replica
    assert routed['reason="load",replica="0"'] == routed['reason="load",replica="1"'] == 2


class _Stream(threading.Thread):
    def __init__(self, client, model: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.prompt, self.max_tokens = client, model, prompt, max_tokens
        self.text, self.error, self.first = "", None, threading.Event()

    def run(self) -> None:
        try:
            for chunk in self.client.completions.create(model=self.model, prompt=self.prompt, stream=True,
                                                        max_tokens=self.max_tokens, temperature=0,
                                                        extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    self.text += chunk.choices[0].text
                    self.first.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.first.set()


def test_a_replica_s_scheduler_killed_mid_stream_loses_nothing(dp_server, tiny_dir, hf_model):
    _, url, tmp = dp_server
    client, model = openai_client(url), tiny_dir.name
    tokenizer = cached_tokenizer()
    prompts = [_prompt(500 + i, 12 + i) for i in range(4)]
    streams = [_Stream(client, model, p, 230) for p in prompts]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first.wait(120) and stream.error is None, stream.error
    victim = _get(url + "/health")["replicas"][1]["processes"]["scheduler"]["pid"]
    in_flight = _in_flight(url)  # read right before the kill: streams of 230 tokens are still running
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    assert in_flight[1] >= 1, f"no stream was running on replica 1: {in_flight}"
    meanwhile = _prompt(900, 20)
    reply = client.completions.create(model=model, prompt=meanwhile, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].text == tokenizer.decode(hf_greedy(hf_model, meanwhile, 8), skip_special_tokens=True)
    for stream, prompt in zip(streams, prompts):
        stream.join(300)
        assert not stream.is_alive() and stream.error is None, stream.error
        assert stream.text == tokenizer.decode(hf_greedy(hf_model, prompt, 230), skip_special_tokens=True)
    deadline = time.monotonic() + 120
    while True:
        health = _get(url + "/health")
        replica = health["replicas"][1]["processes"]["scheduler"]
        if health["status"] == "ok" and replica["num_restarts"] == 1 and "degraded" not in health:
            break
        assert time.monotonic() < deadline, f"replica 1 did not come back: {health}"
        time.sleep(0.2)
    assert replica["pid"] != victim
    from tests.doubles.vllm_kv_events import AllBlocksCleared

    seq, first = _kv_replay(tmp, 1)[0]  # the new scheduler's KV events begin anew: it holds nothing
    assert seq == 0 and first.ts > killed_at and isinstance(first.events[0], AllBlocksCleared)
    assert health["replicas"][0]["processes"]["scheduler"]["num_restarts"] == 0
    assert 'pagedserve:process_restarts_total{process="scheduler"} 1.0' in _get(url + "/metrics").splitlines()
    handed = [json.loads(line) for line in (tmp / "serve.log").read_text().splitlines()
              if '"requests handed to the new scheduler"' in line]
    assert handed and handed[0]["num_requests"] >= in_flight[1], "the killed replica's streams were not handed on"


def _in_flight(url: str) -> list[float]:
    """Requests the frontend has in flight at each replica (its /metrics)."""
    lines = [line for line in _get(url + "/metrics").splitlines()
             if line.startswith("pagedserve:replica_requests_in_flight{")]
    return [float(line.rsplit(" ", 1)[1]) for line in sorted(lines)]


def _kv_replay(tmp, rank: int) -> list:
    """Replica ``rank``'s buffered KV event batches from seq 0 (its replay socket), decoded as vLLM's."""
    import zmq

    from tests.doubles.vllm_kv_events import decode_batch

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp}/kv-replay" + (f"_dp{rank}" if rank else ""))
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    batches = []
    try:
        while True:
            assert dealer.poll(30_000), f"replica {rank}'s replay did not end"
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return batches
            batches.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    finally:
        ctx.destroy(linger=0)


def test_each_replica_publishes_its_own_kv_events_tagged_with_its_rank(dp_server, tiny_dir):
    from services.scheduler.block_manager import hash_block
    from services.scheduler.kv_cache_events import hash_int
    from tests.doubles.vllm_kv_events import apply

    _, url, tmp = dp_server
    client = openai_client(url)
    prompts = [_prompt(300 + k, 9) for k in range(6)]  # unrelated: spread over both replicas
    for prompt in prompts:
        client.completions.create(model=tiny_dir.name, prompt=prompt, max_tokens=2, temperature=0)
    firsts = {hash_int(hash_block(None, p[:4])) for p in prompts}
    deadline, held = time.monotonic() + 30, {}
    while time.monotonic() < deadline:  # a replica publishes in the loop turn after it answered
        for rank in (0, 1):
            held[rank] = set()
            for _, batch in _kv_replay(tmp, rank):
                assert batch.data_parallel_rank == rank
                apply(held[rank], batch.events)
        if firsts <= held[0] | held[1]:
            break
        time.sleep(0.1)
    assert firsts <= held[0] | held[1]
    assert firsts & held[0] and firsts & held[1], "both replicas answered some"
