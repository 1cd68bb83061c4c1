"""One OpenMP runtime for torch and Numba (``shared/openmp.py``) and the waiting chosen with it
(``shared/cpu_threads.py``): read from the libraries a fresh process really maps."""

import json
import os
import subprocess
import sys

import pytest
import torch

from shared import cpu_threads as threads, openmp

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a fresh executor-like process: the rule, then one torch and one Numba parallel region
_PROBE = """
import json, os
from shared.cpu_threads import configure_cpu_threads
choice = configure_cpu_threads(2)
import numba, numpy as np, torch
from numba import njit, prange

@njit(parallel=True)
def bump(a):
    for i in prange(a.shape[0]):
        a[i] += 1.0

bump(np.zeros(64))
torch.randn(128, 128) @ torch.randn(128, 128)
from shared.openmp import loaded_runtimes
from shared.cpu_threads import idle_threads_spin
from kernels.cpu import NumbaCPUBackend
small_rows = NumbaCPUBackend(matmul_prefill_path=False, idle_threads_spin=idle_threads_spin).parallel_small_rows(True)
print(json.dumps({"openmp": choice.openmp, "runtimes": loaded_runtimes(), "layer": numba.threading_layer(),
                  "spin": os.environ.get("GOMP_SPINCOUNT"), "policy": os.environ.get("OMP_WAIT_POLICY"),
                  "spins": idle_threads_spin(), "small_rows": small_rows}))
"""


def _probe(**env) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PAGEDSERVE_SHARE_OPENMP", "NUMBA_THREADING_LAYER")}
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=_ROOT, env={**base, **env}, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_numba_names_its_libgomp():
    name = openmp.numba_runtime_name()
    assert name is not None and name.startswith("libgomp"), name


def test_elf_needed_reads_real_libraries_and_rejects_others(tmp_path):
    needed = openmp.elf_needed(torch._C.__file__)
    assert any(n.startswith("libtorch") for n in needed), needed
    (tmp_path / "text.so").write_text("not an ELF file")
    (tmp_path / "short.so").write_bytes(b"\x7fELF\x02\x01")
    assert openmp.elf_needed(str(tmp_path / "text.so")) == []
    assert openmp.elf_needed(str(tmp_path / "short.so")) == []
    assert openmp.elf_needed(str(tmp_path / "missing.so")) == []


def test_loaded_runtimes_counts_files_once(tmp_path):
    lib = tmp_path / "libgomp.so.1.0.0"
    lib.write_bytes(b"x")
    (tmp_path / "libgomp.so.1").symlink_to(lib.name)
    other = tmp_path / "other" / "libgomp.so.1"
    other.parent.mkdir()
    other.write_bytes(b"y")
    maps = tmp_path / "maps"
    maps.write_text("".join(f"7f00-7f01 r-xp 00000000 08:01 1 {p}\n" for p in
                            (lib, tmp_path / "libgomp.so.1", other, tmp_path / "libc.so.6")) + "7f02-7f03 rw-p 0 0 0\n")
    assert openmp.loaded_runtimes(str(maps)) == sorted([str(lib), str(other)])


@pytest.mark.slow  # starts processes and times their spinning threads
def test_one_runtime_spins_and_separate_ones_sleep():
    shared = _probe()
    assert len(shared["runtimes"]) == 1, shared
    assert shared["layer"] == "omp"
    assert shared["openmp"].startswith("one runtime"), shared
    assert (shared["spin"], shared["policy"]) == (str(threads.SPIN_COUNT), None)
    assert shared["spins"] and shared["small_rows"]  # small row kernels may go parallel

    apart = _probe(PAGEDSERVE_SHARE_OPENMP="0")
    assert len(apart["runtimes"]) == 2, apart  # torch's bundled libgomp beside Numba's
    assert apart["openmp"].startswith("separate runtimes"), apart
    assert (apart["spin"], apart["policy"]) == (None, "PASSIVE")
    assert not apart["spins"] and not apart["small_rows"]

    sleeping = _probe(OMP_WAIT_POLICY="passive")  # one runtime, asleep at once: as if apart
    assert sleeping["openmp"].startswith("one runtime") and not sleeping["spins"], sleeping
    assert not sleeping["small_rows"]


def test_spinning_is_read_from_the_waiting_settings():
    assert threads._spins({}) and threads._spins({"GOMP_SPINCOUNT": "200000"})
    assert threads._spins({"OMP_WAIT_POLICY": "ACTIVE"}) and threads._spins({"GOMP_SPINCOUNT": "10k"})
    assert not threads._spins({"OMP_WAIT_POLICY": " Passive "}) and not threads._spins({"GOMP_SPINCOUNT": "0"})


@pytest.mark.slow  # starts an executor process
def test_the_executor_command_shares_the_runtime(tmp_path, tiny_model_dir):
    """The real ``pagedserve executor`` (whose flag checks import torch early) ends its warm-up with
    one runtime, without a scheduler to talk to."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "executor", "--model", str(tiny_model_dir), "--dtype", "float32",
         "--num-kv-blocks", "16", "--step-endpoint", f"ipc://{tmp_path}/step", "--result-endpoint",
         f"ipc://{tmp_path}/result"], cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    events = {}
    try:
        for line in proc.stdout:
            if line.startswith("{"):
                record = json.loads(line)
                events[record["event"]] = record
                if record["event"] == "warmed up":
                    break
    finally:
        proc.kill()
        proc.wait()
    assert events["cpu threads"]["openmp"].startswith("one runtime"), events.get("cpu threads")
    assert len(events["warmed up"]["openmp_runtimes"]) == 1, events["warmed up"]


def test_waiting_given_by_the_environment_is_kept(monkeypatch):
    monkeypatch.setattr(threads, "_openmp", None)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    before = torch.get_num_threads()
    try:
        choice = threads.configure_cpu_threads(before)
    finally:
        torch.set_num_threads(before)
    # torch is already loaded in this process: nothing is shared, and the environment is left as is
    assert choice.openmp.startswith("separate runtimes (torch or numba was imported first)"), choice
    assert "as the environment says: OMP_WAIT_POLICY=ACTIVE" in choice.openmp
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ
