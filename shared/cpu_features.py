"""What this CPU offers the model's arithmetic, and the dtype ``--dtype auto`` runs in on CPUs.

Rule: bfloat16 where the CPU multiplies bf16 natively *and* torch's matmul library (oneDNN) uses
it; float32 everywhere else. Native means either

- AMX (``amx_bf16`` and ``amx_tile``): oneDNN's ``avx512_core_amx`` kernels (Intel Xeon 4th gen
  and later), or
- AVX-512 BF16 (``avx512_bf16`` with ``avx512f``/``avx512bw``/``avx512vl``/``avx512dq``):
  oneDNN's ``avx512_core_bf16`` kernels (``vdpbf16ps``; Intel Cooper Lake, AMD Zen 4 and 5).

Both are read from ``/proc/cpuinfo`` and cross-checked with torch: its ATen dispatch level
(``torch.backends.cpu.get_cpu_capability()``) must be ``AVX512`` (a lower level means AVX-512 is
hidden or capped, e.g. by ``ATEN_CPU_CAPABILITY``), torch's own CPUID view
(``torch.cpu.get_capabilities()``, where this torch has it) must report the same bf16 flags, and
``ONEDNN_MAX_CPU_ISA`` must not cap oneDNN below the bf16 kernels. Any disagreement means
float32. Without either feature (e.g. AVX2-only CPUs) bf16 matmuls are emulated and float32 is
both faster and exact.

AMX counts only where oneDNN can use it: ``ONEDNN_MAX_CPU_ISA`` must not stop it below the AMX
kernels (``avx512_core_bf16`` leaves it the AVX-512 BF16 ones), and Linux must let the process use
the tiles (``torch.cpu._init_amx()``, which asks for them with ``arch_prctl``; kernels before 5.16
cannot grant it). Else the CPU counts as AVX-512 BF16. Besides the dtype, AMX decides the prefill
attention path (``kernels/cpu/backend.py``), and there a wrong answer is costly: with oneDNN
capped at ``avx512_core_bf16`` on the AMX Xeon, torch's fused attention took 754 ms for one
64-row prompt's 30 layers, where the Numba prefill took 6.1 ms (and 2.9 ms against 4.2 uncapped;
``/tmp/b/prefill_paths.py``, 2026-12-02).

Measured (torch 2.13.0+cpu, oneDNN 3.12, ``F.linear``, min of a 1-2 s run per pair, both dtypes
in one process, machine shared with other jobs; bf16 time / fp32 time):

| CPU | [64,576]x[576,1536] | [64,576]x[576,576] | [1,576]x[576,49152] | one decode step's matmuls, batch 1 / 16 / 64 |
|---|---|---|---|---|
| AMD EPYC Zen 5, avx512_bf16, no AMX, 1 thread | 0.25 (1.02 -> 0.26 ms) | 0.27 | 0.49 | 0.77 / 0.26 / 0.22 |
| same, 2 threads | 0.26 (0.56 -> 0.14 ms) | 0.34 | 0.28 | 0.88 / 0.19 / 0.17 |
| Intel Xeon with AMX (issue 14) | 0.23 (0.60 -> 0.14 ms) | | | |

(oneDNN's verbose log on the EPYC: ``brg_matmul:avx512_core_bf16``.) The one shape where bf16
loses on the EPYC is a tiny one, ``[1,576]x[576,1536]`` (1.2x slower, 0.05 ms): a whole batch-1
step is still faster in bf16. float32 stays available with ``--dtype float32``: it is the mode
whose greedy output equals ``transformers`` token for token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

AMX_FLAGS = ("amx_bf16", "amx_tile")
AVX512_BF16_FLAGS = ("avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq")
_REPORTED = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
# torch.cpu.get_capabilities() spells a few flags differently from /proc/cpuinfo
_TORCH_NAMES = {"avx512f": "avx512_f", "avx512bw": "avx512_bw", "avx512vl": "avx512_vl",
                "avx512dq": "avx512_dq"}
# ONEDNN_MAX_CPU_ISA values that stop oneDNN short of its bf16 kernels
_ONEDNN_ISAS_WITHOUT_BF16 = {"sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core",
                             "avx512_core_vnni"}
# ... and those that stop it short of its AMX kernels (avx10_1_512 is avx512_core_fp16's new name)
_ONEDNN_ISAS_WITHOUT_AMX = _ONEDNN_ISAS_WITHOUT_BF16 | {"avx512_core_bf16", "avx512_core_fp16",
                                                        "avx10_1_512"}


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str
    flags: frozenset[str]  # /proc/cpuinfo flags (all of them)
    torch_capability: str | None  # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, ...
    torch_flags: frozenset[str] | None  # flags torch.cpu.get_capabilities() reports true
    onednn_max_isa: str | None  # the ONEDNN_MAX_CPU_ISA environment variable
    amx_permitted: bool | None = None  # whether Linux lets this process use AMX tiles (None: not asked)

    def has(self, names) -> bool:
        """Every flag in ``names`` per /proc/cpuinfo and, where torch reports flags, per torch."""
        if not all(n in self.flags for n in names):
            return False
        return self.torch_flags is None or all(_TORCH_NAMES.get(n, n) in self.torch_flags
                                               for n in names)

    def onednn_cap(self) -> str:
        """``ONEDNN_MAX_CPU_ISA`` in lower case (oneDNN reads it either way); "" where unset."""
        return (self.onednn_max_isa or "").lower()

    def native_bf16(self) -> str | None:
        """``"amx"`` or ``"avx512_bf16"`` where bf16 matmuls run natively, else None."""
        if self.torch_capability != "AVX512":
            return None
        if self.onednn_cap() in _ONEDNN_ISAS_WITHOUT_BF16:
            return None
        if (self.has(AMX_FLAGS) and self.amx_permitted is not False
                and self.onednn_cap() not in _ONEDNN_ISAS_WITHOUT_AMX):
            return "amx"
        if self.has(AVX512_BF16_FLAGS):
            return "avx512_bf16"
        return None

    def summary(self) -> dict:
        """What the start-up log shows."""
        return {"cpu": self.model_name,
                "cpu_flags": sorted(f for f in self.flags if f in _REPORTED),
                "torch_cpu_capability": self.torch_capability,
                "onednn_max_isa": self.onednn_max_isa,
                "amx_permitted": self.amx_permitted}


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in a /proc/cpuinfo text. Where the text gives
    the CPU family and model numbers, the name ends with them: a VM may name its CPU only "AMD
    EPYC", which "(family 25, model 17)" (Zen 4) tells apart from family 26 (Zen 5)."""
    model, flags, numbers, blocks = "unknown", frozenset(), {}, 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            blocks += 1
            if blocks > 1:
                break  # the next processor's block
        elif key == "model name":
            model = value.strip()
        elif key == "flags":
            flags = frozenset(value.split())
        elif key in ("cpu family", "model") and value.strip().isdigit():
            numbers[key] = value.strip()
    if model != "unknown" and len(numbers) == 2:
        model = f"{model} (family {numbers['cpu family']}, model {numbers['model']})"
    return model, flags


def _torch_view() -> tuple[str | None, frozenset[str] | None]:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.8
    if get_capabilities is None:
        return capability, None
    return capability, frozenset(k for k, v in get_capabilities().items() if v is True)


def read_cpu_features(cpuinfo_path: str = "/proc/cpuinfo") -> CpuFeatures:
    """This machine's CPU, as /proc/cpuinfo and torch see it (no /proc/cpuinfo: no flags)."""
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            model, flags = parse_cpuinfo(f.read())
    except OSError:
        model, flags = "unknown", frozenset()
    capability, torch_flags = _torch_view()
    permitted = _amx_permitted() if all(f in flags for f in AMX_FLAGS) else None
    return CpuFeatures(model, flags, capability, torch_flags, os.environ.get("ONEDNN_MAX_CPU_ISA"),
                       permitted)


def _amx_permitted() -> bool | None:
    """Whether Linux lets this process use AMX tiles (asking for them, as oneDNN does before its
    first AMX kernel); None where this torch cannot say."""
    import torch

    init_amx = getattr(torch.cpu, "_init_amx", None)
    return None if init_amx is None else bool(init_amx())


def choose_cpu_dtype(features: CpuFeatures) -> tuple[str, str]:
    """``("bfloat16" | "float32", reason)`` for ``--dtype auto`` on this CPU."""
    native = features.native_bf16()
    if native == "amx":
        return "bfloat16", "AMX bf16 matmuls (oneDNN avx512_core_amx)"
    if native == "avx512_bf16":
        return "bfloat16", "AVX-512 BF16 matmuls (vdpbf16ps)"
    if features.torch_capability != "AVX512":
        why = f"torch's CPU capability is {features.torch_capability}, not AVX512"
    elif features.onednn_cap() in _ONEDNN_ISAS_WITHOUT_BF16:
        why = f"ONEDNN_MAX_CPU_ISA={features.onednn_max_isa} stops oneDNN short of bf16"
    else:
        why = "no AMX-BF16 or AVX-512 BF16 (as both /proc/cpuinfo and torch report it)"
    return "float32", f"{why}: bf16 matmuls would be emulated"
