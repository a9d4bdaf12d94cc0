#!/usr/bin/env python
"""Counts, not timings: record a model's routing in `generate` calls (each a prompt's pass, then decode steps), then
replay it through a simulated expert cache of several sizes under every eviction policy and Belady's optimum
(`hf_moe_offload.analysis.simulate`: the cache's own rules), "layer" without sparing its router's recent choices
(`layer_plain`), and "layer" sparing the choices of other numbers of passes (`--recent-passes`, columns
`layer_recentN`). The misses are the expert reads each policy costs.

    HF_HUB_OFFLINE=1 python scripts/eviction_replay.py --model demo
    HF_HUB_OFFLINE=1 python scripts/eviction_replay.py --model /tmp/hf_moe_offload_bench/<bench.py checkpoint> \\
        --batch 8 --prompts 3 --new-tokens 16 --out benchmarks/results/eviction_replay_bench_b8.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_moe_offload
from hf_moe_offload.analysis import RoutingRecorder, simulate
from hf_moe_offload.analysis.belady import POLICIES
from hf_moe_offload.memory.eviction import LayerAware

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (make_prompt: the benchmark's random prompts)

log = logging.getLogger("eviction_replay")
DEMO_MODEL = Path(__file__).resolve().parent.parent / "hf_moe_offload" / "demo_model"


def prompt_ids(model_path: Path, vocab: int, batch: int, prompt_len: int, index: int) -> torch.Tensor:
    """The demo model's held-out text (a trained model routes real text differently), else random ids."""
    if model_path != DEMO_MODEL:
        return bench.make_prompt(vocab, batch, prompt_len, 100 + index)[0]
    from transformers import AutoTokenizer

    texts = [json.loads(line)["text"] for line in (DEMO_MODEL / "heldout.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    rows = [tokenizer(texts[(index * batch + b) % len(texts)]).input_ids[:prompt_len] for b in range(batch)]
    return torch.tensor(rows)


def record(model_path: Path, batch: int, prompts: int, prompt_len: int, new_tokens: int) -> list:
    """The routing of `prompts` greedy `generate` calls of `batch` prompts (a cold cache: `prefetch` off)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": "25%", "prefetch": "none"})
    engine = hf_moe_offload.get_engine(model)
    recorder = RoutingRecorder().bind(engine)
    engine.add_hook(recorder)
    for i in range(prompts):
        ids = prompt_ids(model_path, model.config.vocab_size, batch, prompt_len, i)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return recorder.routes()


def layer_misses(routes: list, slots: int, layers: int, recent_passes: int) -> int:
    """Misses of "layer" sparing the router choices of `recent_passes` passes instead of its own window."""
    own, LayerAware.RECENT_PASSES = LayerAware.RECENT_PASSES, recent_passes
    try:
        return simulate(routes, slots, "layer", num_layers=layers).misses
    finally:
        LayerAware.RECENT_PASSES = own


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help='a checkpoint folder, or "demo" (the embedded trained model)')
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4, help="generate calls, each from a cold prompt pass")
    p.add_argument("--prompt-len", type=int, default=24, help="prompt tokens (held-out text cut to this for demo)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--shares", type=float, nargs="+", default=[0.2, 0.25, 0.3, 0.4, 0.5],
                   help="cache sizes as shares of all experts")
    p.add_argument("--recent-passes", type=int, nargs="*", default=[],
                   help='"layer" also sparing the router choices of this many passes (its own follows the '
                        'cache size; 0 is layer_plain)')
    p.add_argument("--out", type=Path, help="write the routing's counts per policy here as JSON")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = DEMO_MODEL if args.model == "demo" else Path(args.model)
    routes = record(path, args.batch, args.prompts, args.prompt_len, args.new_tokens)
    layers = 1 + max(layer for layer, _ in routes)
    experts = 1 + max(e for _, chosen in routes for e in chosen)
    widest = max(len(set(chosen)) for _, chosen in routes)
    rows = []
    for share in args.shares:
        slots = max(widest, round(share * layers * experts))
        misses = {policy: simulate(routes, slots, policy, num_layers=layers).misses for policy in POLICIES}
        misses["layer_plain"] = layer_misses(routes, slots, layers, recent_passes=0)
        for passes in args.recent_passes:
            misses[f"layer_recent{passes}"] = layer_misses(routes, slots, layers, passes)
        rows.append({"share": share, "slots": slots, "misses": misses})
    print(f"\n{path.name}: {layers} layers x {experts} experts, batch {args.batch}, {args.prompts} prompts x "
          f"{args.new_tokens} new tokens, {len(routes)} layer calls; expert reads per policy\n")
    columns = [*POLICIES, "layer_plain", *(f"layer_recent{n}" for n in args.recent_passes)]
    print("| slots (share) | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for row in rows:
        print(f"| {row['slots']} ({row['share']:.0%}) | " + " | ".join(str(row["misses"][k]) for k in columns) + " |")
    if args.out:
        args.out.write_text(json.dumps({"model": str(path), "batch": args.batch, "prompts": args.prompts,
                                        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                                        "layers": layers, "experts": experts, "layer_calls": len(routes),
                                        "library": hf_moe_offload.__version__, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
