"""Mistral: Llama's layers with a sliding window on every layer (``sliding_window``; null in the
later checkpoints, which attend to everything)."""

from .common import decoder_config, layer_windows


def config(hf):
    return decoder_config(hf, layer_windows=layer_windows(hf, hf.num_hidden_layers, "model mistral", every_layer=True))
