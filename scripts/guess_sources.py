#!/usr/bin/env python
"""Which guess of the next layer's experts pays at batch 1: the precision of each source a read-ahead could use.

One greedy generate per model records, at every MoE layer of every decode step, the experts the router chose and
the look-ahead's guesses for the next layer (`analysis.RoutingRecorder(predictions=True)`). Each source then names
top-k guesses for layer l+1 while layer l computes, and is scored against what layer l+1's router chose:

- `lookahead`: layer l+1's router applied to layer l's input (what `prefetch="lookahead"` reads);
- `last_step`: what layer l+1 chose at the previous decode step;
- `correlation`: Klotski's cross-layer table, learned online from the steps so far: the experts of layer l+1 most
  often chosen together with layer l's choice of this step;
- `static`: layer l+1's most chosen experts so far;
- `random`: the expected precision of k experts drawn at random (k / E), for reference.

Precision here counts every guess (resident or not): it is what a cache without residents would gain.

Example:
    HF_HUB_OFFLINE=1 python scripts/guess_sources.py --model demo --out benchmarks/results/guess_sources_demo.json
    HF_HUB_OFFLINE=1 python scripts/guess_sources.py --model /tmp/hf_moe_offload_bench/mixtral_h1024_i3584_l8_e8_k2_a16x8_v32000_seed0 \\
        --out benchmarks/results/guess_sources_bench.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_moe_offload
from hf_moe_offload.analysis import RoutingRecorder

log = logging.getLogger("guess_sources")
SOURCES = ("lookahead", "last_step", "correlation", "static")


def record(model_path: str, prompts: int, prompt_len: int, new_tokens: int, seed: int) -> tuple[list, int, int]:
    """The recorded trace of `prompts` greedy generations, and the model's experts per layer and top-k."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": "25%", "prefetch": "none"})
    engine = hf_moe_offload.get_engine(model)
    recorder = RoutingRecorder(predictions=True, depth=1).bind(engine)
    engine.add_hook(recorder)
    config = model.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    top_k = config.num_experts_per_tok
    gen = torch.Generator().manual_seed(seed)
    traces = []
    for _ in range(prompts):
        ids = torch.randint(0, config.vocab_size, (1, prompt_len), generator=gen)
        recorder.trace.clear()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        traces.append(list(recorder.trace))
    return traces, experts, top_k


def steps_of(trace: list) -> list[dict]:
    """The trace cut into forward passes: per pass, {layer: routed experts} and {layer: look-ahead guesses}."""
    passes, current, ahead = [], None, {}
    for kind, layer, experts in trace:
        if kind == "route":
            if current is None or layer in current["route"]:
                current, ahead = {"route": {}, "predict": ahead}, {}
                passes.append(current)
            current["route"][layer] = experts
        elif current is not None and layer not in current["route"] and layer > max(current["route"]):
            current["predict"][layer] = experts
        else:                      # guessed before the next pass's first route: that pass's
            ahead[layer] = experts
    return passes


def score(traces: list, top_k: int) -> dict[str, dict[str, float]]:
    """Per source: guesses made, used, precision; decode steps only (the prefill routes many tokens at once)."""
    used, made = Counter(), Counter()
    for trace in traces:
        passes = steps_of(trace)[1:]                       # decode steps: one token each
        pair = defaultdict(Counter)                        # (l, e) -> Counter of layer l+1 experts
        chosen = defaultdict(Counter)                      # l -> Counter of experts
        previous: dict[int, tuple] = {}
        for step in passes:
            layers = sorted(step["route"])
            for here, nxt in zip(layers, layers[1:]):
                truth = set(step["route"][nxt])
                guesses = {"lookahead": list(step["predict"].get(nxt, ()))[:top_k],
                           "last_step": list(previous.get(nxt, ()))[:top_k],
                           "correlation": [e for e, _ in sum((pair[(here, e)] for e in step["route"][here]),
                                                              Counter()).most_common(top_k)],
                           "static": [e for e, _ in chosen[nxt].most_common(top_k)]}
                for source, guess in guesses.items():
                    if guess:
                        made[source] += len(guess)
                        used[source] += len(truth & set(guess))
                for e in step["route"][here]:
                    pair[(here, e)].update(step["route"][nxt])
            for layer in layers:
                chosen[layer].update(step["route"][layer])
            previous = dict(step["route"])
    return {s: {"guesses": made[s], "used": used[s], "precision": used[s] / made[s] if made[s] else None}
            for s in SOURCES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a checkpoint folder, or 'demo' for the embedded demo model")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    path = str(Path(hf_moe_offload.__file__).parent / "demo_model") if args.model == "demo" else args.model
    started = time.perf_counter()
    traces, experts, top_k = record(path, args.prompts, args.prompt_len, args.new_tokens, args.seed)
    result = {"model": args.model, "experts": experts, "top_k": top_k, "prompts": args.prompts,
              "new_tokens": args.new_tokens, "random_precision": top_k / experts, "sources": score(traces, top_k),
              "cpu": platform.processor() or os.uname().machine, "date": time.strftime("%Y-%m-%d"),
              "seconds": round(time.perf_counter() - started, 1)}
    for source, row in result["sources"].items():
        log.info("%-12s precision %s (%d guesses)", source,
                 "-" if row["precision"] is None else f"{row['precision']:.3f}", row["guesses"])
    log.info("random       precision %.3f", result["random_precision"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
