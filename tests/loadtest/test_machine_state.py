"""``loadtest.common.machine_state``: the CPU's description, the steal time over a run and the wait for a
quiet machine before one (``/proc`` replaced by fakes where the answer must be exact)."""

from __future__ import annotations

import pytest

from loadtest.common import machine_state


def test_cpu_description_names_the_model_and_the_deciding_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    block = "processor\t: {n}\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16 sse2\n\n"
    cpuinfo.write_text(block.format(n=0) + block.format(n=1))
    text = machine_state.cpu_description(str(cpuinfo))
    assert text.startswith("Some Xeon, ") and text.endswith("flags: avx2 avx512f amx_bf16 amx_tile")
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nmodel name\t: Old CPU\nflags\t\t: fpu sse2\n")
    assert machine_state.cpu_description(str(plain)).endswith(
        "flags: none of avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile")
    assert machine_state.cpu_description(str(tmp_path / "missing")).startswith("unknown CPU, ")


def test_cpu_steal_share(monkeypatch):
    # /proc/stat's cpu line: user nice system idle iowait irq softirq steal ...
    stats = iter([(10, 1000), (40, 1200), None, (50, 1300)])
    monkeypatch.setattr(machine_state.CpuSteal, "_read", staticmethod(lambda: next(stats)))
    steal = machine_state.CpuSteal()
    assert steal.percent() == pytest.approx(15.0)  # 30 of 200 ticks
    unreadable = machine_state.CpuSteal()  # its start read gives None
    value = unreadable.percent()
    assert value != value  # nan


def test_cpu_steal_reads_this_machine():
    steal = machine_state.CpuSteal()
    sum(range(200_000))
    value = steal.percent()
    assert value != value or 0.0 <= value <= 100.0  # nan where /proc/stat is unreadable


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_wait_for_quiet_waits_out_a_busy_machine():
    clock = _Clock()
    # (busy, total) ticks: two windows 100% busy, then one 10% busy
    reads = iter([(0, 0), (100, 100), (200, 200), (210, 300)])
    waited = machine_state.wait_for_quiet(0.15, 0.5, 15.0, clock, clock.sleep, lambda: next(reads))
    assert waited == pytest.approx(1.5)


def test_wait_for_quiet_gives_up_and_copes_without_proc_stat():
    clock = _Clock()
    busy = iter((i * 100, i * 100) for i in range(1000))
    assert machine_state.wait_for_quiet(0.15, 0.5, 3.0, clock, clock.sleep, lambda: next(busy)) == pytest.approx(3.0)
    assert machine_state.wait_for_quiet(0.15, 0.5, 3.0, clock, clock.sleep, lambda: None) is None
