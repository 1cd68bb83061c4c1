"""Run by llama-cpp-python's own virtualenv (``loadtest/llama_cpp/setup.sh``), not pagedserve's:
reads a JSON request on stdin, answers JSON on stdout. Imports nothing of pagedserve.

- ``{"command": "scores", "model": path, "prompts": [[ids]], "threads": n}``: for each prompt, at
  every position but the last, llama.cpp's most likely next token and the logprob it gives the
  prompt's actual next token (``logits_all``);
- ``{"command": "quantize", "source": path, "target": path, "ftype": "Q4_K_M"}``: llama.cpp's own
  quantizer (``llama_model_quantize``, requantizing allowed).
"""

import json
import sys

import numpy as np


def without_amx_buffers() -> None:
    """Load weights without ggml's extra buffer types (its AMX repacking): on the Intel Xeon KVM
    guest ggml's AMX matmul died with SIGILL on ``tilezero`` even with the tile state permitted,
    so llama.cpp runs its AVX-512 kernels there (``use_extra_bufts``, llama.cpp's
    ``--no-extra-bufts``)."""
    import llama_cpp
    import llama_cpp.llama as high_level

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = high_level.llama_cpp.llama_model_default_params = params


def scores(req):
    if req.get("no_extra_buffers"):
        without_amx_buffers()
    from llama_cpp import Llama

    n_ctx = max(len(p) for p in req["prompts"]) + 8
    llm = Llama(model_path=req["model"], n_ctx=n_ctx, n_batch=n_ctx, logits_all=True,
                n_threads=req.get("threads", 2), verbose=False)
    out = []
    for ids in req["prompts"]:
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        top = logits.max(axis=-1, keepdims=True)
        logprobs = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
        n = len(ids) - 1
        out.append({"top1": logprobs[:n].argmax(axis=-1).tolist(),
                    "logprobs": logprobs[np.arange(n), ids[1:]].tolist()})
    return out


def quantize(req):
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{req['ftype']}")
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(req["source"].encode(), req["target"].encode(), params)
    return {"rc": int(rc)}


if __name__ == "__main__":
    request = json.load(sys.stdin)
    print(json.dumps({"scores": scores, "quantize": quantize}[request["command"]](request)))
