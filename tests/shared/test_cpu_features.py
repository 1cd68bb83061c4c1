"""``--dtype auto`` on CPUs: bf16 only where the CPU multiplies bf16 natively and torch agrees."""

from __future__ import annotations

import pytest
import torch

from services.executor.weights import resolve_dtype
from shared.cpu_features import CpuFeatures, choose_cpu_dtype, parse_cpuinfo, read_cpu_features

_AVX512 = "fpu sse sse2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"
# the three machine kinds this project has run on (flags abridged to the relevant ones)
CPUINFO = {
    "epyc_zen5": ("AMD EPYC 9B45", _AVX512 + " avx512_bf16 avx512_vp2intersect"),
    "xeon_amx": ("Intel(R) Xeon(R) Platinum 8581C CPU @ 2.10GHz",
                 _AVX512 + " avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"),
    "epyc_avx2": ("AMD EPYC 7B12", "fpu sse sse2 avx avx2 fma f16c"),
}
_TORCH_NAMES = {"avx512f": "avx512_f", "avx512bw": "avx512_bw", "avx512vl": "avx512_vl",
                "avx512dq": "avx512_dq"}


def _cpuinfo_text(model: str, flags: str) -> str:
    block = f"processor\t: {{n}}\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"
    return block.format(n=0) + block.format(n=1)


def _features(kind: str, capability: str | None = None, torch_agrees: bool = True,
              onednn_max_isa: str | None = None, amx_permitted: bool | None = None) -> CpuFeatures:
    model, flags = parse_cpuinfo(_cpuinfo_text(*CPUINFO[kind]))
    capability = capability or ("AVX512" if "avx512f" in flags else "AVX2")
    torch_flags = frozenset(_TORCH_NAMES.get(f, f) for f in flags)
    if not torch_agrees:
        torch_flags -= {"avx512_bf16", "amx_bf16"}
    return CpuFeatures(model, flags, capability, torch_flags, onednn_max_isa, amx_permitted)


def test_parse_cpuinfo_names_the_family_and_model_where_given():
    block = ("processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: 17\n"
             "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\n")
    model, flags = parse_cpuinfo(block.format(n=0, family=25) + block.format(n=1, family=26))
    assert model == "AMD EPYC (family 25, model 17)"  # the first processor's numbers
    assert flags == frozenset({"fpu", "avx2", "avx512_bf16"})
    no_numbers = "processor\t: 0\nmodel name\t: AMD EPYC\nmodel\t\t: x\nflags\t\t: fpu\n"
    assert parse_cpuinfo(no_numbers)[0] == "AMD EPYC"


def test_parse_cpuinfo_reads_the_first_processor():
    model, flags = parse_cpuinfo(_cpuinfo_text(*CPUINFO["xeon_amx"]))
    assert model.startswith("Intel(R) Xeon(R)")
    assert {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f"} <= flags
    assert parse_cpuinfo("") == ("unknown", frozenset())


@pytest.mark.parametrize("kind,dtype,native", [
    ("xeon_amx", "bfloat16", "amx"),
    ("epyc_zen5", "bfloat16", "avx512_bf16"),
    ("epyc_avx2", "float32", None),
])
def test_each_machine_kind_gets_its_dtype(kind, dtype, native):
    features = _features(kind)
    assert features.native_bf16() == native
    chosen, reason = choose_cpu_dtype(features)
    assert chosen == dtype
    assert ("AMX bf16" in reason) == (native == "amx")
    assert ("AVX-512 BF16 matmuls" in reason) == (native == "avx512_bf16")


@pytest.mark.parametrize("kind", ["xeon_amx", "epyc_zen5"])
def test_float32_when_torch_disagrees_or_is_capped(kind):
    assert choose_cpu_dtype(_features(kind, torch_agrees=False))[0] == "float32"
    chosen, reason = choose_cpu_dtype(_features(kind, capability="AVX2"))
    assert chosen == "float32" and "AVX2" in reason
    chosen, reason = choose_cpu_dtype(_features(kind, onednn_max_isa="AVX512_CORE"))
    assert chosen == "float32" and "ONEDNN_MAX_CPU_ISA" in reason
    # a cap at or above the bf16 kernels changes nothing
    assert choose_cpu_dtype(_features(kind, onednn_max_isa="avx512_core_amx"))[0] == "bfloat16"


@pytest.mark.parametrize("cap,permitted,native", [
    (None, True, "amx"),
    (None, None, "amx"),  # this torch cannot say: the flags decide, as before
    (None, False, "avx512_bf16"),  # Linux refused the tiles: oneDNN runs its AVX-512 BF16 kernels
    ("AVX512_CORE_BF16", True, "avx512_bf16"),
    ("avx10_1_512", True, "avx512_bf16"),
    ("AVX512_CORE_FP16", True, "avx512_bf16"),
    ("AVX10_1_512_AMX", True, "amx"),
    ("avx512_core_amx", True, "amx"),
])
def test_amx_counts_only_where_onednn_can_use_it(cap, permitted, native):
    features = _features("xeon_amx", onednn_max_isa=cap, amx_permitted=permitted)
    assert features.native_bf16() == native
    chosen, reason = choose_cpu_dtype(features)
    assert chosen == "bfloat16" and ("AMX bf16" in reason) == (native == "amx")


def test_the_prefill_path_follows_a_cap_below_amx(monkeypatch):
    """On any machine: with oneDNN capped below its AMX kernels, the backend keeps the Numba
    prefill (torch's fused attention took 754 ms instead of 6 ms for a 64-row prompt there)."""
    import torch

    from services.executor.attention import select_backend

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    features = read_cpu_features()
    assert features.native_bf16() != "amx" and "amx_permitted" in features.summary()
    assert select_backend("numba", torch.device("cpu")).matmul_prefill_path is False


def test_torch_without_a_flag_view_relies_on_cpuinfo():
    features = _features("epyc_zen5")
    features = CpuFeatures(features.model_name, features.flags, "AVX512", None, None)
    assert choose_cpu_dtype(features)[0] == "bfloat16"


def test_resolve_dtype_explicit_auto_and_errors():
    cpu = torch.device("cpu")
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                        ("float16", torch.float16)):
        assert resolve_dtype(name, cpu).dtype == dtype
    assert resolve_dtype("auto", torch.device("cuda")).dtype == torch.bfloat16
    choice = resolve_dtype("auto", cpu)
    expected, reason = choose_cpu_dtype(read_cpu_features())
    assert str(choice.dtype) == f"torch.{expected}" and choice.reason == reason
    assert choice.cpu["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    with pytest.raises(ValueError,
                       match="--dtype must be auto, float32, bfloat16, float16; got 'fp8'"):
        resolve_dtype("fp8", cpu)
