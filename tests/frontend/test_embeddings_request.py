"""The bodies of /v1/embeddings, /v1/rerank and /v1/score parsed (``embeddings_request``), with no
server: OpenAI's four input shapes, the limits, ``dimensions`` only for a Matryoshka model, Jina's
{text} documents, vLLM's score pairing; and the normalization after truncating (``normalized``)."""

from __future__ import annotations

import numpy as np
import pytest

from services.frontend.embeddings_engine import normalized
from services.frontend.embeddings_request import (
    MAX_EMBEDDING_INPUTS, parse_embeddings_body, parse_rerank_body, parse_score_body,
)
from services.frontend.errors import APIError
from services.frontend.served_model import matryoshka_dimensions


@pytest.mark.parametrize("value, want", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_openai_input_shapes(value, want):
    assert parse_embeddings_body({"input": value}, "m", None).inputs == want


@pytest.mark.parametrize("body, param", [
    ({}, "input"), ({"input": None}, "input"), ({"input": [1, "a"]}, "input"), ({"input": [[-1]]}, "input"),
    ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"), ({"input": "a", "encoding_format": 3}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"), ({"input": "a", "dimensions": True}, "dimensions"),
    ({"input": "a", "model": "other"}, "model"),
])
def test_bad_embeddings_bodies_name_their_field(body, param):
    with pytest.raises(APIError) as caught:
        parse_embeddings_body(body, "m", ())
    assert caught.value.status == 400 and caught.value.param == param


def test_dimensions_follow_the_models_matryoshka_config():
    assert matryoshka_dimensions({"hidden_size": 8}) is None
    assert matryoshka_dimensions({"is_matryoshka": True}) == ()
    assert matryoshka_dimensions({"matryoshka_dimensions": [4, 8]}) == (4, 8)
    assert parse_embeddings_body({"input": "a", "dimensions": 3}, "m", ()).dimensions == 3
    assert parse_embeddings_body({"input": "a", "dimensions": 4}, "m", (4, 8)).dimensions == 4
    with pytest.raises(APIError, match=r"one of the model's matryoshka_dimensions \[4, 8\]"):
        parse_embeddings_body({"input": "a", "dimensions": 3}, "m", (4, 8))
    with pytest.raises(APIError, match="not a Matryoshka embedding model") as refused:
        parse_embeddings_body({"input": "a", "dimensions": 4}, "m", None)
    assert refused.value.param == "dimensions"
    v = np.array([3.0, 4.0, 12.0], np.float32)
    np.testing.assert_allclose(normalized(v, 2), [0.6, 0.8], rtol=1e-6)  # truncated, then normalized
    np.testing.assert_allclose(normalized(v), v / 13.0, rtol=1e-6)


def test_rerank_and_score_bodies():
    body = parse_rerank_body({"query": "q", "documents": ["a", {"text": "b"}], "top_n": 5}, "m")
    assert (body.documents, body.top_n, body.return_documents) == (["a", "b"], 2, True)
    assert parse_score_body({"text_1": "q", "text_2": ["a", "b"]}, "m").pairs == [("q", "a"), ("q", "b")]
    assert parse_score_body({"text_1": ["x", "y"], "text_2": ["a", "b"]}, "m").pairs == [("x", "a"), ("y", "b")]
    for bad in ({"query": "q", "documents": [{"txt": "a"}]}, {"query": "", "documents": ["a"]},
                {"query": "q", "documents": ["a"], "top_n": 0}, {"query": "q", "documents": "a"}):
        with pytest.raises(APIError):
            parse_rerank_body(bad, "m")


def test_openapi_lists_the_three_routes_and_their_bodies():
    from services.frontend.openapi import openapi_spec

    spec = openapi_spec("0", "m", api_key_required=False)
    for path, schema in (("/v1/embeddings", "EmbeddingsRequest"), ("/v1/rerank", "RerankRequest"),
                         ("/v1/score", "ScoreRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{schema}"} and "400" in spec["paths"][path]["post"]["responses"]
        assert schema in spec["components"]["schemas"]
