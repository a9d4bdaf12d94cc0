"""scripts/bench.py at its --tiny size on the CPU: the JSON rows, per-row peak RSS, a missing matplotlib, a missing
GPU, the CUDA report path fed with CPU rows (the GPU run itself cannot happen here), the bound and
resident-set floor, the store-like read bandwidth, the generate_batch rows, and --from-json on the committed runs."""

from __future__ import annotations

import builtins
import dataclasses
import importlib.util
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
SYSTEMS = ["resident", "accelerate", "hf_moe_offload"]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module          # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = load_bench()


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny CPU run of three systems from a parent whose peak RSS is far above a worker's, with matplotlib
    unimportable."""
    tmp = tmp_path_factory.mktemp("bench")
    ballast = b"\x01" * (768 * 2**20)        # touched: the parent's peak RSS grows by 768 MiB
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    records = Records()
    logging.getLogger("bench").addHandler(records)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(builtins, "__import__", no_matplotlib)
            rc = bench.main(["--tiny", "--systems", *SYSTEMS, "--batch-sizes", "2", "--prompt-len", "8",
                             "--new-tokens", "3", "--warmup-tokens", "1", "--idle-wait", "0",
                             "--cb-prompts", "4", "--cb-static-batch", "2",
                             "--workdir", str(tmp / "work"), "--out", str(tmp / "out" / "tiny")])
    finally:
        logging.getLogger("bench").removeHandler(records)
    parent_peak = bench.peak_rss_bytes()
    del ballast
    return {"rc": rc, "out": tmp / "out", "warnings": records.lines, "parent_peak": parent_peak,
            "report": json.loads((tmp / "out" / "tiny.json").read_text())}


def test_json_has_one_row_per_system_and_the_greedy_tokens_agree(tiny_run):
    report = tiny_run["report"]
    rows = report["results"]
    assert [r["system"] for r in rows] == SYSTEMS
    assert all("error" not in r and r["batch"] == 2 and r["decode_steps"] == 2 for r in rows)
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in rows)
    assert [r["tokens_match"] for r in rows] == [None, True, True]
    assert rows[1]["offloaded_bytes_per_step"] == report["model"]["expert_bytes"]   # accelerate: experts on disk
    assert 0 <= rows[2]["ours"]["decode_hit_rate"] <= 1
    assert "--tiny" in report["command"] and report["settings"]["device"] == "cpu"


def test_each_offloaded_generate_batch_mode_stands_beside_its_bound(tiny_run):
    """generate_batch's bound: max(the resident model's generate_batch time, the mode's bytes at the read rate)."""
    rows = {r["system"]: r for r in tiny_run["report"]["continuous_batching"]["rows"]}
    resident = next(m for m in rows["resident"]["modes"] if m["mode"] == "continuous, packed attention")
    continuous = [m for m in rows["hf_moe_offload"]["modes"] if m["mode"].startswith("continuous")]
    same_passes = [m for m in continuous if m["forwards"] == resident["forwards"]]
    assert same_passes and all(0 < m["bound"]["over_bound"] and m["bound"]["tok_s"] > 0 for m in same_passes)
    assert all(m["bound"]["compute_s"] == resident["wall_s"] for m in same_passes)
    # Another token budget, another number of passes: the resident run's time bounds nothing there.
    assert all("bound" not in m for m in rows["hf_moe_offload"]["modes"] if m not in same_passes)


def test_peak_rss_is_each_workers_own(tiny_run):
    """ru_maxrss would have shown the parent's peak (768 MiB of ballast above a worker's) in every row."""
    peaks = [r["peak_rss_bytes"] for r in tiny_run["report"]["results"]]
    assert all(0 < p < tiny_run["parent_peak"] - 512 * 2**20 for p in peaks), (peaks, tiny_run["parent_peak"])


def test_missing_matplotlib_warns_in_one_line_and_keeps_the_json(tiny_run):
    assert tiny_run["rc"] == 0
    assert sorted(p.name for p in tiny_run["out"].iterdir()) == ["tiny.json"]
    assert [w for w in tiny_run["warnings"] if "matplotlib" in w] == [
        "no plot: matplotlib is not installed; pip install matplotlib (or .[bench]) for the plot"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_fails_clearly_before_writing(tmp_path, capsys):
    rc = bench.main(["--device", "cuda", "--quick", "--workdir", str(tmp_path / "work"),
                     "--out", str(tmp_path / "out" / "gpu")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("bench.py: error: --device cuda needs a visible CUDA GPU") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_cuda_plan_splits_each_cap_and_sizes_the_disk():
    shape = dataclasses.replace(bench.MIXTRAL_8X7B, layers=10)
    caps = [16 * bench.GiB, 24 * bench.GiB]
    rows = bench.plan_rows("cuda", shape, ["resident", "accelerate", "hf_moe_offload_layer"], ["cpu", "disk"], caps,
                           [1, 64], 144)
    assert len(rows) == 2 * 2 * 2 * 2           # resident (27 GiB) fits under neither cap
    for r in rows:
        assert r["expert_cache_bytes"] + shape.non_expert_bytes() + r["working_bytes"] == r["cap_bytes"]
        assert r["expert_cache_bytes"] >= shape.top_k * shape.one_expert_bytes()
    quick = dataclasses.replace(bench.MIXTRAL_8X7B, layers=2)
    assert [r["system"] for r in bench.plan_rows("cuda", quick, ["resident"], ["cpu"], caps[:1], [1], 20)] == \
        ["resident"]
    assert 2.7 < bench.MIXTRAL_8X7B.layer_bytes() * 1.05 / bench.GiB < 2.9
    assert bench.layers_for_disk(60 * bench.GiB, bench.MIXTRAL_8X7B, copies=1) == 19
    assert bench.layers_for_disk(10**15, bench.MIXTRAL_8X7B, copies=2) == 32


def test_cuda_report_path_on_cpu_rows(tiny_run, tmp_path):
    """The GPU run's bounds, table, title and plot, fed the tiny run's rows dressed as CUDA rows."""
    pytest.importorskip("matplotlib")
    report = json.loads(json.dumps(tiny_run["report"]))
    h2d = 10e9
    for r in report["results"]:
        r.update(device="cuda", cap_bytes=16 * bench.GiB, h2d={"bytes_per_s": h2d, "runs_bytes_per_s": [h2d]},
                 gpu={"name": "Fake GPU"}, peak_device_bytes=2**30, store=None if r["system"] == "resident" else "cpu")
    report["results"][1]["store"] = "disk"
    report["machine"]["gpu"] = {**bench.gpu_facts(report["results"])}
    bench.add_ceilings(report["results"], disk_bytes_per_s=1e9)
    resident, accelerate, ours = report["results"]
    assert resident["io_ceiling_tok_s"] is None
    assert accelerate["bound_bandwidth_bytes_per_s"] == 1e9          # disk store: the disk is the slower link
    assert accelerate["must_move_bytes_per_token"] == accelerate["offloaded_bytes_per_step"] / 2
    assert ours["bound_bandwidth_bytes_per_s"] == h2d                # pinned store: H2D is the only link
    bench.write_outputs(report, tmp_path / "gpu")
    assert (tmp_path / "gpu.json").exists() and (tmp_path / "gpu.png").stat().st_size > 0


def test_bound_is_computed_and_within_what_the_tiny_run_allows(tiny_run):
    """bound = batch / max(resident step time, must-move bytes / store-like bandwidth): never above the resident
    row's speed, and its bandwidth is the store-like one of the same run."""
    report = tiny_run["report"]
    resident, accelerate, ours = report["results"]
    store_bw = report["store_read_bandwidth"]["bytes_per_s"]
    for r in (accelerate, ours):
        bound = r["bound"]
        assert bound["bandwidth_bytes_per_s"] == store_bw
        assert bound["compute_step_s"] == resident["decode_s"] / resident["decode_steps"]
        assert 0 < bound["decode_tok_s"] <= resident["decode_tok_s"] * (1 + 1e-9)
        assert bound["decode_over_bound"] == pytest.approx(r["decode_tok_s"] / bound["decode_tok_s"])
        assert 0 < bound["prefill_tok_s"] <= resident["prefill_tok_s"] * (1 + 1e-9)
        assert r["read_bytes_per_step"] == r["decode_read_bytes"] / r["decode_steps"]
    assert ours["bound"]["must_move_bytes_per_step"] == ours["floor_bytes_per_step"]
    assert ours["vs_accelerate"] == pytest.approx(ours["decode_tok_s"] / accelerate["decode_tok_s"])
    table = bench.markdown_table(report["results"])
    assert "| bound tok/s | decode / bound | decode / bound at median bw | vs accelerate |" in table
    assert "| disk / floor | disk / fixed-set floor | disk busy | GB/s while busy |" in table
    # The tiny run's routing gives the fixed-set floor: at least the per-step one, each step's touched experts listed.
    touched = ours["ours"]["decode_step_experts_touched"]
    assert [len(p) for p in touched] == ours["ours"]["decode_step_experts_used"]
    assert ours["fixed_floor_bytes_per_step"] >= ours["floor_bytes_per_step"]
    busy = ours["ours"]["decode"]
    assert 0 < busy["read_busy_share"] <= 1.05
    # Bytes are counted as a read is issued, the read clock as it ends: the reads a streamed pass issues for the
    # next one as it ends straddle the decode's first and last step, at most a stream window (2) at each end.
    assert abs(busy["read_clock_bytes"] - busy["bytes_to_device"]) <= 2 * 2 * ours["ours"]["expert_bytes"]
    assert ours["bound"]["decode_over_median_bound"] >= ours["bound"]["decode_over_bound"]


def test_resident_set_floor_on_a_hand_made_example():
    """(experts touched - cache slots) x expert bytes, clipped at 0; a pass touching all 64 experts with a 25% cache
    (16 slots) reads (1 - 25%) of the expert bytes."""
    one = 22 * 2**20
    assert bench.resident_set_floor(64, 16, one) == 0.75 * 64 * one
    assert bench.resident_set_floor(10, 16, one) == 0
    row = {"system": "hf_moe_offload", "ours": {"decode_step_experts_used": [64, 20, 3], "prefill_experts_used": 64,
                                                "cache_capacity_bytes": 16 * one + one // 2}}   # 16.5 slots: 16
    assert bench.floors(row, one) == ([48 * one, 4 * one, 0], 48 * one)
    assert bench.floors({"system": "hf_moe_offload", "ours": {}}, one) is None     # runs saved before routing


def test_fixed_set_floor_keeps_the_experts_touched_in_most_steps():
    """At a small batch a step leaves experts untouched; the best fixed resident set holds the experts touched most
    often, and each step reads its touched experts outside it. Never below the per-step floor."""
    steps = [[[0, 0], [0, 1], [1, 3]], [[0, 0], [1, 2], [1, 3]], [[0, 0], [0, 1]]]
    # 2 slots: expert (0, 0) touched 3 times, then (0, 1) and (1, 3) twice each (ties: lowest key kept).
    assert bench.fixed_set_floor(steps, cache_slots=2, one_expert_bytes=10) == [10, 20, 0]
    per_step = [bench.resident_set_floor(len(p), 2, 10) for p in steps]
    assert per_step == [10, 10, 0] and all(f >= p for f, p in zip([10, 20, 0], per_step))
    row = {"ours": {"decode_step_experts_touched": steps, "cache_capacity_bytes": 25}}
    assert bench.fixed_floors(row, one_expert_bytes=10) == [10, 20, 0]
    assert bench.fixed_floors({"ours": {}}, one_expert_bytes=10) is None        # runs saved before the counter


def test_touched_between_reads_the_expert_call_counters():
    before = {"per_layer": [{"expert_calls": [1, 0]}, {"expert_calls": []}]}
    after = {"per_layer": [{"expert_calls": [1, 2]}, {"expert_calls": [0, 0, 1]}]}
    assert bench.touched_between(before, after) == [[0, 1], [1, 2]]
    assert bench.touched_between(before, {"per_layer": [{}, {}]}) is None


def test_generate_batch_row_ran_or_says_why(tiny_run):
    batching = tiny_run["report"]["continuous_batching"]
    assert batching["prompts"] == 4 and batching["static_batch"] == 2
    assert [r["system"] for r in batching["rows"]] == ["resident", "hf_moe_offload"]
    for r in batching["rows"]:
        if "skipped" in r:
            assert any(r["system"] in w and r["skipped"] in w for w in tiny_run["warnings"])
            continue
        modes = [m["mode"] for m in r["modes"]]
        if r["system"] == "resident":   # sdpa over transformers' dense mask, then packed: the packed reference
            assert modes == ["continuous", "continuous, packed attention", "static, batch 2"]
        else:   # sdpa runs packed, so the library's budget is the memory rule: nothing to measure
            sized = r["library_batching"]
            assert modes == ["continuous, packed attention",
                             f"continuous, offload_batching_config ({sized['max_batch_tokens']} tokens/pass)",
                             "continuous, no config given", "static, batch 2"]
            assert sized["attention"] == "packed" and sized["pass_costs"] is None
            assert sized["max_batch_tokens"] == sized["memory_tokens"]
        resident = {m["mode"] for r in batching["rows"] if r["system"] == "resident" for m in r.get("modes", [])}
        for m in r["modes"]:
            assert m["generated_tokens"] == 4 * 3 and m["tok_s"] > 0 and m["forwards"] >= 3
            # the library-budget modes have no resident twin at their budget
            expected = None if r["system"] == "resident" or m["mode"] not in resident else True
            assert m["tokens_match"] is expected


def test_generate_batch_is_skipped_with_its_reason():
    flex = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flex_attention"), generate_batch=None)
    assert "needs sdpa, paged|eager or flash attention" in bench.cb_unavailable(flex)
    assert "has no generate_batch" in bench.cb_unavailable(SimpleNamespace(config=flex.config))
    assert bench.cb_unavailable(SimpleNamespace(config=SimpleNamespace(_attn_implementation="eager"),
                                                generate_batch=None)) is None       # switched to paged|eager


def test_store_like_read_bandwidth_is_positive(tiny_run):
    files = bench.checkpoint_files(Path(tiny_run["report"]["model"]["checkpoint"]))
    bw = bench.store_read_bandwidth(files, repeats=1)
    assert bw["readers"] == 4 and bw["experts"] == 2 * 8 and bw["bytes_per_s"] > 0
    assert bw["bytes"] == bench.TINY.expert_bytes()
    assert tiny_run["report"]["store_read_bandwidth"]["bytes_per_s"] > 0


# Fields runs saved before the store-like bandwidth, the bound, the floors and the generate_batch rows did not have.
NEWER = {"report": ("store_read_bandwidth", "continuous_batching"),
         "row": ("bound", "floor_bytes_per_step", "fixed_floor_bytes_per_step", "read_bytes_per_step"),
         "ours": ("decode_step_experts_used", "decode_step_experts_touched", "prefill_experts_used")}


@pytest.mark.parametrize("name, older", [("cpu_mixtral_1.5gb", False), ("cpu_mixtral_1.5gb_latency", False),
                                         ("cpu_mixtral_1.5gb_throughput", False), ("cpu_mixtral_1.5gb", True)])
def test_from_json_renders_the_committed_runs(name, older, tmp_path, capsys):
    """The committed runs render, and so does a run saved before the bound, the floors and the generate_batch rows
    existed (a committed run without those fields)."""
    committed = SCRIPT.parent.parent / "benchmarks" / "results" / f"{name}.json"
    report = json.loads(committed.read_text())
    if older:
        for key in NEWER["report"]:
            report.pop(key, None)
        for row in report["results"]:
            for key in NEWER["row"]:
                row.pop(key, None)
            for key in NEWER["ours"]:
                (row.get("ours") or {}).pop(key, None)
    (tmp_path / committed.name).write_text(json.dumps(report))   # --from-json rewrites the JSON beside it
    assert bench.main(["--from-json", str(tmp_path / committed.name)]) == 0
    assert "| bound tok/s |" in capsys.readouterr().out


def test_quantize_flag_adds_quantized_rows_beside_the_dense_ones():
    args = bench.parse_args(["--tiny", "--systems", "resident", "hf_moe_offload_layer", "--quantize", "int8", "int4"])
    assert args.systems == ["resident", "hf_moe_offload_layer", "hf_moe_offload_int8", "hf_moe_offload_int4"]
    assert bench.POLICIES["hf_moe_offload_int4"] == {**bench.POLICIES["hf_moe_offload_layer"], "quantize": "int4"}
    assert bench.parse_args(["--tiny"]).systems == list(bench.DENSE_SYSTEMS)     # dense rows only by default
    # A quantized row's resident-set floor counts its own (smaller) experts.
    row = {"ours": {"decode_step_experts_used": [6], "prefill_experts_used": 8, "cache_capacity_bytes": 400,
                    "expert_bytes": 100}}
    assert bench.floors(row, one_expert_bytes=350) == ([200], 400)


def test_each_row_reaches_the_rows_file_as_it_finishes(tmp_path, monkeypatch):
    """A run killed at a time limit (the GPU machine's 10 minutes a command) keeps the rows that finished."""
    def one_row_then_killed(spec, timeout):
        if (tmp_path / "killed").exists():
            raise KeyboardInterrupt
        (tmp_path / "killed").touch()
        return {"system": spec["system"], "batch": spec["batch"], "error": "stands in for a finished row"}

    monkeypatch.setattr(bench, "worker_spec", lambda args, shape, path, row: row)
    monkeypatch.setattr(bench, "spawn_worker", one_row_then_killed)
    args = SimpleNamespace(out=tmp_path / "run", idle_wait=0, no_evict=False, workdir=tmp_path, worker_timeout=1)
    rows = [{"system": "accelerate", "batch": 64, "store": "cpu", "cap_bytes": None},
            {"system": "hf_moe_offload_layer", "batch": 64, "store": "cpu", "cap_bytes": None}]
    with pytest.raises(KeyboardInterrupt):
        bench.run_rows(args, None, tmp_path, rows)
    kept = [json.loads(line) for line in (tmp_path / "run.rows.jsonl").read_text().splitlines()]
    assert [(r["system"], r["batch"]) for r in kept] == [("accelerate", 64)]
