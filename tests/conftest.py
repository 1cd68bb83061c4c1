"""Fixtures shared by the frontend tests: the real frontend app against a fake scheduler; and, for
the whole-server tests, one tiny model directory and one GGUF conversion cache for the session.

A test module sets ``MAX_MODEL_LEN`` to choose the served model's length (default 256) and may set
``MAX_BODY_BYTES``.
"""

import os
import sys

import openai
import pytest

from shared.endpoints import Endpoints  # transformers' hub kernels are off already (tests/__init__.py)
from tests.doubles.fake_scheduler import FakeScheduler, FrontendThread, default_served_model


def pytest_configure(config):
    """One converted copy of the embedded GGUF model for the test runs, in a directory of the
    virtualenv's (``shared.gguf_cache``: an entry is keyed by the file and the transformers
    version, so a venv with another transformers converts again): every process the tests start
    inherits it, pytest-xdist's workers too. It outlives the run, as the product's cache outlives a
    server, so a run converts only where the venv is new (8 s of a fast loop otherwise); the
    conversion itself is tested in its own directories (``tests/shared/test_gguf_cache.py``)."""
    os.environ.setdefault("PAGEDSERVE_GGUF_CACHE", os.path.join(sys.prefix, "pagedserve-gguf-cache"))
    _share_the_cores_between_workers()


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist each worker's own torch and Numba take their share of the cores (one
    each on two cores), not all of them: two workers' spinning OpenMP pools on two cores made the
    in-process SmolLM2 tests about 10x slower (the bf16 comparison's setup 236 s against 21).
    Tests that need a pool size set it themselves; the servers the tests start choose their own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    import numba
    import torch

    share = max(1, len(os.sched_getaffinity(0)) // workers)
    torch.set_num_threads(share)
    numba.set_num_threads(min(share, numba.config.NUMBA_NUM_THREADS))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama saved as safetensors with SmolLM2's tokenizer, shared by the servers the
    tests start (they only read it)."""
    from tests.doubles.serve import save_tiny_model

    return save_tiny_model(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_api_server(tmp_path_factory, tiny_model_dir):
    """``pagedserve serve`` on the tiny model for ``test_server_api`` and ``test_server_groups``
    (one server for both: a start fewer); its URL. Its log is in the ``serve-api`` folder."""
    from tests.doubles.serve import tiny_server
    from tests.system.test_server_api import MAX_MODEL_LEN, MODEL

    yield from tiny_server(tmp_path_factory, "serve-api", "--served-model-name", MODEL, "--max-model-len",
                           str(MAX_MODEL_LEN), "--kv-cache-memory", "16MiB", "--max-queue-len", "200",
                           model_dir=tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_f32_server(tmp_path_factory, tiny_model_dir):
    """``pagedserve serve`` on the tiny model in float32 (served as ``tiny``, 16 MiB of KV cache) for
    ``test_locust``, ``test_offline``, ``test_server_frontends`` and the tiny model's tool calls
    (tool_choice "auto" on, hermes' parser) and ``test_server_kv_events`` (KV cache events on ipc
    sockets ``kv-events`` and ``kv-replay`` in the folder) (one server for them: starts fewer):
    ``(URL, folder)``; the folder holds its ``serve.log`` and its socket directory (``TMPDIR``)."""
    from tests.doubles.serve import start_server, stop

    root = tmp_path_factory.mktemp("serve-f32")
    events = f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{root}/kv-events", ' \
             f'"replay_endpoint": "ipc://{root}/kv-replay", "topic": "kv@tiny"}}'
    proc, url = start_server(root, "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--dtype", "float32",
                             "--kv-cache-memory", "16MiB", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                             "--kv-events-config", events)
    yield url, root
    stop(proc)


@pytest.fixture(scope="module")
def model(request):
    return default_served_model(max_model_len=getattr(request.module, "MAX_MODEL_LEN", 256))


@pytest.fixture(scope="module")
def fake(model, tmp_path_factory):
    scheduler = FakeScheduler(Endpoints.in_directory(str(tmp_path_factory.mktemp("zmq"))), model.tokenizer).start()
    yield scheduler
    scheduler.stop()


@pytest.fixture(scope="module")
def frontend(request, model, fake):
    limit = getattr(request.module, "MAX_BODY_BYTES", None)
    server = FrontendThread(model, fake.endpoints, **({"max_body_bytes": limit} if limit else {})).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=frontend.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)
