#!/usr/bin/env python
"""Counts, not timings: hit rate and bytes per token at 25% and 50% expert cache, batch 1,
for eviction LRU / layer / look-ahead, Belady's optimum, router look-ahead prefetch none / auto / on, the hash
prefetcher and an oracle prefetcher.

Two models: the trained demo Mixtral on its held-out text (`hf_moe_offload/demo_model/heldout.jsonl`), and a random
Mixtral of the benchmark's shape family (8 layers x 8 experts, top-2; small matrices: routing counts do not depend
on them) built by `scripts/bench.py`'s `build_checkpoint`.

Every engine run: device="cpu", store="disk", schedule="on_demand", greedy decoding of each prompt alone (batch 1) from a cold cache,
the unpatched model's tokens checked. Per-token numbers divide by generated tokens (the prompt's pass included).
Belady and the simulated LRU / layer / look-ahead replay the routing recorded in the `layer` run
(`hf_moe_offload.analysis.belady`) with as many slots as the engine's cache, no prefetch. Stall per token needs
timing: run this on a quiet machine and read `stall_ms_per_token` in the JSON (the lead does).

Example (about 10 minutes on 2 shared cores):
    HF_HUB_OFFLINE=1 python scripts/eviction_study.py --threads 1 --predictor /tmp/hs/pred_demo
    python scripts/eviction_study.py --from-json          # re-render the tables
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import hf_moe_offload  # noqa: E402
from bench_prefetch import (FetchRecorder, OraclePrefetcher, demo_prompts, generate_all,  # noqa: E402
                            read_jsonl_texts)
from hf_moe_offload.analysis import RoutingRecorder, simulate  # noqa: E402

log = logging.getLogger("eviction_study")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO_ROOT / "hf_moe_offload" / "demo_model"

# mode -> (eviction, prefetch); "oracle" prefetches the recorded routing (bench_prefetch.OraclePrefetcher)
MODES: dict[str, tuple[str, str]] = {
    "lru": ("lru", "none"),
    "layer": ("layer", "none"),
    "lookahead_evict": ("lookahead", "none"),
    "layer+auto": ("layer", "auto"),
    "layer+lookahead": ("layer", "lookahead"),
    "lookahead_evict+auto": ("lookahead", "auto"),
    "lookahead_evict+lookahead": ("lookahead", "lookahead"),
    "hash": ("layer", "hash"),
    "oracle": ("layer", "none"),
}
SIMULATED = ("lru", "layer", "lookahead", "belady")


def load(path: Path, policy: dict | None):
    """The model at `path` in its checkpoint's dtype (the random checkpoint is bf16), offloaded by `policy`."""
    kwargs = {} if policy is None else {"offload_policy": policy}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if "bench" in str(path) else "auto", **kwargs).eval()


def run(path: Path, tokenizer, prompts: list, mode: str, budget: str, predictor: str | None, new_tokens: int,
        reference: list[list[int]], schedule: dict | None) -> tuple[dict, RoutingRecorder | None, dict | None]:
    eviction, prefetch = MODES[mode]
    # on demand also for the prompt's pass: every policy then decides the prompt's misses too (a streamed prefill
    # evicts in forward order whatever the policy), and the simulator replays the same rules
    policy = {"device": "cpu", "store": "disk", "expert_cache": budget, "eviction": eviction, "prefetch": prefetch,
              "schedule": "on_demand"}
    if prefetch == "hash":
        policy["predictor"] = predictor
    model = load(path, policy)
    engine = hf_moe_offload.get_engine(model)
    recorder = fetches = None
    if mode == "layer":
        recorder = RoutingRecorder(predictions=True).bind(engine)
        fetches = FetchRecorder()
        engine.add_hook(recorder)
        engine.add_hook(fetches)
    if mode == "oracle":
        engine.add_hook(OraclePrefetcher(engine, schedule, [layer.index for layer in engine.layers]))
    outputs, seconds, tokens = generate_all(model, tokenizer, prompts, 1, new_tokens)
    snap = engine.stats_snapshot()
    expert_bytes = engine.cache.slot_bytes
    row = {"mode": mode, "budget": budget, "policy": policy, "slots": engine.cache.num_slots,
           "expert_bytes": expert_bytes, "tokens": tokens, "hit_rate": snap["hit_rate"],
           "misses_per_token": snap["misses"] / tokens, "bytes_per_token": snap["bytes_to_device"] / tokens,
           "prefetch_issued": snap["prefetch_issued"], "readahead_issued": snap["readahead_issued"],
           "prefetch_hits": snap["prefetch_hits"], "prefetch_wasted": snap["prefetch_wasted"],
           "lookahead_guesses": snap["lookahead_guesses"], "lookahead_used": snap["lookahead_used"],
           "lookahead_on": snap["lookahead_on"], "lookahead_precision": snap["lookahead_precision"],
           "lookahead_break_even": snap["lookahead_break_even"], "passes": snap["passes"],
           "stall_ms_per_token": 1e3 * snap["stall_s"] / tokens, "tokens_per_s": tokens / seconds,
           "same_tokens": outputs == reference}
    hf_moe_offload.disable(model)
    log.info("%-26s %s hit %.3f  KB/tok %.1f  pf issued/hit/wasted %d/%d/%d  look-ahead on=%s p=%s  exact=%s",
             mode, budget, row["hit_rate"], row["bytes_per_token"] / 1e3, row["prefetch_issued"],
             row["prefetch_hits"], row["prefetch_wasted"], row["lookahead_on"],
             None if row["lookahead_precision"] is None else round(row["lookahead_precision"], 3),
             row["same_tokens"])
    return row, recorder, (dict(fetches.schedule) if fetches else None)


def study(name: str, path: Path, tokenizer, prompts: list, budgets: list[str], modes: list[str],
          predictor: str | None, new_tokens: int) -> dict:
    plain = load(path, None)
    reference, _, _ = generate_all(plain, tokenizer, prompts, 1, new_tokens)
    del plain
    rows, simulated = [], []
    for budget in budgets:
        trace, schedule = None, None
        for mode in ["layer"] + [m for m in modes if m != "layer"]:      # "layer" records the trace first
            if mode == "hash" and not predictor:
                continue
            row, recorder, fetched = run(path, tokenizer, prompts, mode, budget, predictor, new_tokens, reference,
                                         schedule)
            rows.append(row)
            if recorder is not None:
                trace, schedule = recorder.trace, fetched
                layers = 1 + max(layer for _, layer, _ in trace)
                for policy in SIMULATED:
                    sim = simulate(trace, row["slots"], policy, num_layers=layers)
                    simulated.append({"budget": budget, "policy": policy, "slots": row["slots"],
                                      "hit_rate": sim.hit_rate, "misses": sim.misses,
                                      "bytes_per_token": sim.misses * row["expert_bytes"] / row["tokens"]})
                    log.info("simulated %-9s %s hit %.3f  KB/tok %.1f", policy, budget, sim.hit_rate,
                             simulated[-1]["bytes_per_token"] / 1e3)
    return {"name": name, "model": str(path), "budgets": budgets, "new_tokens": new_tokens,
            "prompts": len(prompts), "runs": rows, "simulated": simulated}


def random_model(workdir: Path, seed: int) -> Path:
    import bench

    shape = bench.ModelShape(hidden=256, intermediate=768, layers=8, experts=8, top_k=2, heads=8, kv_heads=4,
                             vocab=4096)
    return bench.build_checkpoint(shape, seed, workdir)


def table(result: dict) -> str:
    lines = [f"#### {result['name']} ({result['prompts']} prompts x {result['new_tokens']} new tokens, batch 1)", "",
             "| cache (slots) | policy | hit rate | KB moved / token | prefetch issued / used / wasted | "
             "look-ahead precision (on at end) | same tokens |", "|---|---|---|---|---|---|---|"]
    for budget in result["budgets"]:
        for r in [r for r in result["runs"] if r["budget"] == budget]:
            p = r["lookahead_precision"]
            la = "—" if p is None and not r["lookahead_on"] else \
                f"{'—' if p is None else f'{p:.2f}'} ({'on' if r['lookahead_on'] else 'off'})"
            lines.append(f"| {budget} ({r['slots']}) | {r['mode']} | {r['hit_rate']:.3f} | "
                         f"{r['bytes_per_token'] / 1e3:.1f} | {r['prefetch_issued']} / {r['prefetch_hits']} / "
                         f"{r['prefetch_wasted']} | {la} | {'yes' if r['same_tokens'] else 'NO'} |")
        for s in [s for s in result["simulated"] if s["budget"] == budget]:
            lines.append(f"| {budget} ({s['slots']}) | simulated {s['policy']} | {s['hit_rate']:.3f} | "
                         f"{s['bytes_per_token'] / 1e3:.1f} | — | — | — |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--predictor", default="/tmp/hs/pred_demo", help="the demo model's hash predictor ('' to skip)")
    p.add_argument("--budgets", nargs="+", default=["25%", "50%"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--random-prompts", type=int, default=4)
    p.add_argument("--only", choices=["all", "demo", "random"], default="all")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hf_moe_offload_bench"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "eviction_study.json")
    p.add_argument("--from-json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("hf_moe_offload").setLevel(logging.WARNING)
    args = parse_args(argv)
    saved = json.loads(args.out.read_text()) if args.out.is_file() else {"results": {}}
    if args.from_json:
        print("\n\n".join(table(r) for r in saved["results"].values()))
        return 0
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = dict(saved["results"])     # a run of one model keeps the other's saved result
    if args.only in ("all", "demo"):
        tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
        prompts = demo_prompts(tokenizer, read_jsonl_texts(DEMO_MODEL / "heldout.jsonl"), args.prompts,
                               args.prompt_tokens)
        results["demo"] = study("demo model (trained, 4 layers x 8 experts, top-2), held-out text", DEMO_MODEL,
                                tokenizer, prompts, args.budgets, args.modes, args.predictor or None,
                                args.new_tokens)
    if args.only in ("all", "random"):
        path = random_model(args.workdir, seed=0)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 4096, (args.prompt_tokens,), generator=gen) for _ in range(args.random_prompts)]
        results["random"] = study("random Mixtral (8 layers x 8 experts, top-2, bench shape family)", path, None,
                                  prompts, args.budgets, [m for m in args.modes if m != "hash"], None,
                                  args.new_tokens)
    command = shlex.join(["python", "scripts/eviction_study.py", *(sys.argv[1:] if argv is None else argv)])
    meta = {"command": command, "machine": {"cpu_count": os.cpu_count(), "threads": args.threads,
                                            "platform": platform.platform()},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    for key in ("demo", "random"):
        if key in results and (args.only in ("all", key)):
            results[key].update(meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results}, indent=1, default=str) + "\n")
    print("\n\n".join(table(r) for r in results.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
