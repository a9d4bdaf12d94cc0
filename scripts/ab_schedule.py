#!/usr/bin/env python
"""A/B of offload policies on one checkpoint, alternated and repeated (this shared disk's bandwidth swings 2x between
samples, so a ratio needs alternation): prefill and decode tokens/s, disk bytes per decode step, hit rate, stall,
speculative loads and repeat reads, with the page cache dropped after every step (experts "larger than RAM").

Each run is its own subprocess. Prints one JSON line per run and a per-policy summary (median).

Example (the schedule comparison in docs/benchmarks.md; ~5 min on 2 cores, after scripts/bench.py built the model):
    HF_HUB_OFFLINE=1 python scripts/ab_schedule.py \\
        --model /tmp/hf_moe_offload_bench/mixtral_h1024_i3584_l8_e8_k2_a16x8_v32000_seed0 --batch 8 --repeats 2 \\
        '{"schedule": "on_demand"}' '{"stream_window": 1}' '{"stream_window": 2}' '{"stream_window": 4}'
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

from bench import evict_from_page_cache, proc_read_bytes   # this folder's benchmark: the same disk probes

BASE_POLICY = {"device": "cpu", "store": "disk", "expert_cache": "25%"}


def run_one(model: str, policy: dict, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """One generate in this process (called in a fresh subprocess by `main`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria

    import hf_moe_offload

    torch.set_num_threads(1)
    files = glob.glob(os.path.join(model, "*.safetensors"))

    def evict() -> None:
        evict_from_page_cache(files)

    class Steps(StoppingCriteria):
        """Timestamps every step and drops the page cache after it; never stops generation."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            evict()
            return torch.zeros(ids.shape[0], dtype=torch.bool)

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, offload_policy={**BASE_POLICY, **policy})
    g = torch.Generator().manual_seed(0)
    m.generate(torch.randint(3, m.config.vocab_size, (1, 4), generator=g), max_new_tokens=2, do_sample=False,
               pad_token_id=0)                                             # warm-up, as a running server would be
    ids = torch.randint(3, m.config.vocab_size, (batch, prompt_len), generator=g)
    hf_moe_offload.stats(m).reset()
    evict()
    clock = getattr(getattr(hf_moe_offload.get_engine(m).cache, "copy", None), "read_clock", None)
    busy0 = clock.snapshot()[0] if clock is not None else 0.0
    steps, start, before = Steps(), time.perf_counter(), proc_read_bytes()
    m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
               stopping_criteria=[steps])
    read = proc_read_bytes() - before
    # Share of the generate the store had a read in flight (the rest: the disk idled, evictions included).
    busy_share = (clock.snapshot()[0] - busy0) / (steps.times[-1] - start) if clock is not None else None
    s = hf_moe_offload.stats(m)
    return {"policy": policy, "batch": batch,
            "prefill_tok_s": batch * prompt_len / (steps.times[0] - start),
            "decode_tok_s": batch * (len(steps.times) - 1) / (steps.times[-1] - steps.times[0]),
            "disk_MB_per_step": read / len(steps.times) / 1e6, "hit_rate": s["hit_rate"], "stall_s": s["stall_s"],
            "passes": s["passes"], "repeat_reads": s["repeat_reads"], "prefetch_issued": s["prefetch_issued"],
            "prefetch_hits": s["prefetch_hits"], "prefetch_wasted": s["prefetch_wasted"], "read_busy_share": busy_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policies", nargs="+", help="JSON policy fields on top of " + json.dumps(BASE_POLICY))
    parser.add_argument("--model", required=True, help="a checkpoint written by scripts/bench.py")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)                  # internal: run one policy here
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.model, json.loads(args.one), args.batch, args.prompt_len, args.new_tokens)))
        return
    results: dict[str, list[dict]] = {p: [] for p in args.policies}
    for _ in range(args.repeats):
        for policy in args.policies:                                       # alternated, not one policy at a time
            out = subprocess.run([sys.executable, __file__, policy, "--one", policy, "--model", args.model,
                                  "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
                                  "--new-tokens", str(args.new_tokens)], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            results[policy].append(row)
            print(json.dumps(row), flush=True)
    for policy, rows in results.items():
        print(f"{policy}: decode {statistics.median(r['decode_tok_s'] for r in rows):.2f} tok/s, prefill "
              f"{statistics.median(r['prefill_tok_s'] for r in rows):.1f} tok/s, disk "
              f"{statistics.median(r['disk_MB_per_step'] for r in rows):.0f} MB/step (median of {len(rows)})")


if __name__ == "__main__":
    main()
