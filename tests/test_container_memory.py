"""offload_policy="auto" sizes host memory by what a container really has: its control group's memory limit, not
the machine's free RAM (a process over the limit is killed, however much the host has free)."""

from __future__ import annotations

import psutil
import pytest

from hf_moe_offload import OffloadPolicy
from hf_moe_offload.planning import footprint as fp_module
from hf_moe_offload.planning.footprint import (HOST_HEADROOM, Footprint, available_host_bytes, container_memory,
                                               free_bytes)
from hf_moe_offload.planning.resolve import resolve

GiB, MiB = 1 << 30, 1 << 20


def _fake_cgroup(tmp_path, monkeypatch, proc: str, files: dict[str, str]) -> None:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    monkeypatch.setattr(fp_module, "CGROUP_ROOT", root)
    monkeypatch.setattr(fp_module, "PROC_CGROUP", tmp_path / "proc_cgroup")
    snapshot = psutil.virtual_memory()        # one reading: the test's and the library's comparisons agree
    monkeypatch.setattr(psutil, "virtual_memory", lambda: snapshot)


def test_a_cgroup_v2_limit_bounds_the_memory_auto_plans_with(tmp_path, monkeypatch):
    _fake_cgroup(tmp_path, monkeypatch, "0::/job\n", {
        "job/memory.max": f"{2 * GiB}\n", "job/memory.current": f"{GiB}\n",
        "job/memory.stat": f"anon {768 * MiB}\ninactive_file {256 * MiB}\n"})
    container = container_memory()
    assert container.limit == 2 * GiB and container.used == 768 * MiB
    assert available_host_bytes() == min(psutil.virtual_memory().available, 2 * GiB - 768 * MiB)
    assert free_bytes(__import__("torch").device("cpu")) == int(available_host_bytes() * (1 - HOST_HEADROOM))


def test_a_cgroup_v1_limit_is_read_and_no_limit_means_the_machine(tmp_path, monkeypatch):
    _fake_cgroup(tmp_path, monkeypatch, "4:memory:/docker/abc\n", {
        "memory/docker/abc/memory.limit_in_bytes": f"{3 * GiB}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
        "memory/docker/abc/memory.stat": f"total_inactive_file {512 * MiB}\n"})
    assert container_memory() == fp_module.ContainerMemory(3 * GiB, 512 * MiB)
    _fake_cgroup(tmp_path, monkeypatch, "0::/\n", {"memory.max": "max\n"})
    assert container_memory() is None
    assert available_host_bytes() <= psutil.virtual_memory().total


def test_a_hybrid_hierarchy_reads_the_limit_of_its_v1_memory_controller(tmp_path, monkeypatch):
    """systemd's "hybrid" layout lists a v2 group ("0::") beside the v1 controllers; the memory limit is the v1
    memory controller's, and the v2 side (no controllers, in unified/) has none."""
    _fake_cgroup(tmp_path, monkeypatch, "4:memory:/docker/abc\n1:cpu:/docker/abc\n0::/\n", {
        "memory/docker/abc/memory.limit_in_bytes": f"{8 * GiB}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
        "memory/docker/abc/memory.stat": f"total_inactive_file 0\nhierarchical_memory_limit {8 * GiB}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "unified/cgroup.procs": "1\n"})
    assert container_memory() == fp_module.ContainerMemory(8 * GiB, GiB)


def test_auto_keeps_experts_on_disk_when_the_container_cannot_hold_them(tmp_path, monkeypatch):
    """Experts that fit the machine's RAM but not the container's limit stay on disk, and a CPU cache under
    expert_cache="auto" is sized from the container's memory."""
    _fake_cgroup(tmp_path, monkeypatch, "0::/\n", {"memory.max": f"{2 * GiB}\n", "memory.current": f"{GiB}\n"})
    fp = Footprint(expert_bytes=4 * GiB, slab_bytes=64 * MiB, resident_bytes=256 * MiB, top_k=2)
    if psutil.virtual_memory().available * (1 - HOST_HEADROOM) < 4 * GiB + 256 * MiB:
        pytest.skip("this machine's own RAM is too small for the comparison")
    resolved = resolve(OffloadPolicy(device="cpu"), fp)
    assert resolved.policy.store == "disk"
    # The container has 1 GiB left: the resident part comes out of it, then the headroom's share.
    assert resolved.cache_bytes <= int(GiB * (1 - HOST_HEADROOM))


def test_an_explicit_cpu_cache_larger_than_the_container_warns_with_the_numbers(tmp_path, monkeypatch, caplog):
    _fake_cgroup(tmp_path, monkeypatch, "0::/\n", {"memory.max": f"{2 * GiB}\n", "memory.current": f"{GiB}\n"})
    fp = Footprint(expert_bytes=8 * GiB, slab_bytes=64 * MiB, resident_bytes=256 * MiB, top_k=2)
    with caplog.at_level("WARNING", logger="hf_moe_offload"):
        resolve(OffloadPolicy(device="cpu", store="disk", expert_cache="3GiB"), fp)
    warning = next(r.getMessage() for r in caplog.records if "expert_cache=3.0 GiB is more than" in r.getMessage())
    assert "within the container's limit of 2.0 GiB" in warning


def test_prepacked_copies_fit_within_the_container_not_the_machine(tmp_path, monkeypatch):
    """The CPU kernels' packed copies are budgeted from the container's limit: 3 GiB limit, 1 GiB used leaves
    2 GiB, less the reserve (at least 1 GiB), however much RAM the machine has."""
    from hf_moe_offload.memory.cpu_kernels import RESERVE_MIN_BYTES, prepack_budget

    _fake_cgroup(tmp_path, monkeypatch, "0::/\n", {"memory.max": f"{3 * GiB}\n", "memory.current": f"{GiB}\n"})
    if psutil.virtual_memory().available < 3 * GiB:
        pytest.skip("this machine's own RAM is too small for the comparison")
    assert prepack_budget() == 2 * GiB - RESERVE_MIN_BYTES
    _fake_cgroup(tmp_path, monkeypatch, "0::/\n", {"memory.max": f"{GiB}\n", "memory.current": f"{512 * MiB}\n"})
    assert prepack_budget() == 0                        # a small container packs nothing: F.linear serves


def test_a_cgroup_v2_limit_on_a_parent_group_binds(tmp_path, monkeypatch):
    """A limit set on a parent group (a systemd slice, a pod, a container whose processes sit in a child group such
    as /init.scope) binds this process although its own group says "max"."""
    _fake_cgroup(tmp_path, monkeypatch, "0::/limited.slice/run-1.scope\n", {
        "limited.slice/memory.max": f"{2 * GiB}\n", "limited.slice/memory.current": f"{GiB}\n",
        "limited.slice/memory.stat": f"inactive_file {256 * MiB}\n",
        "limited.slice/run-1.scope/memory.max": "max\n", "limited.slice/run-1.scope/memory.current": f"{512 * MiB}\n",
        "limited.slice/run-1.scope/memory.stat": "inactive_file 0\n"})
    assert container_memory() == fp_module.ContainerMemory(2 * GiB, 768 * MiB)
    assert available_host_bytes() <= 2 * GiB - 768 * MiB
    assert available_host_bytes() == min(psutil.virtual_memory().available, 2 * GiB - 768 * MiB)


def test_a_looser_limit_on_the_own_group_does_not_hide_a_tighter_parent_limit(tmp_path, monkeypatch):
    _fake_cgroup(tmp_path, monkeypatch, "0::/limited.slice/run-1.scope\n", {
        "limited.slice/memory.max": f"{2 * GiB}\n", "limited.slice/memory.current": f"{GiB}\n",
        "limited.slice/memory.stat": "inactive_file 0\n",
        "limited.slice/run-1.scope/memory.max": f"{64 * GiB}\n",
        "limited.slice/run-1.scope/memory.current": f"{GiB}\n",
        "limited.slice/run-1.scope/memory.stat": "inactive_file 0\n"})
    container = container_memory()
    assert container.limit == 2 * GiB and container.available == GiB
    assert available_host_bytes() <= GiB


def test_a_cgroup_v1_limit_set_on_a_parent_group_binds(tmp_path, monkeypatch):
    """cgroup v1 (hierarchical accounting): a parent's memory.limit_in_bytes binds, and where only the process's
    own group is visible its memory.stat names the limit in force (hierarchical_memory_limit)."""
    unlimited = "9223372036854771712\n"
    _fake_cgroup(tmp_path, monkeypatch, "4:memory:/parent/child\n", {
        "memory/parent/memory.limit_in_bytes": f"{2 * GiB}\n",
        "memory/parent/memory.usage_in_bytes": f"{GiB}\n",
        "memory/parent/child/memory.limit_in_bytes": unlimited,
        "memory/parent/child/memory.usage_in_bytes": f"{GiB}\n",
        "memory/parent/child/memory.stat": "total_inactive_file 0\n"})
    assert container_memory().limit == 2 * GiB

    _fake_cgroup(tmp_path / "visible", monkeypatch, "4:memory:/parent/child\n", {
        "memory/parent/child/memory.limit_in_bytes": unlimited,
        "memory/parent/child/memory.usage_in_bytes": f"{GiB}\n",
        "memory/parent/child/memory.stat": f"hierarchical_memory_limit {2 * GiB}\ntotal_inactive_file {256 * MiB}\n"})
    assert container_memory() == fp_module.ContainerMemory(2 * GiB, 768 * MiB)
    assert available_host_bytes() <= 2 * GiB - 768 * MiB


def test_the_host_memory_a_process_may_use_is_the_machine_within_its_container(tmp_path, monkeypatch):
    """`host_memory_bytes()`: the machine's RAM, or the container's limit where that is smaller."""
    total = psutil.virtual_memory().total
    _fake_cgroup(tmp_path, monkeypatch, "0::/job\n", {"job/memory.max": f"{total // 4}\n",
                                                      "job/memory.current": f"{GiB}\n"})
    assert fp_module.host_memory_bytes() == total // 4
    _fake_cgroup(tmp_path, monkeypatch, "0::/job\n", {"job/memory.max": f"{total * 4}\n"})
    assert fp_module.host_memory_bytes() == total
    _fake_cgroup(tmp_path, monkeypatch, "0::/job\n", {"job/memory.max": "max\n"})
    assert fp_module.host_memory_bytes() == total


def test_a_measured_machine_profile_records_the_containers_memory(tmp_path, monkeypatch):
    """`hf-moe-offload plan` budgets host memory from the profile: inside a container it is the container's limit,
    not the machine's RAM."""
    from hf_moe_offload.planning.measure import measure

    total = psutil.virtual_memory().total
    _fake_cgroup(tmp_path, monkeypatch, "0::/\n", {"memory.max": f"{total // 4}\n", "memory.current": f"{GiB}\n",
                                                   "memory.stat": "inactive_file 0\n"})
    profile = measure(disk_piece_bytes=1 << 16, disk_pieces=4, memcpy_bytes=1 << 20, matmul_hidden=64,
                      matmul_large_rows=8, seconds_per_kernel=0.001, device="cpu", expert_hidden=64,
                      expert_rows=(1, 4), cold_bytes=1 << 20)
    assert profile.host_memory_bytes == total // 4
