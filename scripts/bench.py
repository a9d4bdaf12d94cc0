#!/usr/bin/env python
"""Benchmark per-expert offloading against a fully resident model and accelerate's disk offload, on the CPU.

What it does, in one invocation:

1. Builds (once, cached under ``--workdir``) a Mixtral-shaped model with random bf16 weights and saves it with
   ``save_pretrained`` (Hub layout, sharded). The default shape is about 1.5 GB.
2. Measures the disk's sequential read bandwidth on a checkpoint shard read cold (after evicting its pages).
3. Runs every system at every batch size in its own subprocess (so peak RSS is per system and clean):

   - ``resident``: ``from_pretrained(path, dtype=bfloat16)``, everything in RAM (upper bound).
   - ``accelerate``: accelerate's ``device_map`` offload, non-expert modules on "cpu" and every
     ``model.layers.{i}.mlp.experts`` on "disk" with an ``offload_folder`` (today's baseline when experts do not fit).
   - ``hf_moe_offload``: ``offload_policy={"device": "cpu", "store": "disk", "expert_cache": "25%"}`` (LRU).

4. Emulates "experts larger than RAM": before the run and after every decode step the checkpoint files' pages (and
   accelerate's offload folder) are dropped from the OS page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``, from
   a ``StoppingCriteria`` that also timestamps every step (``--no-evict`` keeps the page cache warm instead).
5. Reports prefill time, decode tokens/s, bytes really read from disk per generated token (``/proc/self/io``),
   hf_moe_offload's bytes moved per token and hit rate, peak RSS, greedy-token agreement with ``resident``, and the
   I/O ceiling ``disk bandwidth / bytes that must move per token``. Writes JSON + PNG and prints a markdown table.

Example:
    # quick smoke run (~2 minutes on 2 cores), results outside the repository
    python scripts/bench.py --small --out /tmp/bench_small
    # the documented benchmark (4-9 minutes on 2 shared cores): benchmarks/results/cpu_mixtral_1.5gb.{json,png}
    python scripts/bench.py --threads 1 --idle-wait 30
    # same, page cache left warm: benchmarks/results/cpu_mixtral_1.5gb_warm.{json,png}
    python scripts/bench.py --threads 1 --idle-wait 30 --no-evict
    # re-render table and PNG from a saved run
    python scripts/bench.py --from-json benchmarks/results/cpu_mixtral_1.5gb.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = logging.getLogger("bench")

REPO_ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("resident", "accelerate", "hf_moe_offload", "hf_moe_offload_layer")
DEFAULT_SYSTEMS = SYSTEMS
OURS_POLICY = {"device": "cpu", "store": "disk", "expert_cache": "25%", "eviction": "lru"}
# hf_moe_offload systems: the policy (LRU) and the same with the library's default layer-aware eviction.
POLICIES = {"hf_moe_offload": OURS_POLICY, "hf_moe_offload_layer": {**OURS_POLICY, "eviction": "layer"}}
MiB = 2**20


# ----------------------------------------------------------------------------------------------------------- shape


@dataclass(frozen=True)
class ModelShape:
    """The Mixtral shape of the random model (defaults: about 1.5 GB in bf16)."""

    hidden: int = 1024
    intermediate: int = 3584
    layers: int = 8
    experts: int = 8
    top_k: int = 2
    heads: int = 16
    kv_heads: int = 8
    vocab: int = 32000

    @property
    def tag(self) -> str:
        return (f"mixtral_h{self.hidden}_i{self.intermediate}_l{self.layers}_e{self.experts}_k{self.top_k}"
                f"_a{self.heads}x{self.kv_heads}_v{self.vocab}")

    def expert_bytes(self) -> int:
        """Bytes of all experts in bf16 (gate, up and down per expert)."""
        return 3 * self.hidden * self.intermediate * self.experts * self.layers * 2


SMALL = ModelShape(hidden=256, intermediate=768, layers=4, experts=8, top_k=2, heads=8, kv_heads=4, vocab=4096)


# ----------------------------------------------------------------------------------------------------------- model


def build_checkpoint(shape: ModelShape, seed: int, workdir: Path, shard_size: str) -> Path:
    """Random-weight Mixtral saved in bf16 Hub layout under `workdir`; reused when it already exists."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    path = workdir / f"{shape.tag}_seed{seed}"
    marker = path / "bench_model.json"
    if marker.exists():
        log.info("reusing checkpoint %s", path)
        return path
    shutil.rmtree(path, ignore_errors=True)
    config = MixtralConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        num_local_experts=shape.experts, num_experts_per_tok=shape.top_k, max_position_embeddings=4096,
        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    log.info("building %s (seed %d) in bf16 ...", shape.tag, seed)
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = MixtralForCausalLM._from_config(config, dtype=torch.bfloat16)   # built in bf16: no fp32 copy
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, max_shard_size=shard_size)
    del model
    files = checkpoint_files(path)
    fsync_files(files)
    info = {"shape": dataclasses.asdict(shape), "seed": seed, "num_parameters": n_params,
            "bytes_on_disk": sum(f.stat().st_size for f in files), "files": [f.name for f in files]}
    marker.write_text(json.dumps(info, indent=2) + "\n")
    log.info("built %s: %.2f GB in %d shards, %.0f s", path, info["bytes_on_disk"] / 1e9, len(files),
             time.perf_counter() - start)
    return path


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


# ------------------------------------------------------------------------------------------------------ page cache


def fsync_files(files: list[Path]) -> None:
    """Write back dirty pages (POSIX_FADV_DONTNEED only drops clean ones)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict_from_page_cache(files: list[Path]) -> None:
    """Drop the files' clean pages from the OS page cache, so the next read really goes to the disk."""
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def proc_read_bytes() -> int:
    """Bytes this process (all threads) made the kernel fetch from a block device."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def disk_bandwidth(files: list[Path], repeats: int = 3, chunk: int = 16 * MiB) -> dict[str, Any]:
    """Sequential read bandwidth of the largest checkpoint shard, read cold (evicted first); best of `repeats` (the
    physical limit; on a shared machine single runs come out lower)."""
    target = max(files, key=lambda f: f.stat().st_size)
    buf = bytearray(chunk)
    rates = []
    for _ in range(repeats):
        evict_from_page_cache([target])
        before = proc_read_bytes()
        start = time.perf_counter()
        total = 0
        with open(target, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
        elapsed = time.perf_counter() - start
        rates.append(total / elapsed)
        log.info("disk read %s: %.0f MB in %.2f s = %.0f MB/s (block reads %.0f MB)", target.name, total / 1e6,
                 elapsed, total / elapsed / 1e6, (proc_read_bytes() - before) / 1e6)
    evict_from_page_cache([target])
    return {"file": target.name, "file_bytes": target.stat().st_size, "chunk_bytes": chunk,
            "runs_bytes_per_s": rates, "bytes_per_s": max(rates), "median_bytes_per_s": statistics.median(rates)}


def combine_bandwidth(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Measurements taken before and after the runs, pooled: the best one is the physical limit."""
    rates = first["runs_bytes_per_s"] + second["runs_bytes_per_s"]
    return {**first, "runs_bytes_per_s": rates, "bytes_per_s": max(rates),
            "median_bytes_per_s": statistics.median(rates)}


# ---------------------------------------------------------------------------------------------------------- worker


class StepProbe:
    """A `StoppingCriteria` (duck-typed) called once per generated token: timestamps, disk reads, optional stats
    snapshot, then page-cache eviction. Never stops generation."""

    def __init__(self, evict_files: list[Path] | None, snapshot: Callable[[], dict] | None):
        self.evict_files = evict_files
        self.snapshot = snapshot
        self.enter: list[float] = []
        self.exit: list[float] = []
        self.reads_enter: list[int] = []
        self.reads_exit: list[int] = []
        self.stats: list[dict] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.enter.append(time.perf_counter())
        self.reads_enter.append(proc_read_bytes())
        if self.snapshot is not None:
            self.stats.append(self.snapshot())
        if self.evict_files:
            evict_from_page_cache(self.evict_files)
        self.reads_exit.append(proc_read_bytes())
        self.exit.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def accelerate_device_map(path: Path) -> dict[str, str]:
    """accelerate placement: every module owning tensors on "cpu", every `...mlp.experts` module on "disk"."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    experts = [name for name, _ in skeleton.named_modules() if name.endswith("mlp.experts")]
    device_map: dict[str, str] = {}
    for name, module in skeleton.named_modules():
        if any(name == e or name.startswith(e + ".") for e in experts):
            continue
        if next(module.parameters(recurse=False), None) is not None or \
                next(module.buffers(recurse=False), None) is not None:
            device_map[name] = "cpu"
    device_map.update({e: "disk" for e in experts})
    return device_map


def load_system(system: str, path: Path, offload_folder: Path):
    """Load the model the way `system` does; returns (model, extra files whose pages to evict)."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_moe_offload  # noqa: F401  (installs the offload_policy keyword)

    if system == "resident":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), []
    if system == "accelerate":
        shutil.rmtree(offload_folder, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=accelerate_device_map(path),
                                                     offload_folder=str(offload_folder))
        files = sorted(p for p in offload_folder.rglob("*") if p.is_file())
        fsync_files(files)
        return model, files
    if system in POLICIES:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload_policy=POLICIES[system]), []
    raise ValueError(f"unknown system {system!r}; allowed: {SYSTEMS}")


def make_prompt(vocab: int, batch: int, prompt_len: int, seed: int):
    """Random prompt ids (the same rows for every system), avoiding the special ids 0-2."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (max(batch, 8), prompt_len), generator=gen)[:batch]
    return ids, torch.ones_like(ids)


def warmup(model, spec: dict[str, Any]) -> float:
    """A short generate on a different prompt, so one-time costs (code pages, allocator, thread pools) stay out of
    the measurement. hf_moe_offload's cache keeps what this run loaded (a running server's situation)."""
    import torch

    if spec["warmup_tokens"] <= 0:
        return 0.0
    ids, mask = make_prompt(spec["vocab"], spec["batch"], spec["prompt_len"], spec["seed"] + 1)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=spec["warmup_tokens"],
                       min_new_tokens=spec["warmup_tokens"], do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def summarize_steps(probe: StepProbe, gen_start: float, reads_start: int, batch: int) -> dict[str, Any]:
    """Prefill and decode timings and disk reads from the probe's per-step records (eviction time excluded)."""
    n = len(probe.enter)
    step_s = [probe.enter[i] - probe.exit[i - 1] for i in range(1, n)]
    step_reads = [probe.reads_enter[i] - probe.reads_exit[i - 1] for i in range(1, n)]
    decode_s = sum(step_s)
    decode_tokens = batch * (n - 1)
    return {
        "prefill_s": probe.enter[0] - gen_start,
        "prefill_read_bytes": probe.reads_enter[0] - reads_start,
        "decode_steps": n - 1,
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
        "decode_step_s": step_s,
        "decode_step_read_bytes": step_reads,
        "decode_read_bytes": sum(step_reads),
        "read_bytes_per_token": sum(step_reads) / decode_tokens,
        "evict_s": sum(x - e for e, x in zip(probe.enter, probe.exit)),
    }


def summarize_ours(probe: StepProbe, decode_tokens: int) -> dict[str, Any]:
    """hf_moe_offload counters over the decode steps only (first probe call = end of prefill)."""
    first, last = probe.stats[0], probe.stats[-1]
    d = {k: last[k] - first[k] for k in ("hits", "misses", "evictions", "bytes_to_device", "stall_s")}
    lookups = d["hits"] + d["misses"]
    return {
        "decode": d,
        "decode_hit_rate": d["hits"] / lookups if lookups else float("nan"),
        "bytes_to_device_per_token": d["bytes_to_device"] / decode_tokens,
        "prefill": {k: first[k] for k in ("hits", "misses", "bytes_to_device", "stall_s")},
        "cache_capacity_bytes": last["cache_capacity_bytes"],
        "peak_cache_bytes": last["peak_cache_bytes"],
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set since it started (`VmHWM`). Not `ru_maxrss`: Linux carries that across
    fork + exec, so a worker would report the parent's peak (the one that built the model) as its own."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024          # kB
    raise RuntimeError("/proc/self/status has no VmHWM")


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One system at one batch size, in this (fresh) process."""
    import torch

    torch.set_num_threads(spec["threads"])
    system, batch, evict = spec["system"], spec["batch"], spec["evict"]
    path = Path(spec["checkpoint"])
    ckpt_files = checkpoint_files(path)
    offload_folder = Path(spec["offload_folder"])
    rss_import = peak_rss_bytes()
    if evict:
        evict_from_page_cache(ckpt_files)
    reads0, t0 = proc_read_bytes(), time.perf_counter()
    model, extra_files = load_system(system, path, offload_folder)
    load_s, load_reads = time.perf_counter() - t0, proc_read_bytes() - reads0
    rss_load = peak_rss_bytes()
    evict_files = (ckpt_files + extra_files) if evict else None
    if evict:
        evict_from_page_cache(evict_files)

    warmup_s = warmup(model, spec)
    if evict:
        evict_from_page_cache(evict_files)
    snapshot = None
    if system in POLICIES:
        import hf_moe_offload

        hf_moe_offload.stats(model).reset()
        snapshot = lambda: dict(hf_moe_offload.stats(model))  # noqa: E731
    ids, mask = make_prompt(spec["vocab"], batch, spec["prompt_len"], spec["seed"])
    probe = StepProbe(evict_files, snapshot)
    reads_start, gen_start = proc_read_bytes(), time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=spec["new_tokens"],
                             min_new_tokens=spec["new_tokens"], do_sample=False, stopping_criteria=[probe],
                             pad_token_id=0)
    result = {
        "system": system, "batch": batch, "evict": evict, "load_s": load_s, "load_read_bytes": load_reads,
        "warmup_s": warmup_s, "experts_implementation": model.config._experts_implementation,
        **summarize_steps(probe, gen_start, reads_start, batch),
        "tokens": out[:, ids.shape[1]:].tolist(),
        "rss_after_import_bytes": rss_import, "rss_after_load_bytes": rss_load, "peak_rss_bytes": peak_rss_bytes(),
    }
    if system == "accelerate":
        result["offload_folder_bytes"] = sum(f.stat().st_size for f in extra_files)
    if system in POLICIES:
        result["policy"] = POLICIES[system]
        result["ours"] = summarize_ours(probe, result["decode_tokens"])
    return result


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]                       # idle + iowait
    total = sum(values[:8])                            # guest time is already inside user/nice
    return total - idle, total


def busy_share(seconds: float) -> float:
    """Share of all cores busy over the next `seconds` (anything running, this process is idle meanwhile)."""
    busy0, total0 = cpu_jiffies()
    time.sleep(seconds)
    busy1, total1 = cpu_jiffies()
    return (busy1 - busy0) / max(1, total1 - total0)


def wait_for_idle(max_wait_s: float, threshold: float = 0.15, window_s: float = 3.0) -> float:
    """Wait (at most `max_wait_s`) until other work leaves the CPUs mostly idle; returns the seconds waited.
    The machine may be shared: a concurrent job halves the cores and makes torch's threads contend."""
    start = time.perf_counter()
    while True:
        share = busy_share(window_s)
        waited = time.perf_counter() - start
        if share < threshold or waited >= max_wait_s:
            if share >= threshold:
                log.warning("CPUs still %.0f%% busy with other work after %.0f s; running anyway", 100 * share,
                            waited)
            return waited
        log.info("CPUs %.0f%% busy with other work; waiting (%.0f/%.0f s)", 100 * share, waited, max_wait_s)


def spawn_worker(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run `run_worker(spec)` in a fresh Python process and return its result, with the share of the machine's CPU
    time that other processes used meanwhile (`foreign_cpu_share`: 0 = we had the machine to ourselves)."""
    with tempfile.TemporaryDirectory(prefix="bench_worker_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), "--worker-out",
               str(out_path)]
        own0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy0, total0 = cpu_jiffies()
        start = time.perf_counter()
        proc = subprocess.run(cmd, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"worker {spec['system']} batch {spec['batch']} failed with exit code "
                               f"{proc.returncode}")
        wall = time.perf_counter() - start
        busy1, total1 = cpu_jiffies()
        own1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = json.loads(out_path.read_text())
        tick = os.sysconf("SC_CLK_TCK")
        own_s = (own1.ru_utime - own0.ru_utime) + (own1.ru_stime - own0.ru_stime)
        result["process_wall_s"] = wall
        result["worker_cpu_s"] = own_s
        result["foreign_cpu_share"] = max(0.0, (busy1 - busy0) / tick - own_s) / max(1e-9, (total1 - total0) / tick)
        return result


# ---------------------------------------------------------------------------------------------------------- report


def compare_tokens(results: list[dict]) -> None:
    """Add `tokens_match` / `mismatched_tokens` against `resident` at the same batch size (in place)."""
    reference = {r["batch"]: r["tokens"] for r in results if r["system"] == "resident"}
    for r in results:
        ref = reference.get(r["batch"])
        if ref is None:
            r["tokens_match"] = None
            continue
        mismatched = sum(a != b for row_a, row_b in zip(r["tokens"], ref) for a, b in zip(row_a, row_b))
        r["mismatched_tokens"] = mismatched
        r["first_mismatch_step"] = min((i for row_a, row_b in zip(r["tokens"], ref)
                                        for i, (a, b) in enumerate(zip(row_a, row_b)) if a != b), default=None)
        r["tokens_match"] = mismatched == 0


def add_ceilings(results: list[dict], bandwidth: float) -> None:
    """I/O ceiling: tokens/s if the bytes that must move per token streamed at the disk's sequential bandwidth.

    For hf_moe_offload the bytes that must move are its cache misses (`bytes_to_device`); for accelerate, the bytes
    actually read from disk (`/proc/self/io`). Only meaningful when the page cache is evicted (else nothing comes from
    the disk)."""
    for r in results:
        if r["system"] == "resident" or not r["evict"]:   # nothing has to come from the disk
            r["must_move_bytes_per_token"], r["io_ceiling_tok_s"] = 0, None
            continue
        must_move = r["ours"]["bytes_to_device_per_token"] if "ours" in r else r["read_bytes_per_token"]
        r["must_move_bytes_per_token"] = must_move
        r["io_ceiling_tok_s"] = bandwidth / must_move if must_move > 0 else None


def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown_table(results: list[dict]) -> str:
    header = ("| system | batch | load s | prefill s | decode tok/s | I/O ceiling tok/s | disk MB/token | "
              "moved MB/token | hit rate | peak RSS GiB | greedy tokens = resident | other CPU load |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in sorted(results, key=lambda r: (r["batch"], SYSTEMS.index(r["system"]))):
        ours = r.get("ours")
        match = "ref" if r["system"] == "resident" else (
            "yes" if r["tokens_match"] else f"no ({r['mismatched_tokens']}/{r['decode_tokens'] + r['batch']})")
        lines.append("| " + " | ".join([
            r["system"], str(r["batch"]), f"{r['load_s']:.1f}", f"{r['prefill_s']:.2f}", f"{r['decode_tok_s']:.2f}",
            fmt(r["io_ceiling_tok_s"], ".2f"), f"{r['read_bytes_per_token'] / 1e6:.1f}",
            fmt(ours["bytes_to_device_per_token"] / 1e6 if ours else None, ".1f"),
            fmt(ours["decode_hit_rate"] if ours else None, ".0%"), f"{r['peak_rss_bytes'] / 2**30:.2f}", match,
            f"{r['foreign_cpu_share']:.0%}",
        ]) + " |")
    return "\n".join(lines)


COLORS = {"resident": "#7f7f7f", "accelerate": "#d62728", "hf_moe_offload": "#1f77b4",
          "hf_moe_offload_layer": "#2ca02c"}
CACHE_COLORS = {"hf_moe_offload": "#9ecae1", "hf_moe_offload_layer": "#a1d99b"}


def grouped_bars(ax, batches: list[int], series: list[tuple[str, list[float], str, str | None]]) -> list[list[float]]:
    """One group of bars per batch size, one bar per (label, values, color, hatch); returns each series' x's."""
    width = 0.8 / len(series)
    all_xs = []
    for j, (label, vals, color, hatch) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(batches))]
        bars = ax.bar(xs, vals, width, label=label, color=color, hatch=hatch, edgecolor="white" if hatch else None)
        ax.bar_label(bars, labels=[f"{v:.1f}" if v >= 1 or v == 0 else f"{v:.2f}" for v in vals], fontsize=8,
                     padding=2)
        all_xs.append(xs)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.grid(axis="y", alpha=0.3)
    return all_xs


def plot(results: list[dict], title: str, png: Path) -> None:
    """Left: decode tokens/s per system and batch size, with hf_moe_offload's I/O ceiling. Right: MB read from disk
    per generated token, plus the MB hf_moe_offload copied into its cache per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    batches = sorted({r["batch"] for r in results})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in results)]
    by = {(r["system"], r["batch"]): r for r in results}

    def values(system: str, get: Callable[[dict], float]) -> list[float]:
        return [get(by[(system, b)]) if (system, b) in by else 0.0 for b in batches]

    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 5.6))
    xs = grouped_bars(left, batches, [(s, values(s, lambda r: r["decode_tok_s"]), COLORS[s], None) for s in systems])
    width = 0.8 / len(systems)
    for system in [s for s in systems if s in POLICIES]:
        ceilings = values(system, lambda r: r.get("io_ceiling_tok_s") or 0.0)
        for x, c in zip(xs[systems.index(system)], ceilings):
            if c:
                left.hlines(c, x - width / 2, x + width / 2, colors="black", linestyles="--", linewidth=1.5,
                            label="I/O ceiling (disk bandwidth / bytes moved per token)")
                left.annotate(f"{c:.1f}", (x, c), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    left.set_yscale("log")      # resident and disk-bound systems differ by an order of magnitude
    top = max([r["decode_tok_s"] for r in results] + [r.get("io_ceiling_tok_s") or 0 for r in results])
    left.set_ylim(top=top * 2)
    left.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    left.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
    left.set_ylabel("decode tokens/s, log scale (higher is better)")
    handles, labels = left.get_legend_handles_labels()
    unique = dict(zip(labels, handles))          # one entry for all the ceiling marks
    left.legend(unique.values(), unique.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize=8,
                frameon=False)

    series = [(f"{s}: read from disk", values(s, lambda r: r["read_bytes_per_token"] / 1e6), COLORS[s], None)
              for s in systems]
    series += [(f"{s}: copied into its cache", values(s, lambda r: r["ours"]["bytes_to_device_per_token"] / 1e6),
                CACHE_COLORS[s], "//") for s in systems if s in POLICIES]
    grouped_bars(right, batches, series)
    right.margins(y=0.12)
    right.set_ylabel("MB per generated token (lower is better)")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def machine_info(workdir: Path) -> dict[str, Any]:
    import accelerate
    import psutil
    import safetensors
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    real = str(workdir.resolve())
    mount = max((m for m in mounts if real == m[1] or real.startswith(m[1].rstrip("/") + "/")),
                key=lambda m: len(m[1]), default=None)
    readahead = None
    if mount and mount[0].startswith("/dev/"):
        ra = Path(f"/sys/class/block/{Path(mount[0]).name}/queue/read_ahead_kb")
        readahead = int(ra.read_text()) if ra.exists() else None
    return {
        "cpu": cpu, "logical_cores": os.cpu_count(), "torch_default_threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total, "kernel": platform.release(), "python": platform.python_version(),
        "workdir_filesystem": {"device": mount[0], "mountpoint": mount[1], "type": mount[2],
                               "read_ahead_kb": readahead} if mount else None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__, "safetensors": safetensors.__version__},
    }


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty_files": git("status", "--porcelain").splitlines()}


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ModelShape()
    p.add_argument("--small", action="store_true", help=f"small preset for a smoke run ({SMALL.tag})")
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--experts", type=int, default=d.experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the prompt")
    p.add_argument("--shard-size", default="400MB", help="save_pretrained max_shard_size")
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS,
                   help="hf_moe_offload uses eviction='lru' (the issue's policy); hf_moe_offload_layer the library's "
                        "default eviction='layer'")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--warmup-tokens", type=int, default=2,
                   help="tokens of an untimed generate (other prompt) before the measured one; 0 to skip")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker (1 by default: on a small shared machine two OpenMP threads "
                        "contending with other work run several times slower; hf_moe_offload's copy thread also "
                        "needs a core)")
    p.add_argument("--no-evict", action="store_true",
                   help="keep the page cache warm (no posix_fadvise eviction before the run and after every step)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hf_moe_offload_bench"),
                   help="where the random checkpoint and accelerate's offload folder live")
    p.add_argument("--out", type=Path, default=None,
                   help="output path without extension (default: benchmarks/results/cpu_mixtral_1.5gb[_warm], or "
                        "cpu_mixtral_small[_warm] with --small)")
    p.add_argument("--idle-wait", type=float, default=30,
                   help="before each system, wait up to this many seconds for other work to leave the CPUs idle "
                        "(0: don't wait); the share of CPU other processes used during each run is reported")
    p.add_argument("--worker-timeout", type=float, default=1800)
    p.add_argument("--from-json", type=Path, default=None,
                   help="don't run: re-render the table and the PNG from an earlier run's JSON")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    if args.small:
        return SMALL
    return ModelShape(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, experts=args.experts,
                      top_k=args.top_k, heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab)


def default_out(args: argparse.Namespace) -> Path:
    name = "cpu_mixtral_small" if args.small else "cpu_mixtral_1.5gb"
    return REPO_ROOT / "benchmarks" / "results" / (name + ("_warm" if args.no_evict else ""))


def run_benchmark(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from tqdm.auto import tqdm

    started = time.perf_counter()
    load_before = os.getloadavg()
    git_start = git_commit()
    shape = shape_from_args(args)
    args.workdir.mkdir(parents=True, exist_ok=True)
    path = build_checkpoint(shape, args.seed, args.workdir, args.shard_size)
    files = checkpoint_files(path)
    bandwidth = disk_bandwidth(files)
    runs = [(b, s) for b in args.batch_sizes for s in args.systems]
    results = []
    for batch, system in tqdm(runs, desc="systems", unit="run"):
        spec = {"system": system, "batch": batch, "evict": not args.no_evict, "checkpoint": str(path),
                "offload_folder": str(args.workdir / "accelerate_offload"), "threads": args.threads,
                "vocab": shape.vocab, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "seed": args.seed,
                "warmup_tokens": args.warmup_tokens}
        waited = wait_for_idle(args.idle_wait) if args.idle_wait > 0 else 0.0
        log.info("running %s at batch %d (%s page cache)", system, batch, "warm" if args.no_evict else "evicted")
        r = spawn_worker(spec, args.worker_timeout)
        r["idle_wait_s"] = waited
        r["loadavg_1m_after"] = os.getloadavg()[0]
        log.info("%s batch %d: prefill %.2f s, decode %.2f tok/s, %.1f MB read/token, peak RSS %.2f GiB", system,
                 batch, r["prefill_s"], r["decode_tok_s"], r["read_bytes_per_token"] / 1e6,
                 r["peak_rss_bytes"] / 2**30)
        results.append(r)
    shutil.rmtree(args.workdir / "accelerate_offload", ignore_errors=True)
    compare_tokens(results)
    bandwidth = combine_bandwidth(bandwidth, disk_bandwidth(files))   # again at the end: the disk may be shared
    add_ceilings(results, bandwidth["bytes_per_s"])
    meta = json.loads((path / "bench_model.json").read_text())
    return {
        "command": shlex.join(["python", "scripts/bench.py", *argv]),
        "git": git_start,
        "git_at_end": git_commit(),   # differs from "git" if the library changed during the run
        "machine": machine_info(args.workdir),
        "model": {**meta, "checkpoint": str(path), "expert_bytes": shape.expert_bytes()},
        "settings": {"batch_sizes": args.batch_sizes, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "warmup_tokens": args.warmup_tokens,
                     "evict_page_cache": not args.no_evict, "threads": args.threads, "seed": args.seed,
                     "hf_moe_offload_policy": OURS_POLICY},
        "disk_bandwidth": bandwidth,
        "results": results,
        "total_wall_s": time.perf_counter() - started,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    }


def reload_report(path: Path) -> dict[str, Any]:
    """An earlier run's report with its derived numbers (bandwidth estimate, ceilings) recomputed; measurements as
    they were."""
    report = json.loads(path.read_text())
    bw = report["disk_bandwidth"]
    bw["bytes_per_s"] = max(bw["runs_bytes_per_s"])
    bw["median_bytes_per_s"] = statistics.median(bw["runs_bytes_per_s"])
    add_ceilings(report["results"], bw["bytes_per_s"])
    return report


def write_outputs(report: dict[str, Any], out: Path) -> None:
    """`out`.json, `out`.png and the markdown table on stdout."""
    json_path, png_path = out.parent / (out.name + ".json"), out.parent / (out.name + ".png")
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    settings, machine = report["settings"], report["machine"]
    mode = "page cache evicted every step" if settings["evict_page_cache"] else "page cache warm"
    title = (f"{report['model']['bytes_on_disk'] / 1e9:.2f} GB random Mixtral, CPU ({machine['logical_cores']} cores, "
             f"{settings['threads']} torch thread(s)), {mode}, {settings['new_tokens']} new tokens; "
             f"disk {report['disk_bandwidth']['bytes_per_s'] / 1e6:.0f} MB/s")
    print(f"\n{title}\n\n{markdown_table(report['results'])}\n")
    written = [json_path] + ([png_path] if try_plot(report["results"], title, png_path) else [])
    print(f"wrote {' and '.join(map(str, written))} (run took {report['total_wall_s']:.0f} s)")


def try_plot(results: list[dict], title: str, png: Path) -> bool:
    """Render the PNG if matplotlib is there; without it, one warning line (the JSON holds every measurement)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("no plot: matplotlib is not installed; pip install matplotlib (or .[bench]) for the plot")
        return False
    plot(results, title, png)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.worker is not None:
        result = run_worker(json.loads(args.worker.read_text()))
        args.worker_out.write_text(json.dumps(result))
        return 0
    if args.from_json is not None:
        out = args.from_json.with_name(args.from_json.name.removesuffix(".json"))
        write_outputs(reload_report(args.from_json), out)
        return 0
    out = args.out or default_out(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_outputs(run_benchmark(args, argv), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
