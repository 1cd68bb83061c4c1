"""One small file per model family: how its transformers config reads into the decoder's knobs
(``decoder.ModelConfig``) and, where its checkpoints name or lay out weights otherwise, how their
tensors map onto the decoder's. ``architectures.py`` is the registry that names them by
``model_type``; the pieces they share (norms, rotary variants, soft-capping, activations) live once
in ``decoder.py`` and ``layers.py``."""
