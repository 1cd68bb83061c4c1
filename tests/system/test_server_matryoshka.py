"""``dimensions`` on a Matryoshka model through the whole server: a tiny random Llama whose
``config.json`` lists ``matryoshka_dimensions`` (as vLLM reads it), served with last-token pooling;
the shortened vector equals transformers' last hidden state cut to that length and normalized,
and a length the model does not list is a 400."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import torch

from tests.doubles.serve import save_tiny_model, tiny_server

pytestmark = pytest.mark.slow  # starts a server

DIMENSIONS = [16, 48]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModel, AutoTokenizer

    model_dir = save_tiny_model(tmp_path_factory)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": DIMENSIONS}))
    server = tiny_server(tmp_path_factory, "serve-matryoshka", "--served-model-name", "tiny", "--dtype", "float32",
                         "--kv-cache-memory", "16MiB", "--pooling-type", "last", model_dir=model_dir)
    url = next(server)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield model, AutoTokenizer.from_pretrained(model_dir), openai.OpenAI(base_url=f"{url}/v1", api_key="unused",
                                                                         max_retries=0, timeout=120)
    next(server, None)


def test_dimensions_shorten_a_matryoshka_models_last_token_embedding(served):
    model, tokenizer, client = served
    text = "Matryoshka embeddings keep their meaning when cut short."
    with torch.no_grad():
        last = model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0, -1].float()
    for dimensions in (None, *DIMENSIONS):
        kwargs = {} if dimensions is None else {"dimensions": dimensions}
        got = np.array(client.embeddings.create(model="tiny", input=text, encoding_format="float",
                                                **kwargs).data[0].embedding)
        want = torch.nn.functional.normalize(last[:dimensions], dim=0).numpy()
        assert len(got) == (dimensions or 96)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    with pytest.raises(openai.BadRequestError, match=r"matryoshka_dimensions \[16, 48\]"):
        client.embeddings.create(model="tiny", input=text, dimensions=17)
