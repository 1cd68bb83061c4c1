"""Llama (and SmolLM2, and Llama-shaped fine-tunes): the decoder's defaults."""

from .common import decoder_config


def config(hf):
    return decoder_config(hf)
