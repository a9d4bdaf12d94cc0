#!/usr/bin/env python
"""Larger than RAM, for real: decode under a memory cap set by a Linux control group (cgroup_cap.py), where the
page cache counts against the cap as on a small machine or in a container, instead of dropping the page cache.

For every cap (a share of the checkpoint's bytes, plus `--allowance-mib`) x batch size, one worker process per
system runs inside its own group (made before the worker's first byte, removed afterwards, error or not):

- `ours_auto`: `offload_policy={"device": "cpu", "store": "disk", "expert_cache": "auto", "max_batch_size": B,
  "max_seq_len": prompt + new tokens}` (the library sizes its cache from the group's limit, as in a container);
- `ours_cap`: the same with the cache sized to the cap by the benchmark: the cap less a worker's own charge, the
  non-expert weights, their prepacked copies and a share of the cap for page cache and activations;
- `accelerate`: accelerate's disk offload (every experts module on "disk", as in bench.py);
- `llama_cpp`: llama-cpp-python on the same weights as a bf16 GGUF (mmap, as llama.cpp reads by default), same
  thread count.

Opt-in, approximate (`--systems ... ours_int8 llama_cpp_q8_0 ours_int4 llama_cpp_q4_0`): fewer bytes per expert
on both sides.
- `ours_int8` / `ours_int4`: `ours_auto` with `quantize="int8"` (a scale per output channel) / `"int4"` (a scale and
  zero per 64 weights): experts stored, read and computed quantized; the quantized folder is written once, outside
  any cap, before the first row (as a user quantizes once, not at every start);
- `llama_cpp_q8_0` / `llama_cpp_q4_0`: llama.cpp on a GGUF whose expert tensors are Q8_0 / Q4_0 (8 / 4 bits and a
  scale per 32 weights), the rest bf16.
Their tokens are compared with `resident`'s too, but equality is not promised; `ours_int8` is read against
`llama_cpp_q8_0`, `ours_int4` against `llama_cpp_q4_0`.

A `resident` and a `llama_cpp` worker run once per batch size without a cap: the token reference and the
in-RAM speeds (llama.cpp's kernels with no reads). The
checkpoint's, the GGUF's and accelerate's offload folder's pages are dropped from the page cache before each worker,
so every page a worker reads is charged to its own group. Reported per row: decode tok/s, disk bytes read per
generated token (/proc/self/io, per step), peak RSS (VmHWM) and the group's peak charge (page cache included),
limit hits and OOM kills, greedy-token agreement with `resident` (llama.cpp's arithmetic differs: not compared),
and the planner's predicted tok/s for the cache the row really had.

    HF_HUB_OFFLINE=1 python scripts/bench_memcap.py --layers 10 --out benchmarks/results/cpu_memcap_mixtral_1.95gb
    python scripts/bench_memcap.py --quick --out /tmp/memcap_quick     # small model, a few minutes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench
from bench import GiB, ModelShape
from cgroup_cap import memory_cap

log = logging.getLogger("bench_memcap")

SYSTEMS = ("ours_auto", "ours_cap", "accelerate", "llama_cpp")
QUANTIZE_OF = {"ours_int8": "int8", "ours_int4": "int4"}      # opt-in, approximate: ours with quantized experts ...
PEER_OF = {"ours_int8": "llama_cpp_q8_0", "ours_int4": "llama_cpp_q4_0"}   # ... read against llama.cpp's like
QUANTIZED_SYSTEMS = ("ours_int8", "llama_cpp_q8_0", "ours_int4", "llama_cpp_q4_0")
ALL_SYSTEMS = SYSTEMS + QUANTIZED_SYSTEMS
LLAMA_SYSTEMS = {"llama_cpp": "bf16", "llama_cpp_q8_0": "q8_0", "llama_cpp_q4_0": "q4_0"}   # -> its GGUF's experts
OURS_BASE = {"device": "cpu", "store": "disk"}
# A worker's own charge to its group with torch, transformers and the library imported (anonymous memory and the
# page cache it faults in; shared libraries already cached elsewhere are not charged), measured in a cap here.
WORKER_CHARGE = 300 * 2**20
SLACK_SHARE = 0.15                # of the cap, left for page cache (the store's reads, code pages) and activations


def cap_cache_bytes(shape: ModelShape, cap: int) -> int:
    """`ours_cap`'s expert cache: what the cap leaves after the worker, the non-expert weights, their prepacked
    copies (every one but the embedding's: the CPU kernels keep a packed copy of each bf16 linear layer) and the
    slack; at least one layer's top-k (the smallest cache that runs)."""
    packed = shape.non_expert_bytes() - 2 * shape.vocab * shape.hidden
    room = cap - WORKER_CHARGE - shape.non_expert_bytes() - packed - int(SLACK_SHARE * cap)
    return max(room, shape.top_k * shape.one_expert_bytes())


def plan_rows(shape: ModelShape, caps: list[float], batches: list[int], systems: list[str], allowance: int
              ) -> list[dict[str, Any]]:
    """Every (cap, batch, system) row, the uncapped references first for each batch."""
    rows = []
    for batch in batches:
        # Uncapped: transformers' resident model (the token reference) and llama.cpp with every page cached (its
        # kernels alone), the in-RAM speeds the capped rows are read against.
        rows += [{"system": s, "batch": batch, "cap_share": None, "cap_bytes": None}
                 for s in ("resident", *LLAMA_SYSTEMS) if s == "resident" or s in systems]
        for share in caps:
            cap = int(share * shape.total_bytes()) + allowance
            rows += [{"system": s, "batch": batch, "cap_share": share, "cap_bytes": cap} for s in systems]
    return rows


def worker_spec(args: argparse.Namespace, shape: ModelShape, checkpoint: Path, ggufs: dict[str, str],
                row: dict[str, Any]) -> dict[str, Any]:
    """What bench.run_worker (or the llama.cpp worker) needs for the row; the page cache is never dropped inside
    the worker (the cap does the evicting). `ggufs`: each llama.cpp system's file."""
    policy = None
    if row["system"] in ("ours_auto", *QUANTIZE_OF):
        # The workload given: without it "auto" keeps room for a 4096-token full-logits forward (the model's
        # max_position_embeddings), more than these caps hold, and refuses to load.
        policy = {**OURS_BASE, "expert_cache": "auto", "max_batch_size": row["batch"],
                  "max_seq_len": args.prompt_len + args.new_tokens}
        if row["system"] in QUANTIZE_OF:
            policy["quantize"] = QUANTIZE_OF[row["system"]]
    elif row["system"] == "ours_cap":
        policy = {**OURS_BASE, "expert_cache": cap_cache_bytes(shape, row["cap_bytes"])}
    if policy is not None:
        policy.update(args.policy_extra)
    return {**row, "store": None if row["system"] == "resident" else "disk", "device": "cpu", "evict": False,
            "checkpoint": str(checkpoint), "gguf": ggufs.get(row["system"]), "policy": policy,
            "offload_folder": str(args.workdir / "accelerate_offload"), "threads": args.threads,
            "vocab": shape.vocab, "one_expert_bytes": shape.one_expert_bytes(), "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "seed": args.seed, "warmup_tokens": args.warmup_tokens}


# ---------------------------------------------------------------------------------------------------------- worker

def run_llama_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's row: load (mmap), a warm-up generate on another prompt, then the measured greedy decode."""
    import llama_peer

    reads0, t0 = bench.proc_read_bytes(), time.perf_counter()
    llm = llama_peer.load(spec["gguf"], spec["threads"])
    load_s, load_reads = time.perf_counter() - t0, bench.proc_read_bytes() - reads0
    batch = spec["batch"]
    if spec["warmup_tokens"] > 0:
        ids, _ = bench.make_prompt(spec["vocab"], batch, spec["prompt_len"], spec["seed"] + 1)
        llama_peer.decode(llm, ids.tolist(), spec["warmup_tokens"] + 1, spec["threads"])
    ids, _ = bench.make_prompt(spec["vocab"], batch, spec["prompt_len"], spec["seed"])
    out = llama_peer.decode(llm, ids.tolist(), spec["new_tokens"], spec["threads"])
    llm.close()
    return {**{k: spec[k] for k in ("system", "batch", "device", "store", "cap_bytes")}, **out,
            "load_s": load_s, "load_read_bytes": load_reads,
            "decode_tok_s": out["decode_tokens"] / out["decode_s"],
            "decode_read_bytes": sum(out["decode_step_read_bytes"]),
            "read_bytes_per_token": sum(out["decode_step_read_bytes"]) / out["decode_tokens"],
            "peak_rss_bytes": bench.peak_rss_bytes()}


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["system"] in LLAMA_SYSTEMS:
        return run_llama_worker(spec)
    if spec["policy"] is not None:         # bench.run_worker reads the row's policy from its table
        bench.POLICIES[spec["system"]] = spec["policy"]
    return bench.run_worker(spec)


# ---------------------------------------------------------------------------------------------------------- parent

def page_cache_files(spec: dict[str, Any]) -> list[Path]:
    """Files whose pages a worker reads: dropped before it starts, so its reads are charged to its group."""
    files = bench.checkpoint_files(Path(spec["checkpoint"]))
    folders = [Path(spec["offload_folder"])] + ([quantized_folder(spec)] if spec["system"] in QUANTIZE_OF else [])
    for folder in folders:
        files += sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []
    return files + ([Path(spec["gguf"])] if spec.get("gguf") else [])


def quantized_folder(spec: dict[str, Any]) -> Path:
    """Where bench.load_system keeps a quantized row's experts (beside accelerate's offload folder)."""
    return Path(spec["offload_folder"]).parent / f"quantized_{QUANTIZE_OF[spec['system']]}"


def spawn(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One worker process, inside a fresh group capped at the row's bytes (none for an uncapped row); the row
    with the group's counters, or with `error` when the worker failed (an OOM kill at the cap included)."""
    bench.evict_from_page_cache(page_cache_files(spec))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="memcap_worker_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), "--worker-out",
                str(out_path)]
        cap_ctx = memory_cap(spec["cap_bytes"], "bench_memcap") if spec["cap_bytes"] else contextlib.nullcontext()
        with cap_ctx as cap:
            start = time.perf_counter()
            try:
                rc = subprocess.run(cap.command(argv) if cap else argv, timeout=timeout_s, check=False).returncode
                error = None if rc == 0 else f"worker exited with status {rc}"
            except subprocess.TimeoutExpired:
                error = f"worker timed out after {timeout_s:.0f} s"
            wall = time.perf_counter() - start
            group = cap.stats() if cap else None
        base = {k: spec[k] for k in ("system", "batch", "cap_share", "cap_bytes")}
        if group and group.get("oom_kills"):
            error = f"{error}: OOM-killed at the cap ({group['oom_kills']} kill(s))"
        result = {**base, "error": error} if error else {**json.loads(out_path.read_text()), **base}
    result.update(cgroup=group, process_wall_s=wall, loadavg_1m_before=load_before,
                  loadavg_1m_after=os.getloadavg()[0], policy=spec.get("policy"))
    if error:
        log.error("%s at batch %d, cap %s: %s", spec["system"], spec["batch"], spec["cap_share"], error)
    else:
        log.info("%s batch %d cap %s: decode %.2f tok/s, %.1f MB read/token, group peak %s", spec["system"],
                 spec["batch"], spec["cap_share"], result["decode_tok_s"], result["read_bytes_per_token"] / 1e6,
                 f"{group['peak_bytes'] / GiB:.2f} GiB" if group else "uncapped")
    return result


def compare_tokens(rows: list[dict[str, Any]]) -> None:
    """`tokens_match` against the uncapped resident row at the same batch (in place); llama.cpp: None."""
    ref = {r["batch"]: r["tokens"] for r in rows if r["system"] == "resident" and "error" not in r}
    for r in rows:
        if "error" in r or r["system"] == "resident" or r["system"] in LLAMA_SYSTEMS or r["batch"] not in ref:
            r["tokens_match"] = None
            continue
        r["tokens_match"] = r["tokens"] == ref[r["batch"]]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per row: decode speed relative to each llama.cpp row's and accelerate's at the same cap and batch (in
    place); `vs_peer`: against the llama.cpp row it is read against (`PEER_OF`, else bf16)."""
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        for peer in (*LLAMA_SYSTEMS, "accelerate"):
            other = next((o for o in ok if o["system"] == peer and o["batch"] == r["batch"]
                          and o["cap_share"] == r["cap_share"]), None)
            r[f"vs_{peer}"] = r["decode_tok_s"] / other["decode_tok_s"] if other and other is not r else None
        r["vs_peer"] = None if r["system"] in LLAMA_SYSTEMS else r.get(f"vs_{PEER_OF.get(r['system'], 'llama_cpp')}")


def add_predictions(rows: list[dict[str, Any]], shape: ModelShape, profile: Any, args: argparse.Namespace) -> None:
    from bench_planner import planner_shape, row_prediction

    pshape = planner_shape(shape)
    for r in rows:
        r.update(row_prediction(pshape, profile, r, args.prompt_len, args.new_tokens))


LABELS = {"resident": "resident (no cap)", "ours_auto": "ours, cache auto", "ours_cap": "ours, cache sized to cap",
          "accelerate": "accelerate disk offload", "llama_cpp": "llama.cpp (mmap)",
          "ours_int8": "ours, int8 experts (approx.; vs Q8_0)", "llama_cpp_q8_0": "llama.cpp, Q8_0 experts (mmap)",
          "ours_int4": "ours, int4 experts (approx.; vs Q4_0)", "llama_cpp_q4_0": "llama.cpp, Q4_0 experts (mmap)"}


def _f(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "–" if x is None else format(x / scale, spec)


def _match(r: dict[str, Any]) -> str:
    if r["system"] == "resident":
        return "ref"
    return "not compared" if r.get("tokens_match") is None else ("yes" if r["tokens_match"] else "no")


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per row: cap, batch, system, decode tok/s and its ratios, disk MB per token, cache, memory peaks,
    the planner's prediction, token agreement, load average."""
    head = ("| cap (share of checkpoint) | batch | system | decode tok/s | vs llama.cpp | vs accelerate | "
            "disk MB/token | expert cache GiB | peak RSS GiB | cgroup peak GiB | OOM kills | planner tok/s | "
            "same tokens as resident | load 1 min |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cap = "none" if r["cap_bytes"] is None else f"{r['cap_bytes'] / GiB:.2f} GiB ({r['cap_share']:.0%})"
        group = r.get("cgroup") or {}
        if "error" in r:
            lines.append(f"| {cap} | {r['batch']} | {LABELS[r['system']]} | failed: {r['error']} | | | | | | "
                         f"{_f(group.get('peak_bytes'), '.2f', GiB)} | {group.get('oom_kills', '–')} | | | |")
            continue
        ours = r.get("ours") or {}
        lines.append("| " + " | ".join([
            cap, str(r["batch"]), LABELS[r["system"]], f"{r['decode_tok_s']:.2f}",
            _f(r.get("vs_peer", r.get("vs_llama_cpp")), ".2f"),
            _f(r.get("vs_accelerate"), ".2f"), f"{r['read_bytes_per_token'] / 1e6:.1f}",
            _f(ours.get("cache_capacity_bytes"), ".2f", GiB), f"{r['peak_rss_bytes'] / GiB:.2f}",
            _f(group.get("peak_bytes"), ".2f", GiB), str(group.get("oom_kills", "–")),
            _f(r.get("planner_tok_s"), ".2f"), _match(r),
            f"{r['loadavg_1m_before']:.1f}-{r['loadavg_1m_after']:.1f}"]) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], title: str, png: Path) -> None:
    """Decode tok/s and disk MB per token per (cap, batch), one bar per system; failed rows as an x."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["batch"], r["cap_share"] or 0.0) for r in rows if r["cap_bytes"]})
    systems = [s for s in ALL_SYSTEMS if any(r["system"] == s for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(systems))
    for k, (key, label, scale, log_y) in enumerate((("decode_tok_s", "decode tok/s", 1, False),
                                                   ("read_bytes_per_token", "disk MB read per token", 1e6, True))):
        ax, labelled = axes[k], set()
        for j, system in enumerate(systems):
            for i, (batch, share) in enumerate(groups):
                r = next((r for r in rows if r["system"] == system and r["batch"] == batch
                          and r["cap_share"] == share), None)
                x = i + (j - (len(systems) - 1) / 2) * width
                if r is None or "error" in r:
                    ax.plot([x], [0], "x", color=f"C{j}")
                    continue
                ax.bar(x, max(r[key] / scale, 1e-3), width, color=f"C{j}",
                       label=None if system in labelled else LABELS[system])
                labelled.add(system)
        ax.set_xticks(range(len(groups)), [f"batch {b}\ncap {s:.0%}" for b, s in groups])
        ax.set_ylabel(label)
        if log_y:
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------ main

QUICK = {"small": True, "new_tokens": 4, "warmup_tokens": 1, "allowance_mib": 400}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10, help="bench.py's CPU shape with this many layers (10: 1.95 GB)")
    p.add_argument("--small", action="store_true", help=f"bench.py's small shape ({bench.SMALL.tag})")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: the small shape, 4 new tokens, caps with 400 MiB for the Python process on top")
    p.add_argument("--caps", type=float, nargs="+", default=[0.5, 0.75], help="shares of the checkpoint's bytes")
    p.add_argument("--allowance-mib", type=int, default=None,
                   help="added to every cap (default 0: the cap is the share of the checkpoint alone)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=ALL_SYSTEMS,
                   help=f"default {' '.join(SYSTEMS)}; opt-in, approximate: {' '.join(QUANTIZED_SYSTEMS)}")
    p.add_argument("--policy-extra", type=json.loads, default={},
                   help='JSON merged into both ours policies, e.g. \'{"stream_window": 4}\' (for diagnosis)')
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=None, help="default 16")
    p.add_argument("--warmup-tokens", type=int, default=None, help="default 2")
    p.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None,
                   help="machine profile for the planner's predictions: a file (default: "
                        "benchmarks/results/profile_cpu_1thread.json) or 'measure'")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hf_moe_offload_bench"))
    p.add_argument("--out", type=Path, default=None, help="writes OUT.json, OUT.md and OUT.png")
    p.add_argument("--worker-timeout", type=float, default=1800)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    return fill_defaults(p.parse_args(argv))


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    defaults = {"new_tokens": 16, "warmup_tokens": 2, "allowance_mib": 0, **(QUICK if args.quick else {})}
    for name, value in defaults.items():
        if getattr(args, name, None) in (None, False):
            setattr(args, name, value)
    return args


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    return {"cpu": cpu, "cpus": os.cpu_count(), "avx512_bf16": "avx512_bf16" in cpuinfo}


def library_facts() -> dict[str, Any]:
    """The commit, and the library the workers import: the working tree's, or a snapshot of a commit put first on
    PYTHONPATH (`git archive <commit> hf_moe_offload`, so that edits in progress in the tree stay out of a run),
    whose commit `HF_MOE_OFFLOAD_SNAPSHOT` names."""
    import hf_moe_offload

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=bench.REPO_ROOT, check=False).stdout.strip()
    library = Path(hf_moe_offload.__file__).parent
    in_tree = library.resolve().is_relative_to(bench.REPO_ROOT.resolve())
    return {"commit": commit if in_tree else os.environ.get("HF_MOE_OFFLOAD_SNAPSHOT", "unknown"),
            "scripts_commit": commit, "library": str(library)}


def prepare(args: argparse.Namespace) -> tuple[ModelShape, Path, dict[str, str], dict[str, Any]]:
    """The checkpoint (built once), a GGUF per llama.cpp system, each quantized row's folder of experts (written
    here, uncapped: a user quantizes once, not at every start), and the store-like cold read rate."""
    from bench_cpu_kernels import write_gguf

    shape = bench.SMALL if args.small else ModelShape(layers=args.layers)
    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = bench.build_checkpoint(shape, args.seed, args.workdir)
    ggufs = {s: str(write_gguf(checkpoint, shape, experts)) for s, experts in LLAMA_SYSTEMS.items()
             if s in args.systems}
    for system in (s for s in QUANTIZE_OF if s in args.systems):
        spec = worker_spec(args, shape, checkpoint, ggufs, {"system": system, "batch": 1, "cap_share": None,
                                                            "cap_bytes": None})
        bench.POLICIES[system] = {**spec["policy"], "expert_cache": "10%"}   # a small cache: this only writes
        model, _ = bench.load_system(spec, checkpoint, Path(spec["offload_folder"]))
        del model
    reads = bench.store_read_bandwidth(bench.checkpoint_files(checkpoint), repeats=2)
    return shape, checkpoint, ggufs, reads


def run_memcap(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from bench_planner import DEFAULT_PROFILE, base_profile, with_disk_rate
    from tqdm.auto import tqdm

    started, load_before = time.perf_counter(), os.getloadavg()
    shape, checkpoint, ggufs, reads = prepare(args)
    profile, profile_source = base_profile(args.profile or str(DEFAULT_PROFILE), args.threads)
    profile = with_disk_rate(profile, reads["median_bytes_per_s"])
    rows = plan_rows(shape, args.caps, args.batch_sizes, args.systems, args.allowance_mib * 2**20)
    results = []
    for row in tqdm(rows, desc="memory-cap rows", unit="run"):
        results.append(spawn(worker_spec(args, shape, checkpoint, ggufs, row), args.worker_timeout))
    compare_tokens(results)
    add_ratios(results)
    add_predictions(results, shape, profile, args)
    return {"command": " ".join(["python", "scripts/bench_memcap.py", *argv]), **library_facts(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "shape": shape.__dict__,
            "checkpoint_bytes": shape.total_bytes(), "expert_bytes": shape.expert_bytes(),
            "non_expert_bytes": shape.non_expert_bytes(), "store_read_bandwidth": reads,
            "profile": profile_source,
            "settings": {k: getattr(args, k) for k in ("caps", "allowance_mib", "batch_sizes", "systems", "prompt_len",
                                                       "new_tokens", "warmup_tokens", "threads", "seed",
                                                       "policy_extra")},
            "rows": results, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "total_wall_s": time.perf_counter() - started}


def title(report: dict[str, Any]) -> str:
    s = report["settings"]
    return (f"{report['checkpoint_bytes'] / 1e9:.2f} GB random Mixtral under a cgroup memory cap, "
            f"{s['threads']} thread(s), {s['new_tokens']} new tokens, {report['machine']['cpu']}, "
            f"commit {report['commit']}, {report['date']}")


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    base = str(out)                                   # not with_suffix: "1.95gb" is no suffix
    Path(base + ".json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report["rows"])
    Path(base + ".md").write_text(table + "\n")
    if bench.plotting_available():
        plot(report["rows"], title(report), Path(base + ".png"))
    print(f"\n{title(report)}\n\n{table}\n")


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like an exception, so a capped worker's group is still removed (`memory_cap`'s finally)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    exit_on_sigterm()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.worker is not None:
        args.worker_out.write_text(json.dumps(run_worker(json.loads(args.worker.read_text()))))
        return 0
    report = run_memcap(args, argv)
    write_outputs(report, args.out or bench.REPO_ROOT / "benchmarks" / "results" / "cpu_memcap")
    return 0 if not any("error" in r for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
