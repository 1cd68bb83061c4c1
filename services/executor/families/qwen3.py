"""Qwen3: Llama's layers with an RMS norm of each query and key head before the rotary embedding
(``q_norm``, ``k_norm``), no q/k/v bias unless ``attention_bias``; a sliding window only where
``use_sliding_window`` turns it on."""

from .common import decoder_config, layer_windows


def config(hf):
    windows = layer_windows(hf, hf.num_hidden_layers, "model qwen3") if getattr(hf, "use_sliding_window", False) else ()
    return decoder_config(hf, qk_norm=True, layer_windows=windows)
