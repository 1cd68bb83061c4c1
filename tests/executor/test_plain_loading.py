"""What a process reads of a model without importing torch through ``transformers``' config
classes, against ``transformers``' own reading (the reference): a supported model's ``config.json``
(``shared.hf_config.plain_config``) and a generic tokenizer (``shared.model_source.load_tokenizer``).
Anything read otherwise goes to ``transformers``."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoConfig, AutoTokenizer

from services.executor.architectures import model_config
from shared.hf_config import PlainConfig, load_hf_config, model_shape
from shared.model_source import ModelSource, _generic_tokenizer, eos_token_ids, load_tokenizer

BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
V5_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}

# config.json variants the engine reads itself: each model type, v4 and v5 rotary forms, keys left
# to their defaults, explicit head_dim, tied embeddings, attention bias
PLAIN = {
    "llama-v4-defaults": {"model_type": "llama", **BASE},
    "llama-v4-theta": {"model_type": "llama", **BASE, "rope_theta": 250000.0, "rms_norm_eps": 1e-5, "rope_scaling": None},
    "llama-v5": {"model_type": "llama", **BASE, **V5_ROPE, "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
    "llama-head-dim": {"model_type": "llama", **BASE, "head_dim": 32, "attention_bias": True},
    "mistral-v4": {"model_type": "mistral", **BASE, "rope_theta": 1000000.0, "sliding_window": None},
    "mistral-v5": {"model_type": "mistral", **BASE, **V5_ROPE, "sliding_window": 64},
    "qwen2-v4": {"model_type": "qwen2", **BASE, "rope_theta": 1000000.0, "tie_word_embeddings": True},
    "qwen2-v5": {"model_type": "qwen2", **BASE, **V5_ROPE, "rms_norm_eps": 1e-6},
}
# ... and variants left to transformers: a KV head count whose default differs between the classes,
# rotary scaling in the v4 form, another model type
TRANSFORMERS = {
    "mistral-default-kv-heads": {"model_type": "mistral", **{k: v for k, v in BASE.items() if k != "num_key_value_heads"},
                                 "num_attention_heads": 16, "sliding_window": None},
    # no sliding_window: transformers' default (4096) applies
    "mistral-default-window": {"model_type": "mistral", **BASE, "max_position_embeddings": 8192},
    "llama-v4-scaling": {"model_type": "llama", **BASE, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "qwen3": {"model_type": "qwen3", **BASE},
}


def source(tmp_path, name: str, config: dict) -> ModelSource:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return ModelSource(name, str(directory))


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_plain_config_builds_the_model_transformers_reads(tmp_path, name):
    src = source(tmp_path, name, PLAIN[name])
    plain = load_hf_config(src)
    assert isinstance(plain, PlainConfig)
    reference = AutoConfig.from_pretrained(src.directory, trust_remote_code=False)
    assert model_config(plain) == model_config(reference)
    assert model_shape(plain.to_dict(), name) == model_shape(reference.to_dict(), name)
    assert plain.max_position_embeddings == reference.max_position_embeddings


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_what_plain_config_cannot_read_goes_to_transformers(tmp_path, name):
    config = load_hf_config(source(tmp_path, name, TRANSFORMERS[name]))
    assert not isinstance(config, PlainConfig)
    assert config.model_type == TRANSFORMERS[name]["model_type"]


def test_mistral_without_kv_heads_gets_transformers_default(tmp_path):
    config = load_hf_config(source(tmp_path, "m", TRANSFORMERS["mistral-default-kv-heads"]))
    assert model_config(config).num_kv_heads == 8  # MistralConfig's default, not the head count


def test_a_missing_key_is_an_attribute_error_like_transformers():
    config = PlainConfig({"model_type": "llama", **BASE})
    assert getattr(config, "rope_parameters", None) is None
    with pytest.raises(AttributeError):
        config.no_such_key
    assert config.to_dict()["rms_norm_eps"] == 1e-6


# ---------------------------------------------------------------- the tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "émoji 🙂 and 漢字", "<|im_start|>user\nhi<|im_end|>",
         "a" * 300, ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


def test_the_generic_tokenizer_is_the_one_autotokenizer_loads(tiny_model_dir):
    source = ModelSource("tiny", str(tiny_model_dir))
    assert _generic_tokenizer(source)
    ours, reference = load_tokenizer(source), AutoTokenizer.from_pretrained(str(tiny_model_dir), trust_remote_code=False)
    assert type(ours) is type(reference)
    assert ours.get_vocab() == reference.get_vocab() and len(ours) == len(reference)
    assert ours.all_special_tokens == reference.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == \
        (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id, reference.unk_token_id)
    assert ours.chat_template == reference.chat_template and ours.chat_template
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    for upto in (2, 4):
        assert (ours.apply_chat_template(CHAT[:upto], tokenize=True, add_generation_prompt=True)
                == reference.apply_chat_template(CHAT[:upto], tokenize=True, add_generation_prompt=True))
    assert eos_token_ids(ours, source) == eos_token_ids(reference, source)


def _copy_with(tmp_path, tiny_model_dir, name: str, config: dict | None = None, tokenizer: dict | None = None):
    directory = tmp_path / name
    shutil.copytree(tiny_model_dir, directory)
    for file, changes in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        if changes:
            data = json.loads((directory / file).read_text())
            (directory / file).write_text(json.dumps({**data, **changes}))
    return ModelSource(name, str(directory))


@pytest.mark.parametrize("name,config,tokenizer", [
    ("qwen2", {"model_type": "qwen2"}, None),  # transformers registers Qwen2's own class
    ("named-class", None, {"tokenizer_class": "GPT2Tokenizer"}),
    ("own-code", None, {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}),
])
def test_other_tokenizers_go_through_autotokenizer(tmp_path, tiny_model_dir, name, config, tokenizer):
    assert not _generic_tokenizer(_copy_with(tmp_path, tiny_model_dir, name, config, tokenizer))


def test_a_gguf_file_goes_through_autotokenizer(tiny_model_dir):
    assert not _generic_tokenizer(ModelSource("g", str(tiny_model_dir), gguf_file="model.gguf"))
