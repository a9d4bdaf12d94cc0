#!/usr/bin/env python
"""When does SiDA's hash prefetch pay?. Greedy decoding of held-out prompts on the demo model,
experts on disk, device CPU, at each expert-cache budget, per mode:

- ``lru``: LRU eviction, no prefetch; ``layer``: the default eviction, no prefetch; ``lookahead``:
  `prefetch="lookahead"` (router look-ahead, no predictor);
- ``hash_all``: hash prefetch of every predicted top-k expert (the filters off: `configure(min_confidence=0,
  min_precision=0)`), with the next-token guess; ``hash_before``: the same with the
  decode step through `nn.LSTM` and no next-token guess, as before (`predictor.one_token_cells = False`,
  `speculates = False`): what `prefetch="hash"` was;
- ``hash``: hash prefetch with the default filters (confidence, per-layer shut-off);
- ``hash@C``: the same with `min_confidence=C` (``--confidence``); ``hash_cap``: the same with the per-layer
  share (`share_cap=True`).

Reported per mode: the cache hit rate, demand misses and KB moved per generated token (counts: they depend on timing
only through which prefetches have landed when a slot is chosen), the cache's prefetch issued / hit / wasted
(evicted unused), the hash counters (issued, used / unused by the pass they were for, skipped for low confidence or a
layer shut off, layers off at the end), per-layer precision, predictor and wait ms per token (timings: repeated
``--repeat`` times, min-max reported), tok/s, and whether the tokens equal the unpatched model's.

Example (about 3 minutes on 2 shared cores):
    python scripts/train_hash.py --model hf_moe_offload/demo_model --dataset /tmp/hsD/pydoc_train_demo.jsonl \\
        --text-field text --out /tmp/hsD/pred_demo --epochs 6 --top-t 30 --threads 1 --no-progress
    HF_HUB_OFFLINE=1 python scripts/bench_hash.py --predictor /tmp/hsD/pred_demo --threads 1 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_moe_offload  # noqa: E402,F401  (adds the offload_policy keyword)
from bench_prefetch import DEMO_MODEL, REPO_ROOT, demo_prompts, generate_all, load_model, read_jsonl_texts  # noqa: E402
from hf_moe_offload.runtime.engine import get_engine  # noqa: E402

log = logging.getLogger("bench_hash")


def policy_for(mode: str, budget: str, predictor: str) -> dict:
    policy = {"device": "cpu", "store": "disk", "expert_cache": budget,
              "eviction": "lru" if mode == "lru" else "layer"}
    if mode.startswith("hash"):
        policy.update(prefetch="hash", predictor=predictor)
    elif mode == "lookahead":     # the next layers' routers on this layer's input, no training
        policy.update(prefetch="lookahead")
    return policy


def run(mode: str, budget: str, args, prompts: list[str], tokenizer, reference: list[list[int]]) -> dict:
    model = load_model(args.model, policy_for(mode, budget, args.predictor))
    engine = get_engine(model)
    if mode in ("hash_all", "hash_before"):
        engine.prefetcher.configure(min_confidence=0.0, min_precision=0.0, share_cap=False)
    if mode == "hash_before":     # and, as before this work, the LSTM step through nn.LSTM and no next-token guess
        engine.prefetcher.predictor.one_token_cells = False
        engine.prefetcher.speculates = False
    elif mode == "hash_cap":
        engine.prefetcher.configure(share_cap=True)
    elif mode.startswith("hash@"):
        engine.prefetcher.configure(min_confidence=float(mode[5:]))
    generate_all(model, tokenizer, prompts[:1], 1, 2)                      # warm-up
    timings = []
    for rep in range(args.repeat):
        if mode.startswith("hash"):   # each repeat starts with fresh precision tracking, as a new model would
            engine.prefetcher.configure(min_samples=engine.prefetcher.min_samples)
        engine.reset_stats()
        outputs, seconds, tokens = generate_all(model, tokenizer, prompts, args.batch_size, args.new_tokens)
        snap = engine.stats_snapshot()
        timings.append({"predictor_ms": 1e3 * snap.get("predictor_s", 0.0) / tokens,
                        "wait_ms": 1e3 * snap.get("predictor_wait_s", 0.0) / tokens,
                        "stall_ms": 1e3 * snap["stall_s"] / tokens, "tok_s": tokens / seconds,
                        "tables_ready": snap.get("hash_tables_ready", 0) / max(snap.get("hash_tables", 0), 1)})
    expert_bytes = engine.cache.slot_bytes
    hook = {k: v for k, v in snap.items() if k.startswith("hash_")}
    result = {
        "mode": mode, "budget": budget, "batch_size": args.batch_size, "slots": engine.cache.num_slots,
        "tokens": tokens, "hit_rate": snap["hit_rate"], "misses_per_token": snap["misses"] / tokens,
        "kb_per_token": snap["bytes_to_device"] / tokens / 1e3,
        "experts_moved_per_token": snap["bytes_to_device"] / expert_bytes / tokens,
        "prefetch_issued": snap["prefetch_issued"], "prefetch_hits": snap["prefetch_hits"],
        "prefetch_wasted": snap["prefetch_wasted"], **hook,
        "precision": {str(k): v for k, v in engine.prefetcher.precision().items()} if engine.prefetcher else None,
        "timings": timings, "same_tokens": outputs == reference,
    }
    hf_moe_offload.disable(model)
    log.info("%-9s %s hit %.3f  KB/tok %.0f  misses/tok %.2f  pf %d/%d/%d  %s", mode, budget, result["hit_rate"],
             result["kb_per_token"], result["misses_per_token"], result["prefetch_issued"], result["prefetch_hits"],
             result["prefetch_wasted"], timings[-1])
    return result


def span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if len(values) == 1 or abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}"


def table(results: list[dict]) -> str:
    head = ("| budget (slots) | mode | cache hit rate | demand misses/token | KB moved/token | prefetch issued / hit "
            "/ wasted (cache) | hash used / unused | skipped: low confidence / layer off | layers off | predictor "
            "ms/token | waited ms/token | tables ready in time | tok/s | same tokens |\n|" + "---|" * 14)
    rows = [head]
    for r in results:
        t = r["timings"]
        hashed = r["mode"].startswith("hash")
        rows.append(
            f"| {r['budget']} ({r['slots']}) | {r['mode']} | {r['hit_rate']:.3f} | {r['misses_per_token']:.2f} | "
            f"{r['kb_per_token']:.0f} | {r['prefetch_issued']} / {r['prefetch_hits']} / {r['prefetch_wasted']} | "
            + (f"{r['hash_prefetch_used']} / {r['hash_prefetch_unused']} | {r['hash_skipped_low_confidence']} / "
               f"{r['hash_skipped_layer_off']} | {r['hash_layers_off']} | "
               f"{span([x['predictor_ms'] for x in t])} | {span([x['wait_ms'] for x in t])} | "
               f"{span([x['tables_ready'] for x in t])} | " if hashed else "— | — | — | — | — | — | ")
            + f"{span([x['tok_s'] for x in t])} | {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEMO_MODEL), help="decoder-only MoE with heldout.jsonl beside it")
    p.add_argument("--predictor", required=True, help="its hash predictor (scripts/train_hash.py --out)")
    p.add_argument("--budgets", nargs="+", default=["25%", "50%"])
    p.add_argument("--modes", nargs="+", default=["lru", "layer", "hash_all", "hash"])
    p.add_argument("--confidence", nargs="*", type=float, default=[], help="extra hash@C modes")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1, help="generation repeats per mode (timing ranges)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "hash_demo.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    texts = read_jsonl_texts(Path(args.model) / "heldout.jsonl")
    prompts = demo_prompts(tokenizer, texts, args.prompts, args.prompt_tokens)
    reference, _, _ = generate_all(load_model(args.model, None), tokenizer, prompts, args.batch_size, args.new_tokens)
    modes = list(args.modes) + [f"hash@{c:g}" for c in args.confidence]
    started = time.time()
    results = [run(mode, budget, args, prompts, tokenizer, reference) for budget in args.budgets for mode in modes]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "torch": torch.__version__,
                                    "seconds": time.time() - started, "results": results}, indent=1) + "\n")
    print(table(results))
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
