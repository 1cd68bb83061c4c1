"""transformers' hub kernels off, so that our ``kernels/`` package and Hugging Face's ``kernels``
distribution live side by side.

transformers 5.25 and later require Hugging Face's ``kernels`` distribution, whose top-level import
name is our ``kernels/`` package's. transformers asks ``is_kernels_available()`` (the name found,
and a ``kernels`` distribution's version in its range) and then, at the import of
``transformers.integrations.hub_kernels`` (which every model load and ``activations`` import
reach), runs ``from kernels import CUDAProperties, ...``: where ``kernels`` is ours (this
project's root first on ``sys.path``, as in the tests; or our files installed over its
``__init__.py``), that import fails, and every model and tokenizer load with it. Its own switch,
``USE_HUB_KERNELS=NO``, does not prevent that import (it is read later); but it is needed too:
from 5.25 on, ``from_pretrained`` kernelizes every model unless it is set, and refuses to load
("Kernels are not available") where the probe says no.

``hide_hub_kernels()`` sets ``USE_HUB_KERNELS=NO`` (inherited by the processes this one starts)
and makes transformers' ``is_kernels_available()`` answer False in this process, as when the
distribution is not installed: transformers then defines its stand-ins, never imports
``kernels`` and loads models as they are. Our engine runs its own model code; transformers loads configs,
tokenizers and GGUF files (dequantized, as without hub kernels) and is the tests' reference, none
of which needs kernels fetched from the Hugging Face Hub (nor could fetch them: nothing here
downloads at run time). Call it before the first ``from transformers import ...`` of a code path;
it costs nothing after the first call, and the first imports only
``transformers.utils.import_utils``, which any transformers import loads anyway.
"""

from __future__ import annotations

import os
import sys

_MARK = "_pagedserve_hub_kernels_off"


def _kernels_unavailable(*args, **kwargs) -> bool:
    """transformers' ``is_kernels_available`` in a pagedserve process: Hugging Face's ``kernels``
    package is never importable under its name here (``kernels`` is ours)."""
    return False


setattr(_kernels_unavailable, _MARK, True)
setattr(_kernels_unavailable, "_dynamo_marked_constant", True)  # as transformers marks its own probe


def hide_hub_kernels() -> bool:
    """Turn transformers' hub kernels off (``USE_HUB_KERNELS=NO``) and make
    ``is_kernels_available()`` False wherever transformers holds it (its
    ``utils.import_utils`` and every module already imported that bound the name); modules imported
    later bind the replacement. Returns whether transformers takes hub kernels as unavailable
    now. Where ``transformers.integrations.hub_kernels`` was imported first it is left as it is
    (it imported; the probe's answer then stands)."""
    os.environ["USE_HUB_KERNELS"] = "NO"  # read at each from_pretrained
    from transformers.utils import import_utils

    original = getattr(import_utils, "is_kernels_available", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    if "transformers.integrations.hub_kernels" in sys.modules:
        return not original()
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "transformers" or name.startswith("transformers.")):
            # vars(), not getattr: transformers' lazy modules would import on a missing attribute
            if vars(module).get("is_kernels_available") is original:
                setattr(module, "is_kernels_available", _kernels_unavailable)
    return True
