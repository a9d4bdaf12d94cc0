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
