"""Every CPU regime in one sitting: `python scripts/bench.py --suite cpu [--quick] [--out PATH]`.

1. The disk regime (bench.py, page cache dropped every step): batch 1 exact (resident, accelerate, ours with
   eviction "lru" and "layer") and the throughput batches 32 and 128 (resident, accelerate, ours "layer"), each
   row with its bound and peers.
2. Larger than RAM under a cgroup memory cap (bench_memcap.py): caps of 50% and 75% of the checkpoint, batch 1 and
   8, ours ("auto" and a cache sized to the cap), accelerate and llama.cpp.
3. Every weight in RAM (bench_cpu_kernels.py): resident, ours (store "cpu", the CPU kernels, and with them off) and
   llama.cpp, against the memory-bandwidth bound.

Beside every measured row: the planner's predicted decode tok/s (`hf_moe_offload.planning.planner.predict`, with
the machine profile of `--profile`, or this machine's measured at the start and written to OUT.profile.json, and
the disk rate measured in the same run), where the planner models the system. Writes OUT.json (every
measurement), OUT.md (one table per regime) and OUT.png; `--quick` runs the small model with few tokens, a smoke
test of the whole suite.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench

log = logging.getLogger("bench_suite")

DEFAULT_OUT = bench.REPO_ROOT / "benchmarks" / "results" / "cpu_suite"
# bench.py's two disk-regime commands, as docs/benchmarks.md runs them ("Batch-1 latency", "Static batches").
DISK_RUNS = {"batch 1 exact": ["--threads", "1", "--idle-wait", "30", "--batch-sizes", "1", "--systems", "resident",
                               "accelerate", "hf_moe_offload", "hf_moe_offload_layer"],
             "batch 32 and 128": ["--throughput", "--threads", "1", "--idle-wait", "30", "--batch-sizes", "32", "128",
                                  "--cb-prompts", "0"]}
QUICK_DISK = ["--small", "--new-tokens", "4", "--warmup-tokens", "1", "--idle-wait", "0"]
SECTION_TITLES = {"disk": "Disk regime (page cache dropped every step)",
                  "memcap": "Larger than RAM (cgroup memory cap, page cache counted)",
                  "kernels": "Every weight in RAM (CPU kernels)"}


def row(section: str, setting: str, system: str, batch: int, tok_s: float | None, **extra: Any) -> dict[str, Any]:
    """One line of the suite's tables, the same columns for every regime (None where a column does not apply)."""
    keys = ("bound_tok_s", "planner_tok_s", "peer", "vs_peer", "read_mb_per_token", "peak_gib", "same_tokens",
            "load_1m", "error")
    return {"section": section, "setting": setting, "system": system, "batch": batch, "tok_s": tok_s,
            **{k: extra.get(k) for k in keys}}


# ------------------------------------------------------------------------------------------------------ disk regime

def run_disk(quick: bool, workdir: Path, profile: Any) -> dict[str, Any]:
    """Both bench.py disk runs; their reports and the suite's rows with the planner's predictions."""
    reports, rows = {}, []
    for name, argv in DISK_RUNS.items():
        argv = argv + (QUICK_DISK if quick else []) + ["--workdir", str(workdir)]
        log.info("disk regime, %s: bench.py %s", name, shlex.join(argv))
        report = bench.run_benchmark(bench.parse_args(argv), argv)
        reports[name] = report
        rows += disk_rows(name, report, profile)
    return {"reports": reports, "rows": rows}


def disk_rows(name: str, report: dict[str, Any], profile: Any) -> list[dict[str, Any]]:
    from bench_planner import planner_shape, row_prediction, with_disk_rate

    settings = report["settings"]
    pshape = planner_shape(bench.ModelShape(**report["model"]["shape"]))
    disk = (report.get("store_read_bandwidth") or report["disk_bandwidth"])["median_bytes_per_s"]
    prof = with_disk_rate(profile, disk)
    out = []
    for r in sorted(report["results"], key=bench.row_order):
        label = {"hf_moe_offload": "ours, lru", "hf_moe_offload_layer": "ours, layer"}.get(r["system"], r["system"])
        if "error" in r:
            out.append(row("disk", name, label, r["batch"], None, error=r["error"]))
            continue
        pred = row_prediction(pshape, prof, r, settings["prompt_len"], settings["new_tokens"])
        match = "ref" if r.get("tokens_match") is None else ("yes" if r["tokens_match"] else "no")
        out.append(row("disk", name, label, r["batch"], r["decode_tok_s"],
                       bound_tok_s=(r.get("bound") or {}).get("decode_tok_s"), planner_tok_s=pred["planner_tok_s"],
                       peer="accelerate", vs_peer=r.get("vs_accelerate"),
                       read_mb_per_token=r["read_bytes_per_token"] / 1e6, peak_gib=r["peak_rss_bytes"] / bench.GiB,
                       same_tokens=match, load_1m=r.get("loadavg_1m_after")))
    return out


# ------------------------------------------------------------------------------------------------------ memory cap

def run_memcap(quick: bool, workdir: Path, profile_spec: str | None) -> dict[str, Any]:
    import bench_memcap

    argv = ["--workdir", str(workdir)] + (["--quick"] if quick else []) + (
        ["--profile", profile_spec] if profile_spec else [])
    log.info("memory cap: bench_memcap.py %s", shlex.join(argv))
    report = bench_memcap.run_memcap(bench_memcap.parse_args(argv), argv)
    return {"report": report, "rows": memcap_rows(report)}


def memcap_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    import bench_memcap

    out = []
    for r in report["rows"]:
        setting = "no cap" if r["cap_bytes"] is None else f"cap {r['cap_share']:.0%} ({r['cap_bytes'] / 2**30:.2f} GiB)"
        label = bench_memcap.LABELS[r["system"]]
        group = r.get("cgroup") or {}
        if "error" in r:
            out.append(row("memcap", setting, label, r["batch"], None, error=r["error"]))
            continue
        out.append(row("memcap", setting, label, r["batch"], r["decode_tok_s"], planner_tok_s=r.get("planner_tok_s"),
                       peer="llama.cpp", vs_peer=r.get("vs_llama_cpp"), read_mb_per_token=r["read_bytes_per_token"] / 1e6,
                       peak_gib=(group.get("peak_bytes") or r["peak_rss_bytes"]) / bench.GiB,
                       same_tokens=bench_memcap._match(r), load_1m=r.get("loadavg_1m_after")))
    return out


# --------------------------------------------------------------------------------------------------------- kernels

def run_kernels(quick: bool, workdir: Path, profile: Any) -> dict[str, Any]:
    """bench_cpu_kernels.py's settings (1 and 2 threads, default wait policy, no busy process; --quick: the small
    model, 1 thread, 1 round, 4 new tokens), with the planner's prediction at the profile's thread count."""
    import bench_cpu_kernels as kernels

    shape = bench.SMALL if quick else bench.ModelShape(layers=10)
    checkpoint = bench.build_checkpoint(shape, 0, workdir)
    gguf = str(kernels.write_gguf(checkpoint, shape)) if _has_llama_cpp() else None
    spec = {"checkpoint": str(checkpoint), "shape": shape.__dict__, "gguf": gguf, "seed": 0, "batch_sizes": [1, 8],
            "prompt_len": 16, "new_tokens": 4 if quick else 24, "repeats": 1 if quick else 3}
    args = argparse.Namespace(workdir=workdir)
    settings = []
    for threads in ([1] if quick else [1, 2]):
        log.info("CPU kernels, %d thread(s): bench_cpu_kernels.py", threads)
        settings.append(kernels.run_setting(args, spec, {"threads": threads, "wait_policy": "default",
                                                         "compete": 0}))
    return {"spec": spec, "settings": settings, "rows": kernel_rows(settings, shape, spec, profile)}


def _has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        log.warning("llama-cpp-python is not installed: no llama.cpp rows")
        return False
    return True


def kernel_rows(settings: list[dict[str, Any]], shape: bench.ModelShape, spec: dict[str, Any], profile: Any
                ) -> list[dict[str, Any]]:
    from bench_planner import planner_shape, predict_decode, unpatched

    pshape = planner_shape(shape)
    labels = {"ours_f_linear": "ours, F.linear", "llama_cpp": "llama.cpp"}
    out = []
    for s in settings:
        t = s["threads"]
        llama = {r["batch"]: r["tok_s"] for r in s["rows"] if r["system"] == "llama_cpp"}
        for r in sorted(s["rows"], key=lambda r: (r["batch"], r["system"] != "resident")):
            modelled = r["system"] != "llama_cpp" and profile.cpu_threads == t
            kernels = profile if r["system"] == "ours" else unpatched(profile)   # resident, ours F.linear
            pred = predict_decode(pshape, kernels, "cpu", 1.0, r["batch"], spec["prompt_len"], spec["new_tokens"]) \
                if modelled else None
            match = "ref" if r["system"] == "resident" else (
                "not compared" if r["system"] == "llama_cpp" else ("yes" if r["same_tokens_as_resident"] else "no"))
            peer = llama.get(r["batch"])
            out.append(row("kernels", f"{t} thread{'s' * (t > 1)}", labels.get(r["system"], r["system"]),
                           r["batch"], r["tok_s"], bound_tok_s=r.get(f"bound_tok_s_stream_{t}t"), planner_tok_s=pred,
                           peer="llama.cpp", vs_peer=r["tok_s"] / peer if peer and r["system"] != "llama_cpp" else None,
                           read_mb_per_token=0.0, same_tokens=match, load_1m=s["load_end"][0]))
    return out


# ---------------------------------------------------------------------------------------------------------- output

def _f(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def section_table(rows: list[dict[str, Any]]) -> str:
    head = ("| setting | batch | system | decode tok/s | bound tok/s | planner tok/s | vs peer | disk MB/token | "
            "peak GiB | same tokens as reference | load 1 min |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['setting']} | {r['batch']} | {r['system']} | failed: {r['error']} "
                         "| | | | | | | |")
            continue
        vs = f"{r['vs_peer']:.2f}x {r['peer']}" if r["vs_peer"] is not None else "–"
        lines.append("| " + " | ".join([
            r["setting"], str(r["batch"]), r["system"], _f(r["tok_s"], ".2f"), _f(r["bound_tok_s"], ".2f"),
            _f(r["planner_tok_s"], ".2f"), vs, _f(r["read_mb_per_token"], ".1f"), _f(r["peak_gib"], ".2f"),
            r["same_tokens"] or "–", _f(r["load_1m"], ".1f")]) + " |")
    return "\n".join(lines)


def suite_markdown(report: dict[str, Any]) -> str:
    """One table per regime that ran, under a header line naming the command, commit, date, CPU and load."""
    m = report["machine"]
    scripts = report.get("scripts_commit")
    commit = f"library at commit `{report['commit']}`" + (f", scripts at `{scripts}`" if scripts and scripts !=
                                                            report["commit"] else "")
    header = (f"`{report['command']}` — {commit}, {report['date']}, {m['cpu']} ({m['cpus']} "
              f"CPUs, avx512_bf16 {'yes' if m['avx512_bf16'] else 'no'}), 1-minute load average "
              f"{report['loadavg_before'][0]:.1f} → {report['loadavg_after'][0]:.1f}. Planner profile: "
              f"{report['profile']}.")
    parts = [header]
    for key, title in SECTION_TITLES.items():
        section = report["sections"].get(key)
        if section:
            parts.append(f"**{title}**\n\n{section_table(section['rows'])}")
    return "\n\n".join(parts) + "\n"


def plot(report: dict[str, Any], png: Path) -> None:
    """One panel per regime: decode tok/s per setting and batch, a bar per system, the planner's prediction as a
    black tick and the bound as a dashed one where they exist; failed rows as an x."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = [(k, t) for k, t in SECTION_TITLES.items() if report["sections"].get(k)]
    fig, axes = plt.subplots(1, max(1, len(sections)), figsize=(6.5 * max(1, len(sections)), 4.8), squeeze=False)
    for ax, (key, title) in zip(axes[0], sections):
        rows = report["sections"][key]["rows"]
        groups = list(dict.fromkeys((r["setting"], r["batch"]) for r in rows))
        systems = list(dict.fromkeys(r["system"] for r in rows))
        width, labelled = 0.8 / len(systems), set()
        for j, system in enumerate(systems):
            for i, group in enumerate(groups):
                r = next((r for r in rows if r["system"] == system and (r["setting"], r["batch"]) == group), None)
                if r is None:
                    continue
                x = i + (j - (len(systems) - 1) / 2) * width
                if r["tok_s"] is None:
                    ax.plot([x], [0.1], "x", color=f"C{j}")
                    continue
                ax.bar(x, r["tok_s"], width, color=f"C{j}", label=None if system in labelled else system)
                labelled.add(system)
                for value, style in ((r["planner_tok_s"], "k_"), (r["bound_tok_s"], "k1")):
                    if value:
                        ax.plot([x], [value], style, markersize=10)
        ax.set_xticks(range(len(groups)), [f"{s.split(' (')[0]}\nbatch {b}" for s, b in groups], fontsize=7,
                      rotation=20)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    axes[0][0].set_ylabel("decode tok/s (bar), planner (—), bound (Y)")
    fig.suptitle(f"commit {report['commit']}, {report['date']}, {report['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write_suite(report: dict[str, Any], out: Path, png: bool = True) -> list[Path]:
    """OUT.json (every measurement), OUT.md (the tables), OUT.png (needs matplotlib); returns what was written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    base = str(out)                                   # not with_suffix: a name like "1.95gb" has no suffix
    written = [Path(base + ".json"), Path(base + ".md")]
    written[0].write_text(json.dumps(report, indent=1, default=str) + "\n")
    written[1].write_text(suite_markdown(report))
    if png and bench.plotting_available():
        plot(report, Path(base + ".png"))
        written.append(Path(base + ".png"))
    return written


# ------------------------------------------------------------------------------------------------------------ main

def suite_profile(profile_spec: str | None, out: Path) -> tuple[Any, str, str]:
    """(profile, where it came from, a file holding it for bench_memcap's workers): `profile_spec`'s file, or this
    machine measured now at one thread and written to OUT.profile.json."""
    from bench_planner import base_profile

    if profile_spec:
        profile, source = base_profile(profile_spec, 1)
        return profile, source, profile_spec
    profile, source = base_profile("measure", 1)
    path = out.with_name(out.name + ".profile.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return profile, f"this machine, measured at the start of the run ({path})", str(path)


def run_suite(quick: bool, workdir: Path, profile_spec: str | None, argv: list[str], out: Path) -> dict[str, Any]:
    from bench_memcap import library_facts, machine

    started, load_before = time.perf_counter(), os.getloadavg()
    profile, source, profile_spec = suite_profile(profile_spec, out)
    sections: dict[str, Any] = {}
    for key, run in (("disk", lambda: run_disk(quick, workdir, profile)),
                     ("memcap", lambda: run_memcap(quick, workdir, profile_spec)),
                     ("kernels", lambda: run_kernels(quick, workdir, profile))):
        try:
            sections[key] = run()
        except Exception as err:          # one regime failing leaves the others' tables (its error is reported)
            log.exception("%s regime failed", key)
            sections[key] = {"error": repr(err), "rows": [row(key, "–", "–", 0, None, error=repr(err))]}
    return {"command": shlex.join(["python", "scripts/bench.py", *argv]), **library_facts(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "profile": source,
            "quick": quick, "sections": sections, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "total_wall_s": time.perf_counter() - started}


def main(args: argparse.Namespace, argv: list[str]) -> int:
    """bench.py's `--suite cpu` (its --quick, --workdir, --out and --seed apply; other flags are ignored)."""
    from bench_memcap import exit_on_sigterm

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_on_sigterm()
    out = args.out or DEFAULT_OUT.with_name(DEFAULT_OUT.name + ("_quick" if args.quick else ""))
    report = run_suite(args.quick, args.workdir, getattr(args, "profile", None), argv, out)
    written = write_suite(report, out)
    print(suite_markdown(report))
    print(f"wrote {', '.join(map(str, written))} ({report['total_wall_s']:.0f} s)")
    failed = [r for s in report["sections"].values() for r in s["rows"] if r["error"]]
    return 0 if not failed else 1
