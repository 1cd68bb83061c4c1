"""The whole server started as a user would (``pagedserve serve``), answered through real clients."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request

import pytest

from tests.docs.readme_blocks import curl_request, readme_block
from tests.doubles.serve import children_of, openai_client, start_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
README_URL = "http://127.0.0.1:8000"  # where the README's examples send, replaced by the test server's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The embedded model served by the README's quick-start command, ``./dev serve``."""
    root = tmp_path_factory.mktemp("serve")
    proc, url = start_server(root, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "256MiB", dev=True)
    yield proc, url, root
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from shared.model_source import resolve_model

    src = resolve_model(None)
    return AutoTokenizer.from_pretrained(src.directory, **src.pretrained_kwargs())


def test_streamed_chat_knows_paris(server):
    _, url, _ = server
    stream = openai_client(url).chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40, temperature=0, stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_the_readmes_curl_example_streams_the_answer(server):
    _, url, _ = server
    readme_url, headers, body = curl_request(readme_block("sh", "curl "))
    request = urllib.request.Request(readme_url.replace(README_URL, url), data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=120) as resp:
        events = [line[len("data: "):] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if json.loads(e)["choices"])
    assert "Paris" in text


def test_the_readmes_openai_example_prints_the_answer(server, capsys):
    _, url, _ = server
    code = readme_block("python", "OpenAI(")
    assert README_URL in code
    exec(compile(code.replace(README_URL, url), "README.md", "exec"), {})
    assert "Paris" in capsys.readouterr().out


def test_completion_usage_matches_tokenizer(server, tokenizer):
    _, url, _ = server
    prompt = "The three primary colors are"
    resp = openai_client(url).completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert resp.choices[0].finish_reason == "length"
    # The streamed text with usage included is the same greedy text.
    stream = openai_client(url).completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12


def _post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize(
    "body, needle",
    [
        (b'{"model": "SmolLM2-135M-Instruct", "prompt": "hi", ', "json"),
        (json.dumps({"model": "gpt-17", "prompt": "hi"}).encode(), "gpt-17"),
        (json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": -5}).encode(), "max_tokens"),
        (json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "word " * 2 * MAX_MODEL_LEN}).encode(),
         str(MAX_MODEL_LEN)),
    ],
    ids=["malformed-json", "unknown-model", "max-tokens-zero", "max-tokens-negative", "prompt-too-long"],
)
def test_bad_requests_get_400_and_server_keeps_serving(server, body, needle):
    _, url, _ = server
    status, payload = _post(url, "/v1/completions", body)
    assert status == 400
    err = payload["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert needle.lower() in err["message"].lower()
    ok_status, ok = _post(url, "/v1/completions", json.dumps(
        {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 3}).encode())
    assert ok_status == 200 and ok["usage"]["completion_tokens"] >= 1


def test_repeated_prompt_reports_cached_tokens(server, tokenizer):
    _, url, _ = server
    prompt = "Here is a long list of fruit: " + ", ".join(["apple", "pear", "plum", "fig"] * 12)
    num_prompt = len(tokenizer(prompt)["input_ids"])
    client = openai_client(url)
    first = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every full 16-token block of the prompt, leaving at least its last token to compute
    assert second.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // 16 * 16 > 0


def test_sigterm_stops_all_and_removes_sockets(server):
    """Runs last in this module: it stops the shared server."""
    proc, _, root = server
    children = children_of(proc.pid)
    assert sorted(children.values()) == ["executor", "frontend", "scheduler"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0  # a clean exit (the timeout only guards against a hang)
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not [p for p in os.listdir(root) if p.startswith("pagedserve-")], "socket directory left behind"


API_KEY = "sk-argv-check-5d1e"


@pytest.fixture(scope="module")
def keyed_small_pool_server(tmp_path_factory, tiny_model_dir):
    """One tiny-model server for the next three tests (each reads only what its flag changes): an
    API key, a pool of 24 blocks of 4 tokens, and ``--max-restarts 0`` (the last test ends it by
    killing its executor)."""
    root = tmp_path_factory.mktemp("serve-keyed")
    proc, url = start_server(root, "--model", str(tiny_model_dir), "--block-size", "4", "--num-kv-blocks", "24",
                       "--api-key", API_KEY, "--max-restarts", "0")
    yield proc, url, root
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)


def test_api_key_stays_off_every_argv(keyed_small_pool_server):
    """``serve --api-key`` hands the key to the frontend in its environment: no child's argv (which
    /proc shows to every user) holds it, and only the frontend's environment does."""
    proc, url, _ = keyed_small_pool_server
    children = children_of(proc.pid)
    assert sorted(children.values()) == ["executor", "frontend", "scheduler"]
    for pid, name in children.items():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert API_KEY.encode() not in f.read(), name
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
        assert (f"PAGEDSERVE_API_KEY={API_KEY}".encode() in environ) == (name == "frontend"), name
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{url}/v1/models", timeout=30)
    assert info.value.code == 401
    request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 200


def test_preempted_requests_complete_and_say_so(keyed_small_pool_server, tiny_model_dir):
    import concurrent.futures

    from openai import OpenAI

    _, url, _ = keyed_small_pool_server
    client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def ask(i):
        return client.completions.create(model=tiny_model_dir.name, prompt=[5 + i] * 10, max_tokens=40,
                                         temperature=0, extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(8)))  # 8 x 50 tokens need 100 blocks; the pool has 24
    assert all(r.usage.completion_tokens == 40 for r in replies)
    assert sum(r.usage.model_extra["num_preemptions"] for r in replies) > 0


def test_dead_executor_stops_everything_without_restarts(keyed_small_pool_server):
    """Runs last on this server (``--max-restarts 0``): it ends it."""
    proc, _, root = keyed_small_pool_server
    try:
        children = children_of(proc.pid)
        executor = next(pid for pid, name in children.items() if name == "executor")
        os.kill(executor, signal.SIGKILL)
        assert proc.wait(timeout=20) != 0
        log = (root / "serve.log").read_text()
        assert "the executor process failed 1 time within 600 s (--max-restarts 0" in log
        assert "was killed by SIGKILL" in log
        for pid, name in children.items():
            if name != "executor":
                assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        assert not [p for p in os.listdir(root) if p.startswith("pagedserve-")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


