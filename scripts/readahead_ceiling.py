#!/usr/bin/env python
"""How far reading ahead can take batch-1 decode from disk: the engine's read-ahead fed perfect guesses.

Batch 1, experts on disk, page cache dropped before every decode step (as `bench.py`), one torch thread. Each mode
loads the model afresh and greedily generates the same prompt; the decode steps are timed without the page-cache
drop. Modes:

- `demand`: no read-ahead (`prefetch="none"`): every miss is read when the router asks for it;
- `auto`: the default (`prefetch="auto"`: reads the look-ahead's guesses only while they pay);
- `lookahead`: always reads the next layer's look-ahead guesses (layer l+1's router on layer l's input) into the
  staging room while layer l computes (`prefetch="lookahead"`);
- `oracle`: the same read-ahead path, fed the next layer's real choice (recorded in the `demand` run: the routing
  is the same in every exact run). Its speed is the most any guess source can get out of the read-ahead.

Beside them, the bound: the resident model's step (every weight in RAM, same thread count) and the overlap bound
1 / max(resident step, the `demand` row's bytes per token at the store-like cold read rate measured in the run).

Example (bench.py's 1.59 GB checkpoint, built by `scripts/bench.py`):
    HF_HUB_OFFLINE=1 python scripts/readahead_ceiling.py \\
        --model /tmp/hf_moe_offload_bench/mixtral_h1024_i3584_l8_e8_k2_a16x8_v32000_seed0 --rounds 2 \\
        --out benchmarks/results/cpu_readahead_ceiling.json
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import platform
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench import evict_from_page_cache, store_read_bandwidth   # this folder's benchmark: the same reads
from read_timeline import busy_within, record_reads             # and its timeline's read clock

log = logging.getLogger("readahead_ceiling")
MODES = ("demand", "auto", "lookahead", "oracle")
PREFETCH = {"demand": "none", "auto": "auto", "lookahead": "lookahead", "oracle": "lookahead"}


class OracleGuesses:
    """Stands in for the look-ahead's `likely_experts`: the next route of that layer in a recorded run."""

    def __init__(self, routes: list[tuple[int, tuple[int, ...]]]):
        self.schedule: dict[int, list[tuple[int, ...]]] = defaultdict(list)
        for layer, experts in routes:
            self.schedule[layer].append(experts)
        self.calls: Counter[int] = Counter()     # routes of each layer seen so far in this run

    def on_route(self, layer: int, experts) -> None:
        self.calls[layer] += 1

    def likely_experts(self, layer: int, hidden_states) -> list[int]:
        upcoming = self.schedule[layer]
        index = self.calls[layer]
        return list(upcoming[index]) if index < len(upcoming) else []


def decode(model_path: str, mode: str, ids, new_tokens: int, routes: list | None) -> dict:
    """One mode's run: decode tok/s without the page-cache drops, disk busy share, bytes and misses per token."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria

    import hf_moe_offload
    from hf_moe_offload.analysis import RoutingRecorder
    from hf_moe_offload.hooks import LayerHook

    files = glob.glob(os.path.join(model_path, "*.safetensors"))
    policy = {"device": "cpu", "store": "disk", "expert_cache": "25%", "prefetch": PREFETCH[mode]}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, offload_policy=policy)
    engine = hf_moe_offload.get_engine(model)
    model.generate(ids[:, :4], max_new_tokens=2, do_sample=False, pad_token_id=0)          # warm-up
    recorder = oracle = None
    if mode == "demand":
        recorder = RoutingRecorder()
        engine.add_hook(recorder)
    if mode == "oracle":
        oracle = OracleGuesses(routes)
        scheduler = next(h for h in engine.hooks if hasattr(h, "lookahead"))
        scheduler.lookahead.likely_experts = oracle.likely_experts

        class Count(LayerHook):
            def on_route(self, layer, experts):
                oracle.on_route(layer, experts)
        engine.add_hook(Count())
    reads = record_reads(engine.store)
    steps: list[tuple[float, float]] = []
    counted = ("bytes_to_device", "misses", "readahead_issued", "prefetch_hits", "prefetch_wasted")
    after_prefill: dict[str, int] = {}

    class Probe(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            entered = time.perf_counter()
            if not steps:       # the prompt's pass is done: count the decode steps' reads from here
                snap = engine.stats_snapshot()
                after_prefill.update({k: snap.get(k) or 0 for k in counted})
            evict_from_page_cache(files)
            steps.append((entered, time.perf_counter()))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    evict_from_page_cache(files)
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, stopping_criteria=[Probe()])
    spans = [(left, entered) for (_, left), (entered, _) in zip(steps, steps[1:])]     # decode steps, no drop
    seconds = sum(e - s for s, e in spans)
    busy = sum(busy_within(reads, s, e) for s, e in spans)
    snap = engine.stats_snapshot()
    decoded = {k: ((snap.get(k) or 0) - after_prefill[k]) / (new_tokens - 1) for k in counted}  # per decode step
    row = {"mode": mode, "decode_tok_s": len(spans) / seconds, "step_ms": 1e3 * seconds / len(spans),
           "disk_busy": busy / seconds, "mb_per_token": decoded["bytes_to_device"] / 1e6,
           "misses_per_token": decoded["misses"], "readahead_per_token": decoded["readahead_issued"],
           "readahead_used_per_token": decoded["prefetch_hits"], "readahead_wasted_per_token":
           decoded["prefetch_wasted"], "tokens": out[0, ids.shape[1]:].tolist()}
    if recorder is not None:
        row["routes"] = recorder.routes()
    hf_moe_offload.disable(model)
    return row


def resident_step(model_path: str, ids, new_tokens: int) -> tuple[float, list[int]]:
    """The resident model's decode step (seconds) and its greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    model.generate(ids[:, :4], max_new_tokens=2, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    step = (time.perf_counter() - start - prefill) / (new_tokens - 1)
    return step, out[0, ids.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint written by scripts/bench.py")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2, help="every mode once per round, alternated")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, help="write the rows here (JSON)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch
    torch.set_num_threads(1)
    files = [Path(f) for f in glob.glob(os.path.join(args.model, "*.safetensors"))]
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    started = time.time()
    rows, routes = [], None
    for round_ in range(args.rounds):
        step, reference = resident_step(args.model, ids, args.new_tokens)
        rows.append({"round": round_, "mode": "resident", "decode_tok_s": 1 / step, "step_ms": 1e3 * step})
        rate = store_read_bandwidth(files, repeats=2)["bytes_per_s"]
        rows[-1]["store_like_gb_s"] = rate / 1e9
        for mode in (["demand"] if "oracle" in args.modes and "demand" not in args.modes else []) + args.modes:
            row = decode(args.model, mode, ids, args.new_tokens, routes)
            routes = row.pop("routes", routes)
            row.update(round=round_, same_tokens=row.pop("tokens") == reference)
            rows.append(row)
            log.info("round %d %-9s %.2f tok/s  %.1f MB/token  %.2f misses/token  disk busy %.0f%%  same %s", round_,
                     mode, row["decode_tok_s"], row["mb_per_token"], row["misses_per_token"],
                     100 * row["disk_busy"], row["same_tokens"])
        demand = next(r for r in rows[::-1] if r["mode"] == "demand")
        bound = 1 / max(step, demand["mb_per_token"] * 1e6 / rate)
        for row in rows:
            if row["round"] == round_ and row["mode"] != "resident":
                row["overlap_bound_tok_s"] = bound
                row["of_bound"] = row["decode_tok_s"] / bound
        log.info("round %d: resident step %.1f ms, store-like %.2f GB/s, overlap bound %.2f tok/s", round_,
                 1e3 * step, rate / 1e9, bound)
    result = {"model": args.model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": rows,
              "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
              "seconds": time.time() - started, "load_1min": os.getloadavg()[0]}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print("| round | mode | decode tok/s | of overlap bound | MB/token | misses/token | disk busy | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["mode"] != "resident":
            print(f"| {r['round']} | {r['mode']} | {r['decode_tok_s']:.2f} | {r['of_bound']:.2f} | "
                  f"{r['mb_per_token']:.1f} | {r['misses_per_token']:.2f} | {r['disk_busy']:.0%} | "
                  f"{'yes' if r['same_tokens'] else 'NO'} |")


if __name__ == "__main__":
    main()
