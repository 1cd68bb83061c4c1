"""The GGUF conversion cache (``shared.gguf_cache``): the converted directory gives the same
weights, config and tokenizer as the GGUF file read by ``transformers``, is made once, follows the
file, and is skipped (the GGUF file read as before) when off or unwritable."""

from __future__ import annotations

import os

import pytest
import torch

from services.executor.weights import load_state_dict
from shared.gguf_cache import MARKER, _parsed_once, converted_directory, entry_key
from shared.hf_config import load_hf_config
from shared.model_source import ModelSource, eos_token_ids, load_tokenizer, resolve_model

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is", "def fibonacci(n):\n    return n", "  spaces, émojis 🙂 and <|im_end|> tags"]


@pytest.fixture(scope="module")
def gguf_source():
    """The embedded model read straight from its GGUF file (no cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_GGUF_CACHE", "off")
        source = resolve_model(None)
    assert source.gguf_file is not None and source.converted_from is None
    return source


@pytest.fixture(scope="module")
def converted_source():
    """The converted copy in the run's cache (``tests/conftest.py``): made here or by an earlier test."""
    source = resolve_model(None)
    assert source.gguf_file is None and source.converted_from.endswith(".gguf")
    assert os.path.isfile(os.path.join(source.directory, MARKER))
    return source


def test_converted_copy_equals_the_gguf_file(gguf_source, converted_source):
    # transformers reads the GGUF file for the weights, the config and the tokenizer alike; here
    # it parses the file once for all three (``_parsed_once``, as the conversion does: the reader is
    # read-only): the test's call took 26.8 s before, 7.8 s after (pytest --durations, 2-core Xeon)
    with _parsed_once():
        expected, old = load_state_dict(gguf_source), load_hf_config(gguf_source).to_dict()
        tok_old = load_tokenizer(gguf_source)
    got = load_state_dict(converted_source)
    tied = set(expected) - set(got)
    assert tied <= {"lm_head.weight"}  # a tied LM head is stored once, as transformers saves it
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    new = load_hf_config(converted_source).to_dict()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters"):
        assert new[key] == old[key], key
    assert "quantization_config" not in new
    tok_new = load_tokenizer(converted_source)
    for text in TEXTS:
        assert tok_new(text)["input_ids"] == tok_old(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi"}]
    assert (tok_new.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == tok_old.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert eos_token_ids(tok_new, converted_source)[0] == eos_token_ids(tok_old, gguf_source)[0]


def test_made_once_and_follows_the_file(tmp_path, monkeypatch, converted_source):
    """A second lookup reuses the entry; a changed file has another key; a file that does not
    convert leaves no entry behind and is read as before."""
    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", os.path.dirname(converted_source.directory))
    assert resolve_model(None).directory == converted_source.directory  # no second conversion
    assert resolve_model(None, convert_gguf=False).directory == converted_source.directory  # found, not made
    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", str(tmp_path / "empty-cache"))
    assert resolve_model(None, convert_gguf=False).gguf_file is not None  # nothing made: the GGUF file itself
    assert not (tmp_path / "empty-cache").exists()
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf file")
    key = entry_key(str(gguf))
    os.utime(gguf, ns=(1_000_000_000, 1_000_000_000))
    assert entry_key(str(gguf)) != key
    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    assert converted_directory(str(tmp_path), "broken.gguf", "broken") is None  # falls back, no entry left
    assert not [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")]
    source = resolve_model(str(gguf))
    assert source == ModelSource("broken", str(tmp_path), "broken.gguf")  # read as before: its own error there


def test_off_or_unwritable_reads_the_gguf_file(tmp_path, monkeypatch, gguf_source):
    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", "off")
    assert resolve_model(None) == gguf_source
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", str(blocker / "cache"))  # cannot be created
    assert resolve_model(None) == gguf_source


def test_the_conversion_parses_the_file_once(tmp_path):
    """While converting, gguf's reader is made once per file and its tensor-name map once per
    architecture (``transformers`` asks for each several times); afterwards both are gguf's own."""
    import gguf
    import numpy as np

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(tmp_path / "." / "tiny.gguf")) is first  # the same file, another spelling
        assert [t.name for t in first.tensors] == ["token_embd.weight"]
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not first


def test_a_clash_with_hugging_faces_kernels_package_gets_a_hint(monkeypatch, gguf_source):
    """transformers 5.25+ imports Hugging Face's ``kernels`` package, whose name is ours: the error
    says what to do; other errors get no hint."""
    import shared.model_source as model_source

    def clash(source):
        raise ImportError("cannot import name 'CUDAProperties' from 'kernels' (/x/kernels/__init__.py)")

    monkeypatch.setattr(model_source, "_generic_tokenizer", clash)
    with pytest.raises(ValueError, match=r"CUDAProperties.*shared/hub_kernels.py.*`pip uninstall kernels`"):
        load_tokenizer(gguf_source)
    assert model_source.kernels_clash_hint(ImportError("cannot import name 'x' from 'numba'")) == ""
    assert model_source.kernels_clash_hint(ValueError("from 'kernels'")) == ""
