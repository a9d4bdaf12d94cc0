#!/usr/bin/env python
"""A/B of continuous-batching token budgets on one offloaded model: transformers' own (8192 tokens per pass),
`offload_batching_config`'s (measured R and alpha, see docs/continuous_batching.md), fixed ones, all on the same KV
cache (a block per prompt), and a plain `generate_batch` call with no config (the library sizes both), alternated in
one process over `generate_batch` of mixed-length prompts; generated tokens/s, forward passes and disk bytes per
generated token, page cache dropped before every forward pass (disk store). `--attention packed dense` runs each
budget both with the library's packed attention (request by request, `hf_moe_offload.attention.packed`) and with
transformers' sdpa over its dense mask of every request's keys (what ran before packed attention).

Example (the table in docs/continuous_batching.md; ~7 min on 2 cores, after scripts/bench.py built the model):
    HF_HUB_OFFLINE=1 python scripts/ab_batching.py --store disk --repeats 2 --fixed 512
    HF_HUB_OFFLINE=1 python scripts/ab_batching.py --store cpu --repeats 1 --fixed 512
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from pathlib import Path

import bench   # this folder's benchmark: the same prompts, page-cache eviction and disk probes

DEFAULT_MODEL = "/tmp/hf_moe_offload_bench/mixtral_h1024_i3584_l8_e8_k2_a16x8_v32000_seed0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a checkpoint written by scripts/bench.py")
    parser.add_argument("--store", choices=("disk", "cpu"), default="disk")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64, help="prompts are 1/4 to 2x this long")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--fixed", type=int, nargs="*", default=[512], help="fixed max_batch_tokens to add")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--attention", nargs="+", choices=("packed", "dense"), default=["packed"],
                        help="continuous batching's attention: the library's packed one, and/or sdpa's dense mask")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="float32 on CPUs without bf16 matmul units (AVX2 only), where bf16 runs ~6x slower")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    from hf_moe_offload.batching import config as batching
    from hf_moe_offload.batching.config import token_budget

    torch.set_num_threads(1)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    files = bench.checkpoint_files(Path(args.model))
    policy = {"device": "cpu", "store": "disk", "expert_cache": "25%"} if args.store == "disk" else \
        {"device": "cpu", "store": "cpu"}
    bench.evict_from_page_cache(files)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype), offload_policy=policy)
    prompts = bench.mixed_prompts(model.config.vocab_size, args.prompts, args.prompt_len, 0)
    config = bench.greedy_config(args.new_tokens)
    evictor = bench.ForwardEvictor(files if args.store == "disk" else None)
    model.register_forward_pre_hook(evictor)
    base = bench.cb_config(prompts, args.new_tokens)
    packed_functions = (batching.use_packed_attention, batching.runs_packed)

    def attention(kind: str) -> None:
        """Packed attention on, or off as before it existed (sdpa over the dense mask, budget capped by sqrt(R/a))."""
        if kind == "packed":
            batching.use_packed_attention, batching.runs_packed = packed_functions
        else:
            batching.use_packed_attention, batching.runs_packed = (lambda model, manager: False), (lambda model: False)

    budgets = []
    for kind in args.attention:
        attention(kind)
        start = time.perf_counter()
        budget = token_budget(model, base.page_size)       # what offload_batching_config picks, measured now
        print(f"{kind}: offload_batching_config: {budget.max_batch_tokens} tokens/pass (memory rule "
              f"{budget.memory_tokens}, amortizing {budget.amortizing_tokens}; {budget.costs}) sized in "
              f"{time.perf_counter() - start:.2f} s", flush=True)
        bench.continuous(model, prompts[:2], bench.greedy_config(1))      # untimed: one-time costs
        budgets += [(kind, "transformers' default", None), (kind, "offload_batching_config", budget.max_batch_tokens)]
        budgets += [(kind, f"fixed {n}", n) for n in args.fixed]
        budgets += [(kind, "no config given (generate_batch sizes itself, KV cache included)", "plain")]
    tokens_of: dict[tuple[str, str], list[list[int]]] = {}      # (attention, budget) -> first run's tokens
    for _ in range(args.repeats):
        for kind, budget_name, tokens in budgets:
            attention(kind)
            name = f"{kind} attention, {budget_name}"
            evictor(None, None)
            evictor.calls, evictor.seconds = 0, 0.0
            reads, start = bench.proc_read_bytes(), time.perf_counter()
            if tokens == "plain":    # what a user's plain call does (sizing measured inside the timing)
                outputs = model.generate_batch(prompts, generation_config=config, progress_bar=False, warmup=False)
                out = [list(o.generated_tokens) for o in outputs.values()]
            else:
                out = bench.continuous(model, prompts, config, dataclasses.replace(base, max_batch_tokens=tokens))
            wall = time.perf_counter() - start - evictor.seconds
            generated = sum(map(len, out))
            tokens_of.setdefault((kind, budget_name), out)
            others = [k for (k, b) in tokens_of if b == budget_name and k != kind]
            same = "".join(f", tokens {'=' if tokens_of[(k, budget_name)] == out else '!='} {k}'s" for k in others)
            print(f"{name} ({tokens or 'unset'}): {generated / wall:.2f} generated tok/s, {evictor.calls} forwards, "
                  f"{(bench.proc_read_bytes() - reads) / generated / 1e6:.1f} MB read per generated token{same}",
                  flush=True)


if __name__ == "__main__":
    main()
