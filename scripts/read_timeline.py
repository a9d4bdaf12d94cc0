#!/usr/bin/env python
"""Where in a decode step the disk idles: every store read and every MoE layer of a batched generate timestamped,
then, per decode step, the share of time with a read in flight inside each MoE layer, in the gap before it, and in
the pass's tail (last layer done -> next step; the head and sampling). Page cache dropped after every step.

Example (the batch-128 timeline in docs/benchmarks.md, ~40 s after scripts/bench.py built the checkpoint):
    HF_HUB_OFFLINE=1 python scripts/read_timeline.py \\
        --model /tmp/hf_moe_offload_bench/mixtral_h1024_i3584_l8_e8_k2_a16x8_v32000_seed0 --batch 128
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import threading
import time

from bench import evict_from_page_cache     # this folder's benchmark: the same page-cache eviction


def busy_within(reads: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] covered by at least one read interval."""
    spans = sorted((max(s, start), min(e, end)) for s, e in reads if e > start and s < end)
    total, current = 0.0, None
    for s, e in spans:
        if current is None or s > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = [s, e]
        else:
            current[1] = max(current[1], e)
    return total + (current[1] - current[0] if current else 0.0)


def record_reads(store) -> list[tuple[float, float]]:
    """Wrap `store.read_into` so that every expert read appends its (start, end) to the returned list."""
    read_into, lock, reads = store.read_into, threading.Lock(), []

    def timed_read(layer, expert, dst):
        start = time.perf_counter()
        read_into(layer, expert, dst)
        with lock:
            reads.append((start, time.perf_counter()))

    store.read_into = timed_read
    return reads


def record(model_path: str, batch: int, prompt_len: int, new_tokens: int, policy: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria

    import hf_moe_offload

    torch.set_num_threads(1)
    files = glob.glob(os.path.join(model_path, "*.safetensors"))

    def evict() -> None:
        evict_from_page_cache(files)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, offload_policy=policy)
    engine = hf_moe_offload.get_engine(model)
    reads = record_reads(engine.store)
    layers: list[tuple[str, int, float]] = []
    for layer in engine.layers:
        layer.module.register_forward_pre_hook(lambda m, a, i=layer.index: layers.append(("in", i, time.perf_counter())))
        layer.module.register_forward_hook(lambda m, a, o, i=layer.index: layers.append(("out", i, time.perf_counter())))
    steps: list[tuple[float, float]] = []       # (probe entered, probe left: page cache dropped)

    class Probe(StoppingCriteria):
        def __call__(self, ids, scores, **kwargs):
            entered = time.perf_counter()
            evict()
            steps.append((entered, time.perf_counter()))
            return torch.zeros(ids.shape[0], dtype=torch.bool)

    gen = torch.Generator().manual_seed(0)
    model.generate(torch.randint(3, model.config.vocab_size, (1, 4), generator=gen), max_new_tokens=2,
                   do_sample=False, pad_token_id=0)                       # warm-up
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=gen)
    evict()
    reads.clear()
    layers.clear()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                   stopping_criteria=[Probe()])
    return {"reads": reads, "layers": layers, "steps": steps}


def analyze(trace: dict) -> list[dict]:
    """Per decode step: its time, busy share, and (segment, ms, busy share) for gaps, MoE layers and the tail."""
    reads, out = trace["reads"], []
    for (_, left), (entered, _) in zip(trace["steps"], trace["steps"][1:]):
        marks = [(kind, i, t) for kind, i, t in trace["layers"] if left <= t <= entered]
        ins = {i: t for kind, i, t in marks if kind == "in"}
        outs = {i: t for kind, i, t in marks if kind == "out"}
        segments, previous = [], left
        for i in sorted(ins):
            segments += [(f"gap->L{i}", previous, ins[i]), (f"L{i}", ins[i], outs[i])]
            previous = outs[i]
        segments.append(("tail", previous, entered))
        out.append({"step_s": entered - left, "busy": busy_within(reads, left, entered) / (entered - left),
                    "segments": [(name, 1e3 * (e - s), busy_within(reads, s, e) / (e - s) if e > s else 0.0)
                                 for name, s, e in segments]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint written by scripts/bench.py")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--policy", default='{"device": "cpu", "store": "disk", "expert_cache": "25%"}')
    parser.add_argument("--json", help="also write the raw trace here")
    args = parser.parse_args()
    trace = record(args.model, args.batch, args.prompt_len, args.new_tokens, json.loads(args.policy))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(trace, f)
    steps = analyze(trace)
    for n, step in enumerate(steps, 1):
        print(f"step {n}: {step['step_s']:.3f} s, disk busy {step['busy']:.0%} | "
              + " ".join(f"{name} {ms:.0f}ms/{busy:.0%}" for name, ms, busy in step["segments"]))
    total = sum(s["step_s"] for s in steps)
    print(f"decode: disk busy {sum(s['busy'] * s['step_s'] for s in steps) / total:.1%} of {total:.2f} s")


if __name__ == "__main__":
    main()
