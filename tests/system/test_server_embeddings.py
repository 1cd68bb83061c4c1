"""/v1/embeddings, /v1/rerank and /v1/score through the whole server (``pagedserve serve`` on the
tiny random Llama in float32, mean pooling, 4-token blocks, 16-token prefill chunks): the official
``openai`` client's ``embeddings.create`` (float and base64) against transformers' pooled final
hidden states, rerank and score over HTTP against scoring each pair alone, embeddings beside a
running generation, ``dimensions`` on a Matryoshka model (its ``config.json`` lists
``matryoshka_dimensions``, as vLLM reads it), and the 400s."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import requests
import torch

from services.frontend.embeddings_request import MAX_EMBEDDING_INPUTS
from tests.doubles.serve import save_tiny_model, tiny_server

pytestmark = pytest.mark.slow  # starts a server

TOLERANCE = 1e-5
MAX_MODEL_LEN = 128
DIMENSIONS = [16, 48]  # the Matryoshka lengths the served model's config.json lists
TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome; the capital of Spain is Madrid, "
         "and the capital of Portugal is Lisbon, which lies on the Atlantic coast.",
         "Two plus two is four.", "Rome", "A short note about the weather in Lisbon."]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the Hugging Face base model, its tokenizer, the server's URL, an ``openai`` client)."""
    from transformers import AutoModel, AutoTokenizer

    model_dir = save_tiny_model(tmp_path_factory)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": DIMENSIONS}))
    server = tiny_server(tmp_path_factory, "serve-embeddings", "--served-model-name", "tiny", "--dtype", "float32",
                         "--kv-cache-memory", "16MiB", "--block-size", "4", "--max-num-batched-tokens", "16",
                         "--max-model-len", str(MAX_MODEL_LEN), "--pooling-type", "mean", model_dir=model_dir)
    url = next(server)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield model, AutoTokenizer.from_pretrained(model_dir), url, client
    next(server, None)  # stops it


def reference(model, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    """transformers' final hidden states (after the final norm), mean-pooled, cut to ``dimensions``
    and L2-normalized."""
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].float()
    return torch.nn.functional.normalize(hidden.mean(dim=0)[:dimensions], dim=0).numpy()


def test_openai_client_embeddings_equal_transformers(served):
    model, tokenizer, _, client = served
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert len(ids[0]) > 32  # several blocks and prefill chunks
    as_floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks base64 and decodes it
    from_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert as_floats.usage.prompt_tokens == sum(map(len, ids)) == from_ids.usage.prompt_tokens
    for i, want in enumerate(reference(model, x) for x in ids):
        for response in (as_floats, as_base64, from_ids):
            assert response.data[i].index == i
            np.testing.assert_allclose(np.array(response.data[i].embedding), want, atol=TOLERANCE, rtol=0)


def test_base64_is_little_endian_float32(served):
    _, _, url, _ = served
    body = {"input": TEXTS[1]}
    floats = requests.post(f"{url}/v1/embeddings", json=body | {"encoding_format": "float"}, timeout=60).json()
    b64 = requests.post(f"{url}/v1/embeddings", json=body | {"encoding_format": "base64"}, timeout=60).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, np.array(floats["data"][0]["embedding"], np.float32))


def test_rerank_order_equals_scoring_each_pair_alone(served):
    model, tokenizer, url, _ = served
    query, docs = TEXTS[2], [TEXTS[0], {"text": TEXTS[1]}, TEXTS[3]]
    ranked = requests.post(f"{url}/v1/rerank", json={"query": query, "documents": docs}, timeout=60).json()
    alone = [requests.post(f"{url}/v1/score", json={"text_1": query, "text_2": d if isinstance(d, str) else d["text"]},
                           timeout=60).json()["data"][0]["score"] for d in docs]
    assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: -alone[i])
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], sorted(alone, reverse=True),
                               atol=1e-6)
    q = reference(model, tokenizer(query)["input_ids"])
    want = [float(q @ reference(model, tokenizer(d if isinstance(d, str) else d["text"])["input_ids"])) for d in docs]
    np.testing.assert_allclose(alone, want, atol=TOLERANCE)
    top = requests.post(f"{url}/v1/rerank", json={"query": query, "documents": docs, "top_n": 1,
                                                  "return_documents": False}, timeout=60).json()
    assert top["results"] == [{"index": ranked["results"][0]["index"],  # within rounding: batched otherwise
                               "relevance_score": pytest.approx(ranked["results"][0]["relevance_score"], abs=1e-6)}]
    pairwise = requests.post(f"{url}/v1/score", json={"text_1": [query, TEXTS[0]], "text_2": [TEXTS[1], TEXTS[3]]},
                             timeout=60).json()
    assert [d["index"] for d in pairwise["data"]] == [0, 1]
    np.testing.assert_allclose(pairwise["data"][0]["score"], alone[1], atol=1e-6)


def test_embeddings_beside_a_running_generation(served):
    model, tokenizer, _, client = served
    prompt = "Once upon a time, in a land far away, there lived"
    alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0.0).choices[0].text
    with ThreadPoolExecutor(4) as pool:
        generation = pool.submit(client.completions.create, model="tiny", prompt=prompt, max_tokens=40,
                                 temperature=0.0)
        embeddings = [pool.submit(client.embeddings.create, model="tiny", input=[t], encoding_format="float")
                      for t in TEXTS * 2]
        assert generation.result().choices[0].text == alone
        for text, future in zip(TEXTS * 2, embeddings):
            np.testing.assert_allclose(np.array(future.result().data[0].embedding),
                                       reference(model, tokenizer(text)["input_ids"]), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("body, param, words", [
    ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input", f"at most {MAX_EMBEDDING_INPUTS}"),
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "empty list"),
    ({"input": [[]]}, "input", "must not be empty"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float, base64"),
    ({"input": [5] * MAX_MODEL_LEN}, "input", "maximum context length is 128"),
    ({"input": "hi", "dimensions": 8}, "dimensions", "matryoshka_dimensions [16, 48]"),
    ({"query": "q", "documents": []}, "documents", "must not be empty"),
    ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "same length"),
])
def test_bad_requests_are_400s_naming_the_field(served, body, param, words):
    _, _, url, _ = served
    path = "/v1/rerank" if "query" in body else "/v1/score" if "text_1" in body else "/v1/embeddings"
    resp = requests.post(url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_metrics_count_the_embedded_prompt_tokens(served):
    _, _, url, client = served

    def metric(name: str) -> float:
        text = requests.get(f"{url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    before = metric("pagedserve:prompt_tokens_total")
    usage = client.embeddings.create(model="tiny", input=TEXTS[1:3], encoding_format="float").usage
    assert metric("pagedserve:prompt_tokens_total") - before == usage.prompt_tokens


def test_dimensions_shorten_a_matryoshka_models_embedding(served):
    model, tokenizer, _, client = served
    ids = tokenizer(TEXTS[0])["input_ids"]
    for dimensions in (None, *DIMENSIONS):
        kwargs = {} if dimensions is None else {"dimensions": dimensions}
        got = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float", **kwargs)
        assert len(got.data[0].embedding) == (dimensions or model.config.hidden_size)
        np.testing.assert_allclose(np.array(got.data[0].embedding), reference(model, ids, dimensions),
                                   atol=TOLERANCE, rtol=0)
    with pytest.raises(openai.BadRequestError, match=r"matryoshka_dimensions \[16, 48\]"):
        client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=17)
