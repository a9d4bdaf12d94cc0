"""A stored CPU suite's planner column predicted again with another machine profile, nothing measured: how well a
profile (or a change to the planner) predicts rows that were measured already.

    python scripts/replan_suite.py benchmarks/results/cpu_suite_fast.json \\
        --profile benchmarks/results/profile_cpu_1thread_fast.json --out /tmp/replanned

Each row's prediction is made as the suite makes it (`bench_suite`): the disk and memory-cap rows with the disk rate
measured in their own run, the in-RAM rows at the profile's thread count. Prints, per row, the measured decode tok/s
beside the stored prediction and the new one, with predicted / measured; `--out` writes them as JSON and markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import bench_memcap  # noqa: E402
import bench_suite  # noqa: E402
from bench_planner import base_profile, with_disk_rate  # noqa: E402


def replanned_rows(suite: dict[str, Any], profile: Any) -> list[dict[str, Any]]:
    """The suite's rows, each with its planner prediction made again with `profile`."""
    sections = suite["sections"]
    rows = []
    for name, report in sections["disk"]["reports"].items():
        rows += bench_suite.disk_rows(name, report, profile)
    memcap = sections["memcap"]["report"]
    measured = [dict(r) for r in memcap["rows"]]
    disk = with_disk_rate(profile, memcap["store_read_bandwidth"]["median_bytes_per_s"])
    settings = argparse.Namespace(**memcap["settings"])
    bench_memcap.add_predictions(measured, bench.ModelShape(**memcap["shape"]), disk, settings)
    rows += bench_suite.memcap_rows({**memcap, "rows": measured})
    kernels = sections["kernels"]
    rows += bench_suite.kernel_rows(kernels["settings"], bench.ModelShape(**kernels["spec"]["shape"]),
                                    kernels["spec"], profile)
    return rows


def compare(suite: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per modelled row: measured, stored and new predictions, and each prediction over the measurement."""
    stored = [r for s in suite["sections"].values() for r in s["rows"]]
    out = []
    for old, new in zip(stored, rows):
        if new.get("planner_tok_s") is None or not new.get("tok_s"):
            continue
        out.append({"section": new["section"], "setting": new["setting"], "system": new["system"],
                    "batch": new["batch"], "measured_tok_s": new["tok_s"], "stored_planner_tok_s": old["planner_tok_s"],
                    "planner_tok_s": new["planner_tok_s"],
                    "stored_ratio": old["planner_tok_s"] / new["tok_s"] if old.get("planner_tok_s") else None,
                    "ratio": new["planner_tok_s"] / new["tok_s"]})
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [f"`{result['command']}`: suite `{result['suite']}` ({result['suite_profile']}) predicted again with "
             f"`{result['profile']}`. Predicted / measured decode tok/s.", "",
             "| regime | setting | system | batch | measured | stored prediction (ratio) | new prediction (ratio) |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        stored = "–" if r["stored_ratio"] is None else f"{r['stored_planner_tok_s']:.2f} ({r['stored_ratio']:.2f})"
        lines.append(f"| {r['section']} | {r['setting']} | {r['system']} | {r['batch']} | {r['measured_tok_s']:.2f} | "
                     f"{stored} | {r['planner_tok_s']:.2f} ({r['ratio']:.2f}) |")
    return "\n".join(lines)


def main_args(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", type=Path, help="a suite JSON written by `python scripts/bench.py --suite cpu`")
    p.add_argument("--profile", required=True, help="a machine profile JSON (hf-moe-offload profile --out FILE)")
    p.add_argument("--out", type=Path, help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    suite = json.loads(args.suite.read_text())
    profile, source = base_profile(args.profile, 1)
    result = {"command": " ".join(["python", "scripts/replan_suite.py", *argv]), "suite": str(args.suite),
              "suite_profile": suite["profile"], "profile": source,
              "rows": compare(suite, replanned_rows(suite, profile))}
    text = markdown(result)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main_args(sys.argv[1:]))
