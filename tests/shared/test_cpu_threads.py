"""The executor's thread rule: cores from affinity, SMT siblings and cgroup quotas; one left to a
colocated frontend and scheduler on large machines; an explicit count wins."""

import os

from shared import cpu_threads as threads


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_smt_siblings_count_once(tmp_path):
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        write(tmp_path / f"cpu{cpu}/topology/thread_siblings_list", siblings + "\n")
    assert threads.physical_cores({0, 1, 2, 3}, str(tmp_path)) == 2
    assert threads.physical_cores({0, 2}, str(tmp_path)) == 1
    assert threads.physical_cores({0, 9}, str(tmp_path)) == 2  # cpu9 unreadable: a core of its own


def test_cgroup_quota_v2_and_v1(tmp_path):
    write(tmp_path / "v2/cpu.max", "250000 100000\n")
    write(tmp_path / "none/cpu.max", "max 100000\n")
    write(tmp_path / "v1/cpu/cpu.cfs_quota_us", "150000\n")
    write(tmp_path / "v1/cpu/cpu.cfs_period_us", "100000\n")
    write(tmp_path / "v1off/cpu/cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "v1off/cpu/cpu.cfs_period_us", "100000\n")
    assert threads.cgroup_cpu_limit(str(tmp_path / "v2")) == 2.5
    assert threads.cgroup_cpu_limit(str(tmp_path / "none")) is None
    assert threads.cgroup_cpu_limit(str(tmp_path / "v1")) == 1.5
    assert threads.cgroup_cpu_limit(str(tmp_path / "v1off")) is None
    assert threads.cgroup_cpu_limit(str(tmp_path / "missing")) is None


def test_choice_by_cores_and_colocation(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_NUM_THREADS", raising=False)
    assert threads.choose_threads(None, cores=(2, "2 cores")).num_threads == 2
    assert threads.choose_threads(None, cores=(7, "7 cores")).num_threads == 7
    big = threads.choose_threads(None, colocated=True, cores=(16, "16 cores"))
    assert big.num_threads == 15 and "frontend and scheduler" in big.reason
    assert threads.choose_threads(None, colocated=False, cores=(16, "16 cores")).num_threads == 16
    assert threads.choose_threads(3, cores=(16, "16 cores")).num_threads == 3
    monkeypatch.setenv("PAGEDSERVE_NUM_THREADS", "5")
    assert threads.choose_threads(None, cores=(16, "16 cores")).num_threads == 5


def test_this_machine_has_at_least_one_usable_core():
    cores, how = threads.usable_cores()
    assert 1 <= cores <= (os.cpu_count() or 1) and "CPUs allowed" in how
