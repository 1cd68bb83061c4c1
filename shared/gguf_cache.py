"""A GGUF model converted once into a plain Hugging Face directory, reused by every later load.

Reading a GGUF file through ``transformers`` takes seconds every time (on a 2-core machine about
12 s for SmolLM2-135M: the metadata, a 49k-token vocabulary, is parsed twice and every tensor is
dequantized), and every process that needs the model pays it: the frontend for the tokenizer, each
executor rank for the weights, again after each restart. So the first load writes what
``transformers`` made of the file (``config.json``, ``model.safetensors`` in float32,
``generation_config.json``, the tokenizer files) into a cache directory, and later loads read that
directory: the same tensors and the same tokenizer, in well under a second.

- Where: ``$PAGEDSERVE_GGUF_CACHE`` (``off`` disables the cache), else
  ``$XDG_CACHE_HOME/pagedserve/gguf``, else ``~/.cache/pagedserve/gguf``.
- Key: the file's real path, size and modification time, and the ``transformers`` version that
  converted it; a changed file or a new ``transformers`` gets a new entry.
- The conversion itself reads the file once (``_parsed_once``): on the 2-core Xeon of issue 14,
  SmolLM2-135M took 33.9 s to convert before that and 15.0 s after, into byte-identical files.
- Processes that start together convert once: an exclusive ``flock`` on the entry's lock file,
  the entry written under a temporary name and renamed into place with a ``complete`` marker.
- A cache that cannot be written (read-only home, full disk), or a file that does not convert, is
  logged and skipped: the model then loads from the GGUF file as before (and a broken file gets
  its one-line error there).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile

import structlog

from shared.hub_kernels import hide_hub_kernels

FORMAT_VERSION = 1  # bump when what an entry holds changes
MARKER = "pagedserve-complete.json"

log = structlog.get_logger()


def cache_root() -> str | None:
    """The cache directory, or None when ``PAGEDSERVE_GGUF_CACHE=off``."""
    configured = os.environ.get("PAGEDSERVE_GGUF_CACHE", "")
    if configured.lower() in ("off", "0", "false", "no"):
        return None
    if configured:
        return os.path.abspath(os.path.expanduser(configured))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedserve", "gguf")


def entry_key(gguf_path: str) -> str:
    """What identifies one conversion: the file (path, size, mtime) and the converter's version."""
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    # the installed version from its metadata: importing transformers for it took 0.5 s of each start
    version = importlib.metadata.version("transformers")
    text = f"{FORMAT_VERSION}|{real}|{st.st_size}|{st.st_mtime_ns}|transformers {version}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def converted_directory(directory: str, gguf_file: str, name: str, create: bool = True) -> str | None:
    """A Hugging Face directory holding ``directory/gguf_file`` converted, made on first use (with
    ``create``); None when the cache is off, cannot be written, or has no entry and ``create`` is
    false (then load from the GGUF file)."""
    root = cache_root()
    if root is None:
        return None
    gguf_path = os.path.join(directory, gguf_file)
    target = os.path.join(root, f"{name}-{entry_key(gguf_path)}")
    if os.path.isfile(os.path.join(target, MARKER)):
        return target
    if not create:
        return None
    try:
        os.makedirs(root, exist_ok=True)
        with open(target + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same file
            if not os.path.isfile(os.path.join(target, MARKER)):
                _convert(directory, gguf_file, target)
    except Exception as exc:  # noqa: BLE001 - unwritable cache, or a file transformers cannot read:
        # either way the caller loads the GGUF file itself (and reports a broken file in one line)
        log.warning("gguf cache not used", directory=root, error=f"{type(exc).__name__}: {str(exc)[:200]}",
                    hint="PAGEDSERVE_GGUF_CACHE=DIR names another place, =off turns the cache off")
        return None
    return target


def _convert(directory: str, gguf_file: str, target: str) -> None:
    """Load the GGUF file with ``transformers`` and save model and tokenizer under ``target``."""
    import torch
    hide_hub_kernels()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting gguf once", gguf_file=os.path.join(directory, gguf_file), into=target)
    root = os.path.dirname(target)
    tmp = tempfile.mkdtemp(dir=root, prefix=".converting-")
    try:
        with _parsed_once():
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32,
                                                         trust_remote_code=False)
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file, trust_remote_code=False)
        _save_weights(model, os.path.join(tmp, "model.safetensors"))
        config = model.config
        if hasattr(config, "quantization_config"):  # the weights are plain float32 now
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"gguf_file": os.path.realpath(os.path.join(directory, gguf_file)),
                       "format_version": FORMAT_VERSION}, f)
        shutil.rmtree(target, ignore_errors=True)  # an entry left without its marker
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("gguf converted", into=target)


@contextlib.contextmanager
def _parsed_once():
    """While converting, ``gguf``'s file reader and tensor-name map made once per argument set.

    ``transformers`` opens the file anew for the config, the model and the tokenizer (each time
    parsing every metadata field item by item, the 49k-token vocabulary among them), and builds
    gguf's tensor-name map once per module of the model (397 times for SmolLM2). Both read only;
    ``transformers`` imports them from ``gguf`` at each call, so the module's attributes are
    replaced for the conversion and put back after. Without ``gguf`` (transformers then cannot
    read the file either) nothing is replaced."""
    try:
        import gguf
    except ImportError:
        yield
        return
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_class(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _save_weights(model, path: str) -> None:
    """Every tensor once (``save_pretrained`` refuses a GGUF-loaded model): a tied LM head is left
    out, as ``transformers`` itself saves it, and tied again when the directory is loaded."""
    from safetensors.torch import save_file

    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous()
    save_file(state, path, metadata={"format": "pt"})
