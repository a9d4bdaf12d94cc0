"""The expert cache's own host time per MoE layer fetch, with many slots (fine-grained MoEs: Qwen3-30B-A3B has 48
layers x 128 experts, top-8; a 25% cache holds 1536 of them). Slabs are tiny and in host memory, so what is measured
is the cache's bookkeeping (pins, victim choice, reaping), not copies. Routing is uniform random, decode-like:
one token per step, top-k experts per layer.

Example:
    python scripts/bench_cache_overhead.py --layers 48 --experts 128 --top-k 8 --share 0.25 --steps 20
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from hf_moe_offload.memory.cache import ExpertCache
from hf_moe_offload.layout import SlabLayout
from hf_moe_offload.stats import OffloadStats
from hf_moe_offload.storage.store import CpuStore


def measure(layers: int, experts: int, top_k: int, share: float, steps: int, eviction: str, seed: int = 0) -> dict:
    layouts = [SlabLayout((("w", (16,)),))] * layers
    store = CpuStore.allocate(layouts, [experts] * layers, torch.float32)
    slots = int(share * layers * experts)
    stats = OffloadStats(num_layers=layers)
    cache = ExpertCache(store, torch.device("cpu"), slots * store.slab_bytes(0), eviction, stats, zero_copy=False)
    rng = random.Random(seed)
    routing = [[sorted(rng.sample(range(experts), top_k)) for _ in range(layers)] for _ in range(steps)]
    start = time.perf_counter()
    for step in routing:
        for layer, chosen in enumerate(step):
            for _expert, _slab in cache.fetch(layer, chosen):
                pass
    seconds = time.perf_counter() - start
    snap = stats.snapshot()
    cache.close()
    return {"eviction": eviction, "slots": slots, "fetches": steps * layers,
            "us_per_fetch": 1e6 * seconds / (steps * layers), "misses": snap["misses"], "hits": snap["hits"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--share", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--evictions", nargs="+", default=["layer", "lru", "lfu"])
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = [measure(args.layers, args.experts, args.top_k, args.share, args.steps, e) for e in args.evictions]
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
