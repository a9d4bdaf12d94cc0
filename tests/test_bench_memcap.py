"""The memory-cap benchmark's cgroup helper (sets a limit, runs a process inside it, removes it) and the CPU suite's
report writer (tables and JSON from a small fake result). The cgroup test needs a writable memory controller (root
on cgroup v1 or a delegated v2 subtree) and skips without one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import cgroup_cap


@pytest.fixture(scope="module")
def writable() -> None:
    why = cgroup_cap.cgroups_writable()
    if why is not None:
        pytest.skip(f"no writable memory cgroup here: {why}")


def test_cap_sets_limit_runs_inside_and_is_removed(writable: None) -> None:
    limit = 96 << 20
    with cgroup_cap.memory_cap(limit, "test_memcap") as cap:
        path = cap.path
        assert path.is_dir()
        assert abs(cap.read_limit() - limit) < 1 << 20          # the kernel rounds to pages
        out = subprocess.run(cap.command([sys.executable, "-c", "print(open('/proc/self/cgroup').read())"]),
                             capture_output=True, text=True, check=True).stdout
        assert path.name in out
        # A process that needs more than the limit is killed inside the group, not outside it.
        rc = subprocess.run(cap.command([sys.executable, "-c", "x = bytearray(b'1') * (400 << 20)"]),
                            check=False).returncode
        assert rc != 0
        assert cap.stats()["oom_kills"] >= 1
    assert not path.exists()


def test_cap_is_removed_when_the_block_raises(writable: None) -> None:
    with pytest.raises(RuntimeError), cgroup_cap.memory_cap(64 << 20, "test_memcap") as cap:
        path = cap.path
        raise RuntimeError("worker failed")
    assert not path.exists()


def test_no_controller_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(cgroup_cap.CgroupUnavailable, match="neither cgroup v2"):
        cgroup_cap.create_cap(64 << 20, root=tmp_path)


def fake_report() -> dict:
    import bench_suite

    row = bench_suite.row
    return {"command": "python scripts/bench.py --suite cpu --quick", "commit": "abc1234", "date": "2026-01-01 00:00",
            "machine": {"cpu": "Test CPU", "cpus": 2, "avx512_bf16": True}, "profile": "a file",
            "loadavg_before": [0.5, 0, 0], "loadavg_after": [1.5, 0, 0], "quick": True,
            "sections": {
                "disk": {"rows": [row("disk", "batch 1 exact", "ours, lru", 1, 7.1, bound_tok_s=13.0,
                                      planner_tok_s=6.8, peer="accelerate", vs_peer=3.9, read_mb_per_token=140.0,
                                      peak_gib=0.9, same_tokens="yes", load_1m=1.0)]},
                "memcap": {"rows": [row("memcap", "cap 50% (0.91 GiB)", "llama.cpp (mmap)", 8, 0.5,
                                        read_mb_per_token=1400.0, same_tokens="not compared"),
                                    row("memcap", "cap 50% (0.91 GiB)", "ours, cache auto", 8, None,
                                        error="OOM-killed at the cap")]},
                "kernels": {"rows": [row("kernels", "1 thread", "ours", 1, 18.5, bound_tok_s=59.0, planner_tok_s=20.0,
                                         peer="llama.cpp", vs_peer=0.41, same_tokens="yes")]}}}


def test_suite_writer_tables_and_json(tmp_path: Path) -> None:
    import bench_suite

    report = fake_report()
    written = bench_suite.write_suite(report, tmp_path / "suite", png=False)
    md = (tmp_path / "suite.md").read_text()
    assert written == [tmp_path / "suite.json", tmp_path / "suite.md"]
    assert "library at commit `abc1234`" in md and "avx512_bf16 yes" in md and "load average 0.5 → 1.5" in md
    for title in bench_suite.SECTION_TITLES.values():
        assert f"**{title}**" in md
    assert "| batch 1 exact | 1 | ours, lru | 7.10 | 13.00 | 6.80 | 3.90x accelerate | 140.0 | 0.90 | yes | 1.0 |" in md
    assert "| cap 50% (0.91 GiB) | 8 | ours, cache auto | failed: OOM-killed at the cap |" in md
    assert json.loads((tmp_path / "suite.json").read_text())["sections"]["kernels"]["rows"][0]["tok_s"] == 18.5


def test_memcap_table_from_fake_rows() -> None:
    import bench_memcap

    rows = [{"system": "ours_cap", "batch": 1, "cap_share": 0.5, "cap_bytes": 1 << 30, "decode_tok_s": 5.0,
             "read_bytes_per_token": 80e6, "peak_rss_bytes": 1 << 29, "ours": {"cache_capacity_bytes": 1 << 28},
             "cgroup": {"peak_bytes": 1 << 30, "oom_kills": 0}, "vs_llama_cpp": 10.0, "vs_accelerate": 8.0,
             "planner_tok_s": 6.0, "tokens_match": True, "loadavg_1m_before": 1.0, "loadavg_1m_after": 2.0}]
    md = bench_memcap.markdown(rows)
    assert "| 1.00 GiB (50%) | 1 | ours, cache sized to cap | 5.00 | 10.00 | 8.00 | 80.0 | 0.25 | 0.50 | 1.00 | 0 |" \
           " 6.00 | yes | 1.0-2.0 |" in md


def test_quantized_rows_are_read_against_llama_cpp_q8_0() -> None:
    import bench_memcap

    shape = bench_memcap.bench.SMALL
    rows = bench_memcap.plan_rows(shape, [0.5], [1], ["ours_int8", "llama_cpp", "llama_cpp_q8_0"], 0)
    assert [(r["system"], r["cap_share"]) for r in rows] == [
        ("resident", None), ("llama_cpp", None), ("llama_cpp_q8_0", None),
        ("ours_int8", 0.5), ("llama_cpp", 0.5), ("llama_cpp_q8_0", 0.5)]
    speeds = {"ours_int8": 6.0, "llama_cpp": 2.0, "llama_cpp_q8_0": 3.0, "resident": 10.0}
    for r in rows:
        r["decode_tok_s"] = speeds[r["system"]]
    bench_memcap.add_ratios(rows)
    ours = next(r for r in rows if r["system"] == "ours_int8")
    assert ours["vs_peer"] == 2.0 and ours["vs_llama_cpp"] == 3.0
    assert all(r["vs_peer"] is None for r in rows if r["system"] in bench_memcap.LLAMA_SYSTEMS)
    # The planner does not model quantized experts: no prediction rather than a dense one.
    from bench_planner import row_prediction

    assert row_prediction(None, None, {**ours, "policy": {"quantize": "int8"}}, 16, 16)["planner_tok_s"] is None


def test_suite_profile_is_the_file_given_or_this_machine_measured_and_saved(tmp_path: Path, monkeypatch) -> None:
    import bench_planner
    import bench_suite

    from hf_moe_offload.planning.profile import MachineProfile

    given = SCRIPTS.parent / "benchmarks" / "results" / "profile_cpu_1thread_fast.json"
    profile, source, spec = bench_suite.suite_profile(str(given), tmp_path / "suite")
    assert profile == MachineProfile.load(given) and spec == str(given) and "profile_cpu_1thread_fast" in source
    assert not (tmp_path / "suite.profile.json").exists()
    measured = []
    monkeypatch.setattr(bench_planner, "base_profile",
                        lambda spec, threads: measured.append((spec, threads)) or (profile, "measured"))
    _, source, spec = bench_suite.suite_profile(None, tmp_path / "suite")
    assert measured == [("measure", 1)]                     # no file given: this machine, at one thread
    assert spec == str(tmp_path / "suite.profile.json") and MachineProfile.load(spec) == profile
    assert "measured at the start" in source and spec in source


def test_replanning_the_stored_suite_predicts_the_in_ram_rows_within_a_third(tmp_path: Path) -> None:
    """The planner with this machine's profile, packed kernel included, against the suite measured on it: nothing is
    measured here, so the stored rows and profile stand in for a run."""
    import replan_suite

    results = SCRIPTS.parent / "benchmarks" / "results"
    assert replan_suite.main_args([str(results / "cpu_suite_fast.json"), "--profile",
                                   str(results / "profile_cpu_1thread_fast.json"), "--out", str(tmp_path / "r")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    in_ram = {(r["system"], r["batch"]): r for r in rows if r["section"] == "kernels"}
    for batch in (1, 8):
        assert 0.67 < in_ram[("ours", batch)]["ratio"] < 1.33
        assert in_ram[("ours", batch)]["stored_ratio"] < 0.5        # the first machine's profile, no packed curve
        assert in_ram[("ours", batch)]["planner_tok_s"] > 1.5 * in_ram[("resident", batch)]["planner_tok_s"]
    assert (tmp_path / "r.md").read_text().startswith("`python scripts/replan_suite.py")
