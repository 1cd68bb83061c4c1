"""Qwen2 and 2.5: Llama's layers with biases on the q, k and v projections; a sliding window only
where ``use_sliding_window`` turns it on (its ``layer_types`` say which layers)."""

from .common import decoder_config, layer_windows


def config(hf):
    windows = layer_windows(hf, hf.num_hidden_layers, "model qwen2") if getattr(hf, "use_sliding_window", False) else ()
    return decoder_config(hf, attention_bias=True, layer_windows=windows)
