#!/usr/bin/env python
"""A/B of the disk store's read pattern inside a batched decode: chunk size, chunk threads, readers per copy engine
and kernel read-ahead (module constants of hf_moe_offload.storage.store / copy_engine, set before loading), alternated and
repeated, each run in its own process. Prints decode tok/s, the disk's busy share of the decode (ReadClock), the
rate while busy and the bytes read per step. Page cache dropped after every step.

Example (the batch-32 comparison in docs/benchmarks.md):
    HF_HUB_OFFLINE=1 python scripts/ab_read_pattern.py \\
        --model /tmp/hf_moe_offload_bench/mixtral_h1024_i3584_l8_e8_k2_a16x8_v32000_seed0 --batch 32 --repeats 2 \\
        '{}' '{"fadvise": "SEQUENTIAL"}' '{"chunk_mb": 16}' '{"chunk_mb": 1, "chunk_readers": 8}'
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

from bench import evict_from_page_cache, proc_read_bytes   # this folder's benchmark: the same disk probes


def run_one(model_path: str, variant: dict, batch: int, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria

    import hf_moe_offload
    import hf_moe_offload.memory.copy_engine as copy_engine
    import hf_moe_offload.storage.store as store_module

    torch.set_num_threads(1)
    store_module.READ_CHUNK_BYTES = variant.get("chunk_mb", 4) << 20
    store_module.CHUNK_READERS = variant.get("chunk_readers", 4)
    copy_engine.DISK_READERS = variant.get("readers", copy_engine.DISK_READERS)
    advice = getattr(os, "POSIX_FADV_" + variant.get("fadvise", "RANDOM"))
    open_shard = store_module._open_shard

    def open_with_advice(path):
        fd = open_shard(path)
        os.posix_fadvise(fd, 0, 0, advice)
        return fd

    store_module._open_shard = open_with_advice
    files = glob.glob(os.path.join(model_path, "*.safetensors"))

    def evict() -> None:
        evict_from_page_cache(files)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": "25%", **variant.get("policy", {})})
    clock = hf_moe_offload.get_engine(model).cache.copy.read_clock
    marks: list[tuple[float, float, int]] = []      # (time, busy s, bytes) as each step ends, then after eviction

    class Probe(StoppingCriteria):
        def __call__(self, ids, scores, **kwargs):
            marks.append((time.perf_counter(), clock.snapshot()[0], proc_read_bytes()))
            evict()
            marks.append((time.perf_counter(), clock.snapshot()[0], proc_read_bytes()))
            return torch.zeros(ids.shape[0], dtype=torch.bool)

    gen = torch.Generator().manual_seed(0)
    model.generate(torch.randint(3, model.config.vocab_size, (1, 4), generator=gen), max_new_tokens=2,
                   do_sample=False, pad_token_id=0)
    ids = torch.randint(3, model.config.vocab_size, (batch, 16), generator=gen)
    evict()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                   stopping_criteria=[Probe()])
    steps = [(b[0] - a[0], b[1] - a[1], b[2] - a[2]) for a, b in zip(marks[1::2], marks[2::2])]
    wall, busy, nbytes = (sum(s[i] for s in steps) for i in range(3))
    return {"variant": variant, "decode_tok_s": batch * len(steps) / wall, "read_busy_share": busy / wall,
            "GB_per_busy_s": nbytes / busy / 1e9 if busy else None, "MB_per_step": nbytes / len(steps) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", help="JSON: chunk_mb, chunk_readers, readers, fadvise, policy")
    parser.add_argument("--model", required=True, help="a checkpoint written by scripts/bench.py")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)            # internal: run one variant in this process
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.model, json.loads(args.one), args.batch, args.new_tokens)))
        return
    if not args.variants:
        parser.error("give at least one variant, e.g. '{}' for the library's defaults")
    for _ in range(args.repeats):                                  # alternated: the disk swings between samples
        for variant in args.variants:
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--batch", str(args.batch),
                                  "--new-tokens", str(args.new_tokens), "--one", variant],
                                 capture_output=True, text=True, check=True)
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
