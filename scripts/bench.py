#!/usr/bin/env python
"""Benchmark per-expert offloading against a fully resident model and accelerate's ``device_map`` offload, on the
CPU or on a CUDA GPU.

What it does, in one invocation:

1. Writes (once, cached under ``--workdir``) a Mixtral-shaped checkpoint with random bf16 weights in the Hub's
   per-expert safetensors layout, one shard per decoder layer, generated layer by layer (never the whole model in
   RAM). CPU: about 1.5 GB by default. CUDA: Mixtral-8x7B's layer shapes with as many layers as the disk holds.
2. Measures the disk's cold read bandwidth twice: sequential reads of a whole shard (for reference) and the disk
   store's own reads (one ``preadv`` per expert tensor, 4 reader threads, every expert once); the second is the
   bandwidth of the per-row bound. On the CPU, logs each row's estimated peak RSS and seconds before running it.
3. Runs every row (system x store x device-memory cap x batch size) in its own subprocess, so peak RSS and peak
   device memory are the row's own:

   - ``resident``: ``from_pretrained(path, dtype=bfloat16)``, everything in RAM / on the GPU (upper bound; on the
     GPU only where the whole model fits under the cap).
   - ``accelerate``: accelerate's ``device_map`` offload. CPU: non-expert modules on "cpu", every
     ``model.layers.{i}.mlp.experts`` on "disk" with an ``offload_folder``. CUDA: ``device_map="auto"`` with
     ``max_memory={0: cap minus the working memory, "cpu": free RAM}`` (store ``cpu``) or ``"cpu": 0`` plus an
     ``offload_folder`` (store ``disk``).
   - ``hf_moe_offload`` (eviction "lru") and ``hf_moe_offload_layer`` (the library's default eviction "layer").
     CPU: ``{"device": "cpu", "store": "disk", "expert_cache": "25%"}``. CUDA: ``{"device": "cuda:0", "store":
     "cpu" | "disk", "expert_cache": <bytes left under the cap>}``.

   On CUDA each worker first measures pinned host-to-device bandwidth (CUDA events over copies of one expert's
   size), then caps its device memory with ``torch.cuda.set_per_process_memory_fraction(cap / total)``.
4. Emulates "experts larger than RAM": before the run and after every decode step the checkpoint files' pages (and
   accelerate's offload folder) are dropped from the OS page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``, from
   a ``StoppingCriteria`` that also timestamps every step (``--no-evict`` keeps the page cache warm instead).
5. Reports load time, prefill and decode tokens/s, bytes read from disk per generated token (``/proc/self/io``),
   bytes moved per token (hf_moe_offload: its cache misses; accelerate on the GPU: every offloaded weight once per
   forward), hit rate, peak RSS, peak device memory (``torch.cuda.max_memory_allocated``), greedy-token agreement
   with ``resident`` (else ``accelerate``) at the same batch size, and the bound ``bandwidth / bytes that must move
   per token`` where the bandwidth is the slowest link the bytes cross (disk when evicted, pinned H2D on CUDA).
   The bound per row: batch / max(the resident row's step time at that batch, bytes that must move per step
   / store-like bandwidth), where hf_moe_offload must move its resident-set floor ((experts the step touched -
   cache slots) x expert bytes, from its own routing); disk bytes per step beside that floor and beside the best
   fixed resident set's (the cache's slots filled with the experts touched in the most steps); speed vs accelerate.
6. With ``--cb-prompts N`` (``--throughput``: 128): transformers' ``generate_batch`` over N mixed-length prompts vs
   static-batch ``generate`` in batches of ``--cb-static-batch``, per system (hf_moe_offload systems: with
   transformers' own token budget, with ``offload_batching_config``'s, and as a plain call with no config; all
   three run hf_moe_offload's packed attention in place of sdpa's dense mask), and the resident row with sdpa and
   with packed attention (the token reference for the packed modes) (skipped with its reason when the attention
   implementation cannot do continuous batching).

   Writes the JSON first, then a PNG (needs matplotlib), and prints markdown tables. A failed row is recorded
   with its error and the run goes on; the exit status is then 1.

Example:
    # quick smoke run (~2 minutes on 2 cores), results outside the repository
    python scripts/bench.py --small --out /tmp/bench_small
    # the documented benchmark (4-9 minutes on 2 shared cores): benchmarks/results/cpu_mixtral_1.5gb.{json,png}
    python scripts/bench.py --threads 1 --idle-wait 30
    # the throughput regime (~10 minutes on 2 shared cores, model built; estimates logged before the rows):
    # batches 8 32 128, 64-token prompts, generate_batch over 128 prompts vs static batches of 32
    #   -> benchmarks/results/cpu_mixtral_1.5gb_throughput.{json,png}
    python scripts/bench.py --throughput --threads 1 --idle-wait 30
    # same, page cache left warm: benchmarks/results/cpu_mixtral_1.5gb_warm.{json,png}
    python scripts/bench.py --threads 1 --idle-wait 30 --no-evict
    # re-render table and PNG from a saved run
    python scripts/bench.py --from-json benchmarks/results/cpu_mixtral_1.5gb.json

    # GPU, unattended (CUDA build of torch, pip install -e ".[bench]"): Mixtral-8x7B layers, as many as the disk
    # holds (at most 32), stores cpu and disk, caps 16 and 24 GiB, batch 1 and 64, 128-token prompts, 16 new tokens
    # -> benchmarks/results/gpu_mixtral8x7b_<gpu name>.{json,png}
    HF_HUB_OFFLINE=1 python scripts/bench.py --device cuda --workdir /path/on/a/big/disk
    # GPU smoke run (2 layers, 16-token prompts, 4 new tokens, 16 GiB cap)
    #   -> benchmarks/results/gpu_mixtral8x7b_<gpu name>_quick.{json,png}
    HF_HUB_OFFLINE=1 python scripts/bench.py --device cuda --quick
    # GPU, the large batches: CPU attention, whole batch against two micro-batches (CGOPipe's overlap)
    HF_HUB_OFFLINE=1 python scripts/bench.py --device cuda --stores cpu --caps-gib 16 --batch-sizes 64 128 256 \
        --systems accelerate hf_moe_offload_layer hf_moe_offload_cpu_attention hf_moe_offload_cpu_attention_mb2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = logging.getLogger("bench")

REPO_ROOT = Path(__file__).resolve().parent.parent
QUANTIZATIONS = ("int8", "int4")
DENSE_SYSTEMS = ("resident", "accelerate", "hf_moe_offload", "hf_moe_offload_layer")
# Opt-in rows (--systems ...): look-ahead eviction; quantized experts at the dense rows' byte budget (more experts fit).
EXTRA_SYSTEMS = ("hf_moe_offload_lookahead", "hf_moe_offload_readahead", "hf_moe_offload_direct",
                 *(f"hf_moe_offload_{q}_same_bytes" for q in QUANTIZATIONS),
                 "hf_moe_offload_cpu_compute", "hf_moe_offload_auto_compute",    # expert_compute: for --device cuda
                 # CPU attention, whole batch or in two micro-batches (CGOPipe's overlap): for --device cuda
                 "hf_moe_offload_cpu_attention", "hf_moe_offload_cpu_attention_mb2",
                 "hf_moe_offload_cpu_store")     # every expert in host memory, computed in place (the CPU kernels)
SYSTEMS = (*DENSE_SYSTEMS, *(f"hf_moe_offload_{q}" for q in QUANTIZATIONS), *EXTRA_SYSTEMS)  # quantized: --quantize
OURS_POLICY = {"device": "cpu", "store": "disk", "expert_cache": "25%", "eviction": "lru"}
# hf_moe_offload systems: LRU eviction (LRU) and the same with the library's default layer-aware eviction;
# --quantize adds the default eviction with experts stored quantized (approximate: tokens may differ from resident).
POLICIES = {"hf_moe_offload": OURS_POLICY, "hf_moe_offload_layer": {**OURS_POLICY, "eviction": "layer"},
            **{f"hf_moe_offload_{q}": {**OURS_POLICY, "eviction": "layer", "quantize": q} for q in QUANTIZATIONS},
            **{f"hf_moe_offload_{q}_same_bytes": {**OURS_POLICY, "eviction": "layer", "quantize": q}
               for q in QUANTIZATIONS},
            "hf_moe_offload_lookahead": {**OURS_POLICY, "eviction": "lookahead"},
            # The next layer's router guesses read ahead at every layer (into the staging room), whatever they score.
            "hf_moe_offload_readahead": {**OURS_POLICY, "eviction": "layer", "prefetch": "lookahead"},
            # Reads around the page cache: what disk_reads="auto" picks for a model larger than RAM.
            "hf_moe_offload_direct": {**OURS_POLICY, "eviction": "layer", "disk_reads": "direct"},
            # A missing expert computes on the CPU from the host copy ("cpu"), or where the measured costs say ("auto").
            "hf_moe_offload_cpu_compute": {**OURS_POLICY, "eviction": "layer", "expert_compute": "cpu"},
            "hf_moe_offload_auto_compute": {**OURS_POLICY, "eviction": "layer", "expert_compute": "auto"},
            # Keys and values in host memory, attention on the CPU; with micro_batches=2 one half's attention runs
            # while the device computes the other half's experts.
            "hf_moe_offload_cpu_attention": {**OURS_POLICY, "eviction": "layer", "attention": "cpu"},
            "hf_moe_offload_cpu_attention_mb2": {**OURS_POLICY, "eviction": "layer", "attention": "cpu",
                                                 "micro_batches": 2},
            "hf_moe_offload_cpu_store": {"device": "cpu", "store": "cpu"}}
MiB, GiB = 2**20, 2**30
MARKER = "bench_model.json"
MAX_GPU_LAYERS = 32            # Mixtral-8x7B has 32
DISK_MARGIN = 4 * GiB          # left free on the work dir's disk (logs, page-cache writeback, the OS)
ALLOCATOR_SLACK = 1 * GiB      # device memory the caching allocator loses to fragmentation under the cap

# Settings that differ by device; --quick replaces some of them (any flag given on the command line wins).
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"systems": list(DENSE_SYSTEMS), "batch_sizes": [1, 8], "prompt_len": 16, "new_tokens": 16, "threads": 1,
            "warmup_tokens": 2, "idle_wait": 30.0, "caps_gib": [], "stores": ["disk"], "cb_prompts": 0,
            "cb_static_batch": 32},
    "cuda": {"systems": ["resident", "accelerate", "hf_moe_offload_layer"], "batch_sizes": [1, 64],
             "prompt_len": 128, "new_tokens": 16, "threads": 0, "warmup_tokens": 2, "idle_wait": 0.0, "caps_gib": [16.0, 24.0],
             "stores": ["cpu", "disk"], "cb_prompts": 0, "cb_static_batch": 32},
}
QUICK = {"layers": 2, "prompt_len": 16, "new_tokens": 4, "warmup_tokens": 1, "caps_gib": [16.0]}
# The throughput regime on the CPU: batches that touch every expert, prompts long enough that prefill is a
# real pass (64 x 128 = 8192 tokens), and continuous batching over 128 mixed-length prompts.
THROUGHPUT = {"systems": ["resident", "accelerate", "hf_moe_offload_layer"], "batch_sizes": [8, 32, 128],
              "prompt_len": 64, "new_tokens": 16, "warmup_tokens": 1, "cb_prompts": 128, "cb_static_batch": 32}


# ----------------------------------------------------------------------------------------------------------- shape


@dataclass(frozen=True)
class ModelShape:
    """The Mixtral shape of the random model (defaults: about 1.5 GB in bf16)."""

    hidden: int = 1024
    intermediate: int = 3584
    layers: int = 8
    experts: int = 8
    top_k: int = 2
    heads: int = 16
    kv_heads: int = 8
    vocab: int = 32000

    @property
    def tag(self) -> str:
        return (f"mixtral_h{self.hidden}_i{self.intermediate}_l{self.layers}_e{self.experts}_k{self.top_k}"
                f"_a{self.heads}x{self.kv_heads}_v{self.vocab}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def one_expert_bytes(self) -> int:
        """One expert's gate, up and down matrices in bf16."""
        return 3 * self.hidden * self.intermediate * 2

    def expert_bytes(self) -> int:
        """Bytes of all experts in bf16."""
        return self.one_expert_bytes() * self.experts * self.layers

    def layer_tensors(self, i: int) -> dict[str, tuple[int, ...]]:
        """Decoder layer `i`'s checkpoint entries (Hub layout: per-expert w1/w3/w2) and their shapes."""
        h, inter, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        pre = f"model.layers.{i}"
        tensors = {f"{pre}.input_layernorm.weight": (h,), f"{pre}.post_attention_layernorm.weight": (h,),
                   f"{pre}.self_attn.q_proj.weight": (q, h), f"{pre}.self_attn.k_proj.weight": (kv, h),
                   f"{pre}.self_attn.v_proj.weight": (kv, h), f"{pre}.self_attn.o_proj.weight": (h, q),
                   f"{pre}.block_sparse_moe.gate.weight": (self.experts, h)}
        for e in range(self.experts):
            ex = f"{pre}.block_sparse_moe.experts.{e}"
            tensors.update({f"{ex}.w1.weight": (inter, h), f"{ex}.w3.weight": (inter, h), f"{ex}.w2.weight": (h, inter)})
        return tensors

    def outer_tensors(self) -> dict[str, tuple[int, ...]]:
        """The entries outside the decoder layers (untied embeddings and LM head, final norm)."""
        return {"model.embed_tokens.weight": (self.vocab, self.hidden), "model.norm.weight": (self.hidden,),
                "lm_head.weight": (self.vocab, self.hidden)}

    def layer_bytes(self) -> int:
        return 2 * sum(math.prod(s) for s in self.layer_tensors(0).values())

    def outer_bytes(self) -> int:
        return 2 * sum(math.prod(s) for s in self.outer_tensors().values())

    def total_bytes(self) -> int:
        return self.outer_bytes() + self.layers * self.layer_bytes()

    def non_expert_bytes(self) -> int:
        """What stays on the device when the experts are offloaded."""
        return self.total_bytes() - self.expert_bytes()


SMALL = ModelShape(hidden=256, intermediate=768, layers=4, experts=8, top_k=2, heads=8, kv_heads=4, vocab=4096)
TINY = ModelShape(hidden=64, intermediate=128, layers=2, experts=8, top_k=2, heads=4, kv_heads=2, vocab=512)
MIXTRAL_8X7B = ModelShape(hidden=4096, intermediate=14336, layers=MAX_GPU_LAYERS, experts=8, top_k=2, heads=32,
                          kv_heads=8, vocab=32000)


# ----------------------------------------------------------------------------------------------------------- model


def mixtral_config(shape: ModelShape):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        num_local_experts=shape.experts, num_experts_per_tok=shape.top_k, max_position_embeddings=4096,
        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


def random_tensors(shapes: dict[str, tuple[int, ...]], gen) -> dict[str, Any]:
    """bf16 tensors the way Mixtral initialises them: RMSNorm weights 1, matrices normal(0, 0.02)."""
    import torch

    return {name: torch.ones(s, dtype=torch.bfloat16) if len(s) == 1
            else torch.randn(s, generator=gen).mul_(0.02).to(torch.bfloat16) for name, s in shapes.items()}


def build_checkpoint(shape: ModelShape, seed: int, workdir: Path) -> Path:
    """Random-weight Mixtral in bf16, Hub layout, under `workdir`; reused when it already exists. Written one shard
    per decoder layer (plus one for embeddings, norm and head), so memory holds one layer at a time."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    path = workdir / f"{shape.tag}_seed{seed}"
    if (path / MARKER).exists():
        log.info("reusing checkpoint %s", path)
        return path
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    mixtral_config(shape).save_pretrained(partial)
    log.info("writing %s (seed %d, %.2f GB) in bf16 ...", shape.tag, seed, shape.total_bytes() / 1e9)
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    shards = [shape.outer_tensors()] + [shape.layer_tensors(i) for i in range(shape.layers)]
    weight_map: dict[str, str] = {}
    for k, shapes in enumerate(tqdm(shards, desc="writing shards", unit="shard")):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(random_tensors(shapes, gen), partial / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shapes, name))
    index = {"metadata": {"total_size": shape.total_bytes()}, "weight_map": weight_map}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    files = checkpoint_files(partial)
    fsync_files(files)
    info = {"shape": dataclasses.asdict(shape), "seed": seed, "num_parameters": shape.total_bytes() // 2,
            "bytes_on_disk": sum(f.stat().st_size for f in files), "files": [f.name for f in files]}
    (partial / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    log.info("built %s: %.2f GB in %d shards, %.0f s", path, info["bytes_on_disk"] / 1e9, len(files),
             time.perf_counter() - start)
    return path


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def built_layers(workdir: Path, base: ModelShape, seed: int) -> int | None:
    """The most layers of a finished checkpoint of `base`'s shape already in `workdir` (None: none there)."""
    pattern = re.escape(base.tag).replace(f"_l{base.layers}_", r"_l(\d+)_") + f"_seed{seed}"
    found = [int(m.group(1)) for d in workdir.glob("mixtral_*") if (m := re.fullmatch(pattern, d.name))
             and (d / MARKER).exists()]
    return max(found, default=None)


def layers_for_disk(free_bytes: int, base: ModelShape, copies: int) -> int:
    """Decoder layers whose checkpoint (x `copies`: accelerate re-saves what it offloads to disk) fit in
    `free_bytes`, with a 5% margin per layer (~2.8 GiB per Mixtral-8x7B layer) and `DISK_MARGIN` left free."""
    per_layer = copies * base.layer_bytes() * 1.05
    room = free_bytes - copies * base.outer_bytes() - DISK_MARGIN
    return min(MAX_GPU_LAYERS, int(room // per_layer))


def default_layers(workdir: Path, base: ModelShape, seed: int, copies: int) -> int:
    """Reuse the largest checkpoint already built, else as many layers as the work dir's free disk allows."""
    built = built_layers(workdir, base, seed)
    if built is not None:
        log.info("reusing the %d-layer checkpoint in %s (--layers to choose another)", built, workdir)
        return built
    free = shutil.disk_usage(workdir).free
    layers = layers_for_disk(free, base, copies)
    log.info("%.0f GiB free under %s: %d layers (%d cop%s of each on disk)", free / GiB, workdir, layers, copies,
             "y" if copies == 1 else "ies")
    if layers < 1:
        raise SystemExit(f"bench.py: error: {free / GiB:.0f} GiB free under {workdir} holds no layer; "
                         f"free some space or pass --workdir on a larger disk")
    return layers


# ------------------------------------------------------------------------------------------- CPU estimates


PROCESS_BASE = int(0.4 * GiB)     # a worker's RSS with torch and transformers imported, before loading
OURS_CACHE_SHARE = 0.25           # OURS_POLICY's expert_cache
# Small-batch decode is bound by reading the weights from RAM, not by FLOPs: resident batch 8 ran 0.13 s a step
# for 1.4 GB of experts on this machine (docs/benchmarks.md).
RAM_BYTES_PER_S = 10e9


def matmul_flops_per_s(shape: ModelShape, threads: int) -> float:
    """bf16 matmul speed of this CPU at one expert's shape (about 0.3 s), with the workers' thread count."""
    import torch

    old = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    a = torch.randn(512, shape.hidden, dtype=torch.bfloat16)
    w = torch.randn(shape.intermediate, shape.hidden, dtype=torch.bfloat16)
    torch.nn.functional.linear(a, w)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.3:
        torch.nn.functional.linear(a, w)
        n += 1
    torch.set_num_threads(old)
    return n * 2 * a.shape[0] * shape.hidden * shape.intermediate / (time.perf_counter() - start)


def pass_flops(shape: ModelShape, tokens: int, sequences: int) -> float:
    """Multiply-adds x 2 of one forward over `tokens` tokens (top-k experts, attention projections, router; the LM
    head for one position per sequence)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = 2 * shape.hidden * (2 * q + 2 * kv) + shape.top_k * 3 * shape.hidden * shape.intermediate
    return 2 * (tokens * shape.layers * per_layer + sequences * shape.vocab * shape.hidden)


def touched_share(shape: ModelShape, tokens: int) -> float:
    """Share of the experts a pass of `tokens` tokens touches if routing were uniform."""
    return 1 - (1 - shape.top_k / shape.experts) ** tokens


def pass_read_bytes(shape: ModelShape, system: str, tokens: int) -> float:
    """Disk bytes one forward reads cold: accelerate every expert; hf_moe_offload the experts `tokens` touch beyond
    its cache; resident nothing."""
    if system == "resident":
        return 0.0
    if system == "accelerate":
        return float(shape.expert_bytes())
    return max(0.0, touched_share(shape, tokens) - OURS_CACHE_SHARE) * shape.expert_bytes()


def pass_seconds(shape: ModelShape, system: str, tokens: int, sequences: int, flops_per_s: float,
                 read_bytes_per_s: float) -> float:
    """One forward: the slowest of its FLOPs, its weights streamed from RAM, and its cold disk reads."""
    ram = shape.non_expert_bytes() + touched_share(shape, tokens) * shape.expert_bytes()
    return max(pass_flops(shape, tokens, sequences) / flops_per_s, ram / RAM_BYTES_PER_S,
               pass_read_bytes(shape, system, tokens) / read_bytes_per_s)


def estimate_row(shape: ModelShape, system: str, batch: int, prompt_len: int, new_tokens: int, warmup_tokens: int,
                 flops_per_s: float, read_bytes_per_s: float) -> dict[str, float]:
    """Coarse peak RSS and wall time of one CPU row: start-up, load, the warm-up and measured generates."""
    seq = prompt_len + new_tokens
    kv = 2 * shape.layers * batch * seq * shape.kv_heads * shape.head_dim * 2
    # measured peaks: resident holds the weights twice while loading, accelerate about the whole model
    weights = {"resident": 2 * shape.total_bytes(), "accelerate": shape.total_bytes()}.get(
        system, shape.non_expert_bytes() + OURS_CACHE_SHARE * shape.expert_bytes())
    memory = PROCESS_BASE + weights + kv + working_bytes(shape, batch, prompt_len) - ALLOCATOR_SLACK
    passes = [(batch * prompt_len, new_tokens)] + ([(batch * prompt_len, warmup_tokens)] if warmup_tokens else [])
    seconds = 5.0 + shape.total_bytes() / read_bytes_per_s * (3 if system == "accelerate" else 1)
    for prefill_tokens, steps in passes:
        for tokens in [prefill_tokens] + [batch] * (steps - 1):
            seconds += pass_seconds(shape, system, tokens, batch, flops_per_s, read_bytes_per_s)
    return {"peak_rss_bytes": memory, "seconds": seconds}


def log_estimates(shape: ModelShape, args: argparse.Namespace, rows: list[dict], read_bytes_per_s: float
                  ) -> dict[str, Any]:
    """Estimate every row before running it, log them with the total, warn about rows that may not fit in RAM."""
    import psutil

    flops = matmul_flops_per_s(shape, args.threads)
    free = psutil.virtual_memory().available
    estimates = []
    for row in rows:
        e = estimate_row(shape, row["system"], row["batch"], args.prompt_len, args.new_tokens, args.warmup_tokens,
                         flops, read_bytes_per_s)
        estimates.append({"system": row["system"], "batch": row["batch"], **e})
        if e["peak_rss_bytes"] > free:
            log.warning("%s at batch %d may need %.1f GiB, %.1f GiB of RAM is available", row["system"],
                        row["batch"], e["peak_rss_bytes"] / GiB, free / GiB)
    if args.cb_prompts > 0:       # both modes ~ static batches of the mean prompt length (1.125 x --prompt-len)
        groups = -(-args.cb_prompts // args.cb_static_batch)
        for system in [s for s in args.systems if s == "resident" or s in POLICIES]:
            e = estimate_row(shape, system, args.cb_static_batch, int(1.125 * args.prompt_len), args.new_tokens, 0,
                             flops, read_bytes_per_s)
            estimates.append({"system": system, "batch": f"generate_batch vs static {args.cb_static_batch}",
                              "peak_rss_bytes": e["peak_rss_bytes"], "seconds": 2 * groups * e["seconds"]})
    total = sum(e["seconds"] for e in estimates) + (args.idle_wait > 0) * 3.0 * len(estimates)
    log.info("estimate (%.0f GFLOP/s bf16, %.0f MB/s cold reads): %s; about %.0f s for %d rows", flops / 1e9,
             read_bytes_per_s / 1e6, ", ".join(f"{e['system']}@{e['batch']} {e['peak_rss_bytes'] / GiB:.1f} GiB "
                                               f"{e['seconds']:.0f} s" for e in estimates), total, len(estimates))
    return {"flops_per_s": flops, "read_bytes_per_s": read_bytes_per_s, "rows": estimates, "total_s": total}


# ---------------------------------------------------------------------------------------------- device memory plan


def working_bytes(shape: ModelShape, batch: int, seq_len: int) -> int:
    """Device memory besides the weights: the KV cache, prefill activations (hidden states, one expert's gate/up/
    down over every token, attention projections; x2 for temporaries) and allocator slack."""
    kv = 2 * shape.layers * batch * seq_len * shape.kv_heads * shape.head_dim * 2
    activations = 2 * batch * seq_len * (3 * shape.intermediate + 6 * shape.hidden) * 2
    logits = batch * shape.vocab * 4 * 2
    return kv + activations + logits + ALLOCATOR_SLACK


def device_plan(shape: ModelShape, cap: int, batch: int, seq_len: int) -> dict[str, int]:
    """How a device-memory cap splits: working memory, weights, and (for hf_moe_offload) the expert cache, which is
    what the weights budget leaves after the non-expert weights."""
    work = working_bytes(shape, batch, seq_len)
    return {"cap_bytes": cap, "working_bytes": work, "weights_bytes": cap - work,
            "expert_cache_bytes": cap - work - shape.non_expert_bytes()}


def row_spec(system: str, batch: int, store: str | None, plan: dict[str, int] | None) -> dict[str, Any]:
    return {"system": system, "batch": batch, "store": store, **(plan or {"cap_bytes": None})}


def plan_rows(device: str, shape: ModelShape, systems: list[str], stores: list[str], caps: list[int],
              batches: list[int], seq_len: int) -> list[dict[str, Any]]:
    """Every (system, store, cap, batch) row to run. CPU: no cap, accelerate and hf_moe_offload read the disk.
    CUDA: a row is dropped (logged) when its share of the cap cannot hold what it needs: the whole model for
    `resident`, one layer's top-k experts for hf_moe_offload's cache."""
    if device == "cpu":
        return [row_spec(s, b, None if s == "resident" else "disk", None) for b in batches for s in systems]
    rows = []
    for cap in caps:
        for batch in batches:
            plan = device_plan(shape, cap, batch, seq_len)
            for system in systems:
                if system == "resident":
                    if plan["weights_bytes"] >= shape.total_bytes():
                        rows.append(row_spec(system, batch, None, plan))
                    else:
                        log.info("no resident row at %.0f GiB, batch %d: the model (%.1f GiB) does not fit",
                                 cap / GiB, batch, shape.total_bytes() / GiB)
                    continue
                if system in POLICIES and plan["expert_cache_bytes"] < shape.top_k * shape.one_expert_bytes():
                    log.info("no %s rows at %.0f GiB, batch %d: %.1f GiB left for the expert cache", system,
                             cap / GiB, batch, plan["expert_cache_bytes"] / GiB)
                    continue
                rows += [row_spec(system, batch, store, plan) for store in stores]
    return rows
# ------------------------------------------------------------------------------------------------------ page cache


def fsync_files(files: list[Path]) -> None:
    """Write back dirty pages (POSIX_FADV_DONTNEED only drops clean ones)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict_from_page_cache(files: list[Path]) -> None:
    """Drop the files' clean pages from the OS page cache, so the next read really goes to the disk."""
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def proc_read_bytes() -> int:
    """Bytes this process (all threads) made the kernel fetch from a block device."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def disk_bandwidth(files: list[Path], repeats: int = 3, chunk: int = 16 * MiB) -> dict[str, Any]:
    """Sequential read bandwidth of the largest checkpoint shard, read cold (evicted first); best of `repeats` (the
    physical limit; on a shared machine single runs come out lower)."""
    target = max(files, key=lambda f: f.stat().st_size)
    buf = bytearray(chunk)
    rates = []
    for _ in range(repeats):
        evict_from_page_cache([target])
        before = proc_read_bytes()
        start = time.perf_counter()
        total = 0
        with open(target, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
        elapsed = time.perf_counter() - start
        rates.append(total / elapsed)
        log.info("disk read %s: %.0f MB in %.2f s = %.0f MB/s (block reads %.0f MB)", target.name, total / 1e6,
                 elapsed, total / elapsed / 1e6, (proc_read_bytes() - before) / 1e6)
    evict_from_page_cache([target])
    return {"file": target.name, "file_bytes": target.stat().st_size, "chunk_bytes": chunk,
            "runs_bytes_per_s": rates, "bytes_per_s": max(rates), "median_bytes_per_s": statistics.median(rates)}


def combine_bandwidth(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Measurements taken before and after the runs, pooled: the best one is the physical limit."""
    rates = first["runs_bytes_per_s"] + second["runs_bytes_per_s"]
    return {**first, "runs_bytes_per_s": rates, "bytes_per_s": max(rates),
            "median_bytes_per_s": statistics.median(rates)}


ExpertRanges = list[list[tuple[int, int, int]]]    # per expert: (file index, offset, nbytes) of each tensor


def expert_byte_ranges(files: list[Path]) -> ExpertRanges:
    """Every expert's tensors as byte ranges in the safetensors shards, from their headers, in forward order
    (layer, then expert): what the disk store reads for one expert."""
    experts: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for k, f in enumerate(files):
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        for name, entry in header.items():
            if m := re.search(r"layers\.(\d+)\..*experts\.(\d+)\.", name):
                begin, end = entry["data_offsets"]
                experts.setdefault((int(m[1]), int(m[2])), []).append((k, 8 + header_len + begin, end - begin))
    return [sorted(experts[key]) for key in sorted(experts)]


def pread_expert(fds: list[int], ranges: list[tuple[int, int, int]], buf: memoryview) -> int:
    """Read one expert's ranges with `preadv` into `buf`, as `checkpoint.read_into` does; returns the bytes."""
    done = 0
    for k, offset, nbytes in ranges:
        got = 0
        while got < nbytes:
            n = os.preadv(fds[k], [buf[done + got:done + nbytes]], offset + got)
            if n <= 0:
                raise OSError(f"short read at byte {offset + got} of shard {k}")
            got += n
        done += nbytes
    return done


def store_read_bandwidth(files: list[Path], readers: int | None = None, repeats: int = 3) -> dict[str, Any]:
    """Cold read bandwidth with the disk store's own reads: every expert once, in forward order, one `preadv` per
    tensor, `readers` threads (the store's `DISK_READERS`) each with its own buffer, page cache evicted before each
    repeat. Best of `repeats` (the physical limit, as for `disk_bandwidth`)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from hf_moe_offload.memory.copy_engine import DISK_READERS

    readers = readers or DISK_READERS
    experts = expert_byte_ranges(files)
    size = max(sum(n for _, _, n in e) for e in experts)
    local = threading.local()

    def read(ranges: list[tuple[int, int, int]]) -> int:
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(size))       # one buffer per reader thread, as in the store
        return pread_expert(fds, ranges, local.buf)

    fds = [os.open(f, os.O_RDONLY) for f in files]
    rates = []
    try:
        for _ in range(repeats):
            evict_from_page_cache(files)
            start = time.perf_counter()
            with ThreadPoolExecutor(readers) as pool:
                total = sum(pool.map(read, experts))
            elapsed = time.perf_counter() - start
            rates.append(total / elapsed)
            log.info("store-like reads: %d experts, %.0f MB in %.2f s with %d threads = %.0f MB/s", len(experts),
                     total / 1e6, elapsed, readers, total / elapsed / 1e6)
    finally:
        for fd in fds:
            os.close(fd)
    evict_from_page_cache(files)
    return {"readers": readers, "experts": len(experts), "bytes": total, "runs_bytes_per_s": rates,
            "bytes_per_s": max(rates), "median_bytes_per_s": statistics.median(rates)}


# ---------------------------------------------------------------------------------------------------------- worker


class StepProbe:
    """A `StoppingCriteria` (duck-typed) called once per generated token: waits for the device, then timestamps,
    disk reads, optional stats snapshot, then page-cache eviction. Never stops generation."""

    def __init__(self, evict_files: list[Path] | None, snapshot: Callable[[], dict] | None,
                 synchronize: Callable[[], None], allocator: Callable[[], dict] | None = None):
        self.evict_files = evict_files
        self.snapshot = snapshot
        self.synchronize = synchronize
        self.allocator = allocator
        self.allocator_counts: list[dict] = []
        self.enter: list[float] = []
        self.exit: list[float] = []
        self.reads_enter: list[int] = []
        self.reads_exit: list[int] = []
        self.stats: list[dict] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.synchronize()          # CUDA runs ahead of the host: time the step's work, not its launch
        self.enter.append(time.perf_counter())
        self.reads_enter.append(proc_read_bytes())
        if self.snapshot is not None:
            self.stats.append(self.snapshot())
        if self.allocator is not None:
            self.allocator_counts.append(self.allocator())
        if self.evict_files:
            evict_from_page_cache(self.evict_files)
        self.reads_exit.append(proc_read_bytes())
        self.exit.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def accelerate_device_map(path: Path) -> dict[str, str]:
    """accelerate placement on the CPU: every module owning tensors on "cpu", every `...mlp.experts` on "disk"."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    experts = [name for name, _ in skeleton.named_modules() if name.endswith("mlp.experts")]
    device_map: dict[str, str] = {}
    for name, module in skeleton.named_modules():
        if any(name == e or name.startswith(e + ".") for e in experts):
            continue
        if next(module.parameters(recurse=False), None) is not None or \
                next(module.buffers(recurse=False), None) is not None:
            device_map[name] = "cpu"
    device_map.update({e: "disk" for e in experts})
    return device_map


def accelerate_cuda_kwargs(spec: dict[str, Any], offload_folder: Path, host_bytes: int) -> dict[str, Any]:
    """accelerate's own placement on GPU 0 under the row's weights budget (the cap less the working memory, as for
    hf_moe_offload); the rest in `host_bytes` of RAM (store "cpu") or all of it on disk (store "disk")."""
    # grouped_mm: transformers' fastest experts on a GPU; its default gathers each token's expert weights
    # (batched_mm), tens of GiB per Mixtral layer at batch 64.
    if spec["store"] == "cpu":
        return {"device_map": "auto", "max_memory": {0: spec["weights_bytes"], "cpu": host_bytes},
                "experts_implementation": "grouped_mm"}
    return {"device_map": "auto", "max_memory": {0: spec["weights_bytes"], "cpu": 0},
            "offload_folder": str(offload_folder), "experts_implementation": "grouped_mm"}


def device_map_of(model) -> dict[str, Any]:
    """accelerate's placement; a model that fit on one device has no `hf_device_map`: all of it is where its
    parameters are."""
    return getattr(model, "hf_device_map", None) or {"": next(model.parameters()).device}


def offloaded_bytes(model, device: str) -> int:
    """Bytes of the weights accelerate keeps off the compute device: its hooks bring every one of them over once
    per forward (on the CPU only "disk" is off the device)."""
    off = {"cpu", "disk"} - {device}
    placement = {name: str(where) for name, where in device_map_of(model).items()}

    def where(param: str) -> str:
        owner = max((m for m in placement if m == "" or param == m or param.startswith(m + ".")), key=len)
        return placement[owner]

    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if where(name) in off)


def policy_for(spec: dict[str, Any]) -> dict[str, Any]:
    """The row's offload policy: the system's CPU policy, on CUDA with the row's store and cache budget."""
    policy = dict(POLICIES[spec["system"]])
    if spec["system"].endswith("_same_bytes"):   # the dense rows' byte budget, filled with quantized experts
        shape = ModelShape(**json.loads((Path(spec["checkpoint"]) / MARKER).read_text())["shape"])
        policy["expert_cache"] = int(OURS_CACHE_SHARE * shape.expert_bytes())
    if spec["device"] == "cuda":
        policy.update(device="cuda:0", store=spec["store"], expert_cache=spec["expert_cache_bytes"])
    return policy


def load_system(spec: dict[str, Any], path: Path, offload_folder: Path):
    """Load the model the way the row's system does; returns (model, extra files whose pages to evict)."""
    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    import hf_moe_offload  # noqa: F401  (installs the offload_policy keyword)

    system, cuda = spec["system"], spec["device"] == "cuda"
    if system == "resident":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **(
            {"device_map": {"": 0}, "experts_implementation": "grouped_mm"} if cuda else {})), []
    if system == "accelerate":
        shutil.rmtree(offload_folder, ignore_errors=True)
        host = psutil.virtual_memory().available - 8 * GiB    # room for the process itself and the page cache
        kwargs = accelerate_cuda_kwargs(spec, offload_folder, host) if cuda else \
            {"device_map": accelerate_device_map(path), "offload_folder": str(offload_folder)}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs)
        files = sorted(p for p in offload_folder.rglob("*") if p.is_file()) if offload_folder.exists() else []
        fsync_files(files)
        return model, files
    if system in POLICIES:
        policy = policy_for(spec)
        if policy.get("quantize", "none") == "none":
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload_policy=policy), []
        # Quantized once into a folder beside the checkpoint (reused by later rows and runs while the checkpoint is
        # unchanged); its files are what a decode step reads, so their pages are the ones evicted.
        folder = Path(spec["offload_folder"]).parent / f"quantized_{policy['quantize']}"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload_policy=policy,
                                                     offload_folder=str(folder))
        files = sorted(p for p in folder.glob("*.safetensors"))
        fsync_files(files)
        return model, files
    raise ValueError(f"unknown system {system!r}; allowed: {SYSTEMS}")


def make_prompt(vocab: int, batch: int, prompt_len: int, seed: int):
    """Random prompt ids (the same rows for every system), avoiding the special ids 0-2."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (max(batch, 8), prompt_len), generator=gen)[:batch]
    return ids, torch.ones_like(ids)


def compute_device(spec: dict[str, Any]) -> str:
    return "cuda:0" if spec["device"] == "cuda" else "cpu"


def warmup(model, spec: dict[str, Any]) -> float:
    """A short generate on a different prompt, so one-time costs (code pages, allocator, thread pools, CUDA
    kernels) stay out of the measurement. hf_moe_offload's cache keeps what this run loaded (a running server's
    situation)."""
    import torch

    if spec["warmup_tokens"] <= 0:
        return 0.0
    ids, mask = make_prompt(spec["vocab"], spec["batch"], spec["prompt_len"], spec["seed"] + 1)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids.to(compute_device(spec)), attention_mask=mask.to(compute_device(spec)),
                       **fixed_length(spec["warmup_tokens"]))
    return time.perf_counter() - start


def summarize_steps(probe: StepProbe, gen_start: float, reads_start: int, batch: int,
                    prompt_len: int) -> dict[str, Any]:
    """Prefill and decode timings and disk reads from the probe's per-step records (eviction time excluded)."""
    n = len(probe.enter)
    step_s = [probe.enter[i] - probe.exit[i - 1] for i in range(1, n)]
    step_reads = [probe.reads_enter[i] - probe.reads_exit[i - 1] for i in range(1, n)]
    decode_s = sum(step_s)
    decode_tokens = batch * (n - 1)
    prefill_s = probe.enter[0] - gen_start
    return {
        "prefill_s": prefill_s,
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "prefill_read_bytes": probe.reads_enter[0] - reads_start,
        "decode_steps": n - 1,
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
        "decode_step_s": step_s,
        "decode_step_read_bytes": step_reads,
        "decode_read_bytes": sum(step_reads),
        "read_bytes_per_token": sum(step_reads) / decode_tokens,
        "evict_s": sum(x - e for e, x in zip(probe.enter, probe.exit)),
    }


# Counters the engine may or may not have (read with .get: the script runs on library versions before and after).
SCHEDULE_KEYS = ("passes", "last_schedule", "repeat_reads", "readahead_issued", "prefetch_issued", "prefetch_wasted",
                 "lookahead_on", "lookahead_precision", "lookahead_exposure", "lookahead_trial",
                 "cpu_computed", "cpu_compute_s", "cpu_bytes_read", "placement")


def summarize_ours(probe: StepProbe, decode_tokens: int) -> dict[str, Any]:
    """hf_moe_offload counters over the decode steps only (first probe call = end of prefill), and the experts each
    pass touched (`experts_used` summed over layers: the routing the resident-set floor needs)."""
    first, last = probe.stats[0], probe.stats[-1]
    d = {k: last[k] - first[k] for k in ("hits", "misses", "evictions", "bytes_to_device", "stall_s")}
    d["cpu_computed"] = last.get("cpu_computed", 0) - first.get("cpu_computed", 0)   # expert_compute rows
    if "read_busy_s" in last:      # the disk's busy time: idle gaps (schedule) vs slow reads (disk)
        d["read_busy_s"] = last["read_busy_s"] - first["read_busy_s"]
        d["read_clock_bytes"] = last["read_clock_bytes"] - first["read_clock_bytes"]
    lookups = d["hits"] + d["misses"] + d["cpu_computed"]
    used = [s["experts_used"] for s in probe.stats]
    touched = [touched_between(a, b) for a, b in zip(probe.stats, probe.stats[1:])]
    if any(step is None for step in touched):      # a library version without the per-expert counter
        touched = None
    return {
        "decode": d,
        "decode_hit_rate": d["hits"] / lookups if lookups else float("nan"),
        "bytes_to_device_per_token": d["bytes_to_device"] / decode_tokens,
        "prefill": {k: first[k] for k in ("hits", "misses", "bytes_to_device", "stall_s")},
        "prefill_experts_used": used[0],
        "decode_step_experts_used": [b - a for a, b in zip(used, used[1:])],
        "decode_step_experts_touched": touched,     # [layer, expert] pairs per step (None: library without the counter)
        "cache_capacity_bytes": last["cache_capacity_bytes"],
        "peak_cache_bytes": last["peak_cache_bytes"],
        "schedule": {k: last[k] for k in SCHEDULE_KEYS if k in last},     # whole generate (prefill + decode)
    }


def touched_between(before: dict, after: dict) -> list[list[int]] | None:
    """The [layer, expert] pairs routed to between two stats snapshots (`per_layer[i]["expert_calls"]`; None for a
    library version without that counter)."""
    pairs = []
    for layer, (a, b) in enumerate(zip(before["per_layer"], after["per_layer"])):
        if "expert_calls" not in b:
            return None
        start = a.get("expert_calls", [])
        pairs += [[layer, e] for e, n in enumerate(b["expert_calls"]) if n > (start[e] if e < len(start) else 0)]
    return pairs


def read_clock(model) -> dict[str, float]:
    """Seconds with at least one store read in flight and the bytes read, summed over the engine's copy engines
    (`ReadClock`; absent in library versions before it, and for a zero-copy cache)."""
    import hf_moe_offload

    cache = hf_moe_offload.get_engine(model).cache
    caches = list(cache.caches.values()) if hasattr(cache, "caches") else [cache]   # a CacheGroup: one per device
    clocks = [c.copy.read_clock for c in caches if getattr(getattr(c, "copy", None), "read_clock", None)]
    if not clocks:
        return {}
    snaps = [clock.snapshot() for clock in clocks]
    return {"read_busy_s": sum(s[0] for s in snaps), "read_clock_bytes": sum(s[1] for s in snaps)}


def peak_rss_bytes() -> int:
    """This process's peak resident set since it started (`VmHWM`). Not `ru_maxrss`: Linux carries that across
    fork + exec, so a worker would report the parent's peak (the one that built the model) as its own."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024          # kB
    raise RuntimeError("/proc/self/status has no VmHWM")


def h2d_bandwidth(nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """Pinned host -> GPU 0 copy bandwidth over `nbytes` copies (one expert), timed with CUDA events; best of
    `repeats` after one warm-up copy. Device memory used here is freed and its peak forgotten."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst.copy_(src, non_blocking=True)
    rates = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes / (begin.elapsed_time(end) / 1e3))
    del src, dst
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(0)
    return {"copy_bytes": nbytes, "runs_bytes_per_s": rates, "bytes_per_s": max(rates)}


def cuda_info() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "total_memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda, "torch": torch.__version__}


def cap_device_memory(cap: int, total: int) -> float:
    """Limit this process's caching allocator on GPU 0 to `cap` bytes; returns the fraction set."""
    import torch

    if cap > total:
        raise ValueError(f"cap {cap / GiB:.1f} GiB exceeds the GPU's {total / GiB:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    return cap / total


def prepare_device(spec: dict[str, Any]) -> dict[str, Any]:
    """CUDA: measure pinned H2D bandwidth before anything else is on the device, then cap the device memory.
    Returns the row's device facts (empty on the CPU)."""
    if spec["device"] != "cuda":
        return {}
    info = cuda_info()
    h2d = h2d_bandwidth(spec["one_expert_bytes"])
    fraction = cap_device_memory(spec["cap_bytes"], info["total_memory_bytes"])
    return {"gpu": info, "h2d": h2d, "memory_fraction": fraction}


def device_peaks(spec: dict[str, Any]) -> dict[str, Any]:
    """Peak device memory the caching allocator handed out (CUDA), None on the CPU."""
    if spec["device"] != "cuda":
        return {"peak_device_bytes": None}
    import torch

    return {"peak_device_bytes": torch.cuda.max_memory_allocated(0),
            "peak_device_reserved_bytes": torch.cuda.max_memory_reserved(0)}


# The caching allocator's counters: a retry follows a failed allocation (it frees the cached blocks, which waits
# for the device, and tries again); device allocs and frees are cudaMalloc / cudaFree calls, each a slow call.
ALLOCATOR_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")


def allocator_counters(spec: dict[str, Any]) -> Callable[[], dict] | None:
    """Reads the CUDA caching allocator's counters (None on the CPU)."""
    if spec["device"] != "cuda":
        return None
    import torch

    return lambda: {k: torch.cuda.memory_stats(0).get(k, 0) for k in ALLOCATOR_KEYS}


def allocator_summary(probe: StepProbe, at_start: dict | None) -> dict[str, Any]:
    """The allocator's counters over prefill (to the first step) and over the decode steps."""
    if at_start is None or not probe.allocator_counts:
        return {}
    first, last = probe.allocator_counts[0], probe.allocator_counts[-1]
    return {"allocator": {"prefill": {k: first[k] - at_start[k] for k in ALLOCATOR_KEYS},
                          "decode": {k: last[k] - first[k] for k in ALLOCATOR_KEYS}}}


def synchronizer(spec: dict[str, Any]) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if spec["device"] == "cuda" else (lambda: None)


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One row (system, store, cap, batch size), in this (fresh) process."""
    import torch

    if spec.get("kind") == "continuous_batching":
        return run_cb_worker(spec)
    if spec["threads"] > 0:
        torch.set_num_threads(spec["threads"])
    device_facts = prepare_device(spec)
    system, batch, evict = spec["system"], spec["batch"], spec["evict"]
    path = Path(spec["checkpoint"])
    ckpt_files = checkpoint_files(path)
    offload_folder = Path(spec["offload_folder"])
    rss_import = peak_rss_bytes()
    if evict:
        evict_from_page_cache(ckpt_files)
    reads0, t0 = proc_read_bytes(), time.perf_counter()
    model, extra_files = load_system(spec, path, offload_folder)
    load_s, load_reads = time.perf_counter() - t0, proc_read_bytes() - reads0
    rss_load = peak_rss_bytes()
    device_after_load = device_peaks(spec)["peak_device_bytes"]
    evict_files = (ckpt_files + extra_files) if evict else None
    if evict:
        evict_from_page_cache(evict_files)

    warmup_s = warmup(model, spec)
    if evict:
        evict_from_page_cache(evict_files)
    snapshot = None
    if system in POLICIES:
        import hf_moe_offload

        hf_moe_offload.stats(model).reset()
        snapshot = lambda: {**hf_moe_offload.stats(model), **read_clock(model)}  # noqa: E731
    ids, mask = make_prompt(spec["vocab"], batch, spec["prompt_len"], spec["seed"])
    ids, mask = ids.to(compute_device(spec)), mask.to(compute_device(spec))
    allocator = allocator_counters(spec)
    probe = StepProbe(evict_files, snapshot, synchronizer(spec), allocator)
    probe.synchronize()
    allocator_start = allocator() if allocator else None
    reads_start, gen_start = proc_read_bytes(), time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, stopping_criteria=[probe], **fixed_length(spec["new_tokens"]))
    result = {
        **{k: spec[k] for k in ("system", "batch", "evict", "device", "store", "cap_bytes")},
        "load_s": load_s, "load_read_bytes": load_reads,
        "warmup_s": warmup_s, "experts_implementation": model.config._experts_implementation,
        **summarize_steps(probe, gen_start, reads_start, batch, spec["prompt_len"]),
        "tokens": out[:, ids.shape[1]:].tolist(),
        "rss_after_import_bytes": rss_import, "rss_after_load_bytes": rss_load, "peak_rss_bytes": peak_rss_bytes(),
        **device_facts, "device_after_load_bytes": device_after_load, **device_peaks(spec),
        **allocator_summary(probe, allocator_start),
    }
    if system == "accelerate":
        result["offload_folder_bytes"] = sum(f.stat().st_size for f in extra_files)
        result["offloaded_bytes_per_step"] = offloaded_bytes(model, spec["device"])
        result["device_map_counts"] = dict(Counter(map(str, device_map_of(model).values())))
    if system in POLICIES:
        result["policy"] = policy_for(spec)
        result["ours"] = summarize_ours(probe, result["decode_tokens"])
        decode = result["ours"]["decode"]
        if decode.get("read_busy_s"):     # share of the decode time the disk was reading, and its rate meanwhile
            decode["read_busy_share"] = decode["read_busy_s"] / result["decode_s"]
            decode["read_bytes_per_busy_s"] = decode["read_clock_bytes"] / decode["read_busy_s"]
        import hf_moe_offload

        # One expert as the row stores and moves it (quantized rows: fewer bytes than the checkpoint's).
        engine = hf_moe_offload.get_engine(model)
        result["ours"]["expert_bytes"] = engine.cache.slot_bytes
        # What "auto" chose for the reads (the row's policy keeps what was asked; None: a library without it).
        result["ours"]["disk_reads"] = getattr(engine.policy, "disk_reads", None)
        result["ours"]["reads_directly"] = bool(getattr(engine.store, "reads_directly", False))
        # Packed oneDNN copies, and the own dense weights left in the file (None: a library without the field).
        stats = dict(hf_moe_offload.stats(model))
        result["ours"]["prepacked_bytes"] = stats.get("prepacked_bytes")
        result["ours"]["dense_in_file_bytes"] = stats.get("dense_in_file_bytes")
    return result
# ------------------------------------------------------------------------------------- continuous batching worker


def mixed_prompts(vocab: int, count: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`count` random prompts (special ids 0-2 avoided), lengths uniform in [prompt_len / 4, 2 x prompt_len]."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, prompt_len // 4), 2 * prompt_len + 1, (count,), generator=gen)
    return [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def cb_unavailable(model) -> str | None:
    """Why transformers' continuous batching cannot run on `model` (None: it can). Its scheduler needs a paged
    attention: sdpa, "paged|eager" (what it switches eager to) or a flash implementation."""
    import transformers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not hasattr(model, "generate_batch"):
        return f"transformers {transformers.__version__} has no generate_batch"
    impl = model.config._attn_implementation
    needed = "paged|eager" if impl == "eager" else impl
    if needed != "sdpa" and "flash" not in needed and needed != "paged|eager":
        return f"continuous batching needs sdpa, paged|eager or flash attention; the model uses {impl!r}"
    if needed not in ALL_ATTENTION_FUNCTIONS and needed != "sdpa":
        return f"attention implementation {needed!r} (needed by continuous batching) is not registered here"
    return None


class ForwardEvictor:
    """A forward pre-hook that drops the files' pages before every forward pass (generate_batch has no stopping
    criteria to hook per step), counting the passes and the time the eviction took (excluded from timings)."""

    def __init__(self, files: list[Path] | None):
        self.files, self.calls, self.seconds = files, 0, 0.0

    def __call__(self, module, args) -> None:
        start = time.perf_counter()
        if self.files:
            evict_from_page_cache(self.files)
        self.calls += 1
        self.seconds += time.perf_counter() - start


def greedy_config(new_tokens: int):
    """Greedy, exactly `new_tokens` per prompt: eos -1 is generate_batch's own "disabled" value (generate warns
    about it once but honours it), so no prompt stops early in either mode."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def static_batches(model, prompts: list[list[int]], batch: int, config) -> list[list[int]]:
    """Greedy `generate` over `prompts` in batches of `batch`, left-padded; each prompt's new tokens."""
    import torch

    tokens = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
        tokens += out[:, width:].tolist()
    return tokens


def cb_config(prompts: list[list[int]], new_tokens: int, page_size: int = 256):
    """A paged KV cache just large enough for every prompt at once (blocks of `page_size` tokens). Left to itself
    it takes 90% of the free RAM (8-9 GiB here, zeroed before the first token). The token budget per pass is left
    to transformers or the library."""
    from transformers import ContinuousBatchingConfig

    blocks = sum(-(-(len(p) + new_tokens) // page_size) for p in prompts)
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=blocks + 1)


def continuous(model, prompts: list[list[int]], config, batching=None) -> list[list[int]]:
    """transformers' `generate_batch` over every prompt at once; each prompt's new tokens, in prompt order. It logs
    a failure instead of raising, so missing or failed requests are raised here. Its warm-up (CUDA graph capture,
    dummy batches) is off: on the CPU it captures nothing and took longer than the tiny run itself. `batching`: a
    `ContinuousBatchingConfig` (default `cb_config`: transformers chooses the tokens per pass)."""
    outputs = list(model.generate_batch(prompts, generation_config=config, continuous_batching_config=
                                        batching or cb_config(prompts, config.max_new_tokens), progress_bar=False,
                                        warmup=False).values())
    failed = [o.error for o in outputs if o.error is not None]
    if len(outputs) != len(prompts) or failed:
        raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(prompts)} requests; errors: {failed[:3]}")
    return [list(o.generated_tokens) for o in outputs]


def timed_mode(mode: str, run: Callable[[], list[list[int]]], evictor: ForwardEvictor, prompts: list[list[int]],
               stats: Callable[[], dict] | None) -> dict[str, Any]:
    """Run one mode cold (page cache evicted first) and measure it: generated and total tokens/s (eviction time
    excluded), disk bytes per generated token, forward passes, hf_moe_offload's bytes moved and schedules."""
    evictor(None, None)
    evictor.calls, evictor.seconds = 0, 0.0
    before = stats() if stats else None
    reads0, start = proc_read_bytes(), time.perf_counter()
    tokens = run()
    wall = time.perf_counter() - start - evictor.seconds
    reads, generated = proc_read_bytes() - reads0, sum(map(len, tokens))
    result = {"mode": mode, "wall_s": wall, "evict_s": evictor.seconds, "forwards": evictor.calls,
              "prompt_tokens": sum(map(len, prompts)), "generated_tokens": generated, "tok_s": generated / wall,
              "total_tok_s": (generated + sum(map(len, prompts))) / wall, "read_bytes": reads,
              "read_bytes_per_token": reads / generated, "tokens": tokens}
    if stats:
        after = stats()
        moved = after["bytes_to_device"] - before["bytes_to_device"]
        result["ours"] = {"bytes_to_device": moved, "bytes_to_device_per_token": moved / generated,
                          "schedule": {k: after[k] for k in SCHEDULE_KEYS if k in after}}
    return result


def run_cb_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The generate_batch row for one system: continuous batching over mixed-length prompts, then static-batch
    `generate` over the same prompts, same model, page cache evicted before every forward pass."""
    import torch

    if spec["threads"] > 0:
        torch.set_num_threads(spec["threads"])
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)    # a dozen INFO lines per call
    path = Path(spec["checkpoint"])
    files = checkpoint_files(path)
    if spec["evict"]:
        evict_from_page_cache(files)
    model, extra = load_system(spec, path, Path(spec["offload_folder"]))
    row = {k: spec[k] for k in ("system", "batch", "evict", "device", "store", "cap_bytes")}
    if why := cb_unavailable(model):
        return {**row, "skipped": why}
    prompts = mixed_prompts(spec["vocab"], spec["cb_prompts"], spec["prompt_len"], spec["seed"])
    config = greedy_config(spec["new_tokens"])
    evictor = ForwardEvictor((files + extra) if spec["evict"] else None)
    model.register_forward_pre_hook(evictor)
    stats = None
    if spec["system"] in POLICIES:
        import hf_moe_offload

        stats = lambda: dict(hf_moe_offload.stats(model))  # noqa: E731
    continuous(model, prompts[:2], greedy_config(1))         # untimed: one-time costs of both paths
    static_batches(model, prompts[:2], 2, greedy_config(1))
    from hf_moe_offload.attention.packed import runs_packed

    # an offloaded model runs sdpa's continuous batching request by request (packed attention): its mode says so,
    # and the resident row runs it too, as the token reference with the same attention arithmetic
    packed = runs_packed(model)
    name = "continuous, packed attention" if packed and stats is not None else "continuous"
    # generate_batch's thread writes tensors in place: no inference_mode around it (it runs under no_grad)
    modes = [timed_mode(name, lambda: continuous(model, prompts, config), evictor, prompts, stats)]
    if packed and stats is None:
        modes.append(timed_mode("continuous, packed attention", lambda: packed_continuous(model, prompts, config),
                                evictor, prompts, stats))
    if stats is not None:      # the library's token budget (measured pass costs), sized before the timed run
        sized = library_batching(model, prompts, config.max_new_tokens)
        row["library_batching"] = sized
        modes.append(timed_mode(f"continuous, offload_batching_config ({sized['max_batch_tokens']} tokens/pass)",
                                lambda: continuous(model, prompts, config, sized["config"]), evictor, prompts,
                                stats))
        del sized["config"]
        # what a user's plain call does: the library sizes the budget and the KV cache (sizing inside the timing)
        modes.append(timed_mode("continuous, no config given", lambda: plain_continuous(model, prompts, config),
                                evictor, prompts, stats))
    modes.append(timed_mode(f"static, batch {spec['batch']}",
                            lambda: static_batches(model, prompts, spec["batch"], config), evictor, prompts, stats))
    return {**row, "prompts": len(prompts), "modes": modes, "peak_rss_bytes": peak_rss_bytes()}


def packed_continuous(model, prompts: list[list[int]], config) -> list[list[int]]:
    """`continuous` with hf_moe_offload's packed attention on a model that is not offloaded (the resident row):
    what an offloaded model's `generate_batch` runs in place of sdpa over a dense mask."""
    from hf_moe_offload.attention.packed import use_packed_attention

    init = model.init_continuous_batching

    def init_packed(*args, **kwargs):
        manager = init(*args, **kwargs)
        use_packed_attention(model, manager)
        return manager

    model.init_continuous_batching = init_packed
    try:
        return continuous(model, prompts, config)
    finally:
        del model.init_continuous_batching          # the class's method again


def plain_continuous(model, prompts: list[list[int]], config) -> list[list[int]]:
    """`generate_batch` with no `ContinuousBatchingConfig`: an offloaded model sizes it by itself."""
    outputs = list(model.generate_batch(prompts, generation_config=config, progress_bar=False,
                                        warmup=False).values())
    failed = [o.error for o in outputs if o.error is not None]
    if len(outputs) != len(prompts) or failed:
        raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(prompts)} requests; errors: {failed[:3]}")
    return [list(o.generated_tokens) for o in outputs]


def library_batching(model, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """`offload_batching_config` on the benchmark's KV cache (`cb_config`): the tokens per pass it picks, the pass
    costs it measured (R, alpha) and the seconds that took."""
    from hf_moe_offload.batching.config import offload_batching_config, token_budget

    base = cb_config(prompts, new_tokens)
    start = time.perf_counter()
    budget = token_budget(model, base.page_size)
    config = offload_batching_config(model, base=base, pass_costs=budget.costs)
    costs = budget.costs
    from hf_moe_offload.attention.packed import runs_packed

    return {"config": config, "attention": "packed" if runs_packed(model) else model.config._attn_implementation,
            "max_batch_tokens": config.max_batch_tokens, "memory_tokens": budget.memory_tokens,
            "amortizing_tokens": budget.amortizing_tokens, "sizing_s": time.perf_counter() - start,
            "pass_costs": None if costs is None else {
                "fixed_s": costs.fixed_s, "attention_s_per_entry": costs.attention_s_per_entry,
                "moved_bytes": costs.moved_bytes, "bytes_per_s": costs.bytes_per_s, "rate_source": costs.rate_source}}


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]                       # idle + iowait
    total = sum(values[:8])                            # guest time is already inside user/nice
    return total - idle, total


def busy_share(seconds: float) -> float:
    """Share of all cores busy over the next `seconds` (anything running, this process is idle meanwhile)."""
    busy0, total0 = cpu_jiffies()
    time.sleep(seconds)
    busy1, total1 = cpu_jiffies()
    return (busy1 - busy0) / max(1, total1 - total0)


def wait_for_idle(max_wait_s: float, threshold: float = 0.15, window_s: float = 3.0) -> float:
    """Wait (at most `max_wait_s`) until other work leaves the CPUs mostly idle; returns the seconds waited.
    The machine may be shared: a concurrent job halves the cores and makes torch's threads contend."""
    start = time.perf_counter()
    while True:
        share = busy_share(window_s)
        waited = time.perf_counter() - start
        if share < threshold or waited >= max_wait_s:
            if share >= threshold:
                log.warning("CPUs still %.0f%% busy with other work after %.0f s; running anyway", 100 * share,
                            waited)
            return waited
        log.info("CPUs %.0f%% busy with other work; waiting (%.0f/%.0f s)", 100 * share, waited, max_wait_s)


def spawn_worker(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run `run_worker(spec)` in a fresh Python process and return its result, with the share of the machine's CPU
    time that other processes used meanwhile (`foreign_cpu_share`: 0 = we had the machine to ourselves). A worker
    that fails or times out gives its row with an `error` instead (an unattended run goes on)."""
    with tempfile.TemporaryDirectory(prefix="bench_worker_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), "--worker-out",
               str(out_path)]
        own0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy0, total0 = cpu_jiffies()
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=timeout_s)
            error = None if proc.returncode == 0 else f"worker exited with status {proc.returncode}"
        except subprocess.TimeoutExpired:
            error = f"worker timed out after {timeout_s:.0f} s"
        if error is not None:
            log.error("%s at batch %d (store %s): %s", spec["system"], spec["batch"], spec["store"], error)
            return {**{k: spec[k] for k in ("system", "batch", "evict", "device", "store", "cap_bytes")},
                    "error": error}
        wall = time.perf_counter() - start
        busy1, total1 = cpu_jiffies()
        own1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = json.loads(out_path.read_text())
        tick = os.sysconf("SC_CLK_TCK")
        own_s = (own1.ru_utime - own0.ru_utime) + (own1.ru_stime - own0.ru_stime)
        result["process_wall_s"] = wall
        result["worker_cpu_s"] = own_s
        result["foreign_cpu_share"] = max(0.0, (busy1 - busy0) / tick - own_s) / max(1e-9, (total1 - total0) / tick)
        return result


# ---------------------------------------------------------------------------------------------------------- report


def succeeded(results: list[dict]) -> list[dict]:
    return [r for r in results if "error" not in r]


def compare_tokens(results: list[dict]) -> None:
    """Add `tokens_match` / `mismatched_tokens` against the reference at the same batch size (in place): `resident`
    where it ran, else the first `accelerate` row (its placement does not change the arithmetic)."""
    reference: dict[int, dict] = {}
    for system in ("accelerate", "resident"):        # resident last: it wins where both ran
        reference.update({r["batch"]: r for r in reversed(succeeded(results)) if r["system"] == system})
    for r in succeeded(results):
        ref = reference.get(r["batch"])
        if ref is None or ref is r:
            r["tokens_match"], r["reference"] = None, None
            continue
        pairs = [(i, a, b) for row_a, row_b in zip(r["tokens"], ref["tokens"]) for i, (a, b) in
                 enumerate(zip(row_a, row_b))]
        mismatched = [i for i, a, b in pairs if a != b]
        r["reference"] = ref["system"]
        r["mismatched_tokens"] = len(mismatched)
        r["first_mismatch_step"] = min(mismatched, default=None)
        r["tokens_match"] = not mismatched


def must_move_bytes_per_token(r: dict) -> float:
    """Bytes per generated token that must cross the row's slowest link: hf_moe_offload's cache misses;
    accelerate on the GPU: every offloaded weight once per forward (one forward per step for the whole batch);
    accelerate on the CPU: what it really read from the disk."""
    if "ours" in r:
        return r["ours"]["bytes_to_device_per_token"]
    if r.get("device") == "cuda":
        return r["offloaded_bytes_per_step"] / r["batch"]
    return r["read_bytes_per_token"]


def link_bandwidth(r: dict, disk_bytes_per_s: float) -> float | None:
    """The slowest link the row's bytes cross: the disk when its store is the disk and the page cache is evicted,
    pinned host-to-device on CUDA (measured in the row's worker). None: nothing has to move."""
    links = []
    if r["system"] != "resident" and r.get("store", "disk") == "disk" and r["evict"]:
        links.append(disk_bytes_per_s)
    if r.get("device") == "cuda" and r["system"] != "resident":
        links.append(r["h2d"]["bytes_per_s"])
    return min(links, default=None)


def add_ceilings(results: list[dict], disk_bytes_per_s: float) -> None:
    """Bound: tokens/s if the bytes that must move per token streamed at the slowest link's bandwidth (in place)."""
    for r in succeeded(results):
        must_move = 0 if r["system"] == "resident" else must_move_bytes_per_token(r)
        bandwidth = link_bandwidth(r, disk_bytes_per_s)
        r["must_move_bytes_per_token"], r["bound_bandwidth_bytes_per_s"] = must_move, bandwidth
        r["io_ceiling_tok_s"] = bandwidth / must_move if bandwidth and must_move > 0 else None


def resident_set_floor(experts_touched: int, cache_slots: int, one_expert_bytes: int) -> int:
    """Bytes a pass must read at least: each touched expert beyond the cache's slots, once (for a pass that touches
    every expert: (1 - cache share) x expert bytes, what a fixed resident set reads). A pass that leaves experts
    untouched is held to a resident set re-chosen for it, for free: a lower bound no cache reaches there
    (`fixed_set_floor` is the best fixed set's)."""
    return max(0, experts_touched - cache_slots) * one_expert_bytes


def fixed_set_floor(steps_touched: list[list[list[int]]], cache_slots: int, one_expert_bytes: int) -> list[int]:
    """Bytes each step must read if the cache held the best FIXED resident set for the whole run: the `cache_slots`
    experts touched in the most steps (chosen with hindsight). Each step reads its touched experts outside that set.
    Between `resident_set_floor` (a set re-chosen every step, for free) and (1 - cache share) x expert bytes (every
    expert touched every step): at small batches a step leaves some experts untouched, resident ones included.

    Example:
        >>> fixed_set_floor([[[0, 0], [0, 1]], [[0, 0], [0, 2]]], cache_slots=1, one_expert_bytes=10)
        [10, 10]
    """
    counts: dict[tuple[int, int], int] = {}
    for pairs in steps_touched:
        for layer, expert in pairs:
            counts[layer, expert] = counts.get((layer, expert), 0) + 1
    kept = set(sorted(counts, key=lambda key: (-counts[key], key))[:cache_slots])
    return [sum((layer, expert) not in kept for layer, expert in pairs) * one_expert_bytes for pairs in steps_touched]


def fixed_floors(r: dict, one_expert_bytes: int) -> list[int] | None:
    """An hf_moe_offload row's fixed-resident-set floor per decode step (None: not recorded)."""
    ours = r.get("ours") or {}
    touched = ours.get("decode_step_experts_touched")
    if not touched:
        return None
    one_expert_bytes = ours.get("expert_bytes", one_expert_bytes)
    return fixed_set_floor(touched, ours["cache_capacity_bytes"] // one_expert_bytes, one_expert_bytes)


def floors(r: dict, one_expert_bytes: int) -> tuple[list[int], int] | None:
    """An hf_moe_offload row's resident-set floor per decode step and for the prefill, from its own routing
    (None: not an hf_moe_offload row, or a run saved before the routing was recorded)."""
    ours = r.get("ours") or {}
    if "decode_step_experts_used" not in ours:
        return None
    one_expert_bytes = ours.get("expert_bytes", one_expert_bytes)     # a quantized row's own expert size
    slots = ours["cache_capacity_bytes"] // one_expert_bytes
    steps = [resident_set_floor(used, slots, one_expert_bytes) for used in ours["decode_step_experts_used"]]
    return steps, resident_set_floor(ours["prefill_experts_used"], slots, one_expert_bytes)


def same_setting(results: list[dict], r: dict, system: str) -> dict | None:
    """The row of `system` at `r`'s batch and cap (and store, except for resident), if it ran."""
    return next((x for x in succeeded(results) if x["system"] == system and x["batch"] == r["batch"]
                 and x.get("cap_bytes") == r.get("cap_bytes")
                 and (system == "resident" or x.get("store") == r.get("store"))), None)


def must_move_per_pass(r: dict, one_expert_bytes: int) -> tuple[float, float, str] | None:
    """(decode bytes per step, prefill bytes) that must cross the row's slowest link, and on what basis."""
    if r["system"] == "resident":
        return 0.0, 0.0, "nothing offloaded"
    if r["system"] == "accelerate":
        off = r.get("offloaded_bytes_per_step")               # older runs did not record it
        return None if off is None else (off, off, "accelerate's hooks load every offloaded weight once per forward")
    found = floors(r, one_expert_bytes)
    if found is None:
        return None
    steps, prefill = found
    return statistics.fmean(steps), prefill, "resident-set floor from the row's routing: (experts touched - slots) x expert bytes"


def pass_bound(tokens: float, compute_s: float, must_move: float, bandwidth: float | None) -> float:
    """The bound for one pass: tokens / max(compute time, bytes that must move / bandwidth)."""
    io_s = must_move / bandwidth if bandwidth else 0.0
    return tokens / max(compute_s, io_s)


def row_bound(results: list[dict], r: dict, one_expert_bytes: int, store_bytes_per_s: float | None
              ) -> dict[str, Any] | None:
    """The row's decode and prefill bounds: compute time = the resident row's at the same batch, bandwidth = the
    store-like cold reads (None when no resident row ran or the bytes that must move are unknown)."""
    resident, moved = same_setting(results, r, "resident"), must_move_per_pass(r, one_expert_bytes)
    if resident is None or moved is None or (r["system"] != "resident" and store_bytes_per_s is None):
        return None
    step_bytes, prefill_bytes, basis = moved
    bandwidth = link_bandwidth(r, store_bytes_per_s) if r["system"] != "resident" else None
    compute_s = resident["decode_s"] / resident["decode_steps"]
    decode = pass_bound(r["batch"], compute_s, step_bytes, bandwidth)
    prefill = None
    if "prefill_tok_s" in r:                               # older runs recorded no prefill speed
        prefill = pass_bound(r["prefill_tok_s"] * r["prefill_s"], resident["prefill_s"], prefill_bytes, bandwidth)
    return {"decode_tok_s": decode, "decode_over_bound": r["decode_tok_s"] / decode,
            "prefill_tok_s": prefill, "prefill_over_bound": prefill and r["prefill_tok_s"] / prefill,
            "compute_step_s": compute_s, "compute_basis": f"resident row's mean decode step at batch {r['batch']}",
            "must_move_bytes_per_step": step_bytes, "must_move_prefill_bytes": prefill_bytes,
            "must_move_basis": basis, "bandwidth_bytes_per_s": bandwidth,
            "bandwidth_basis": "store-like cold reads (pread per expert tensor, page cache evicted), best sample"}


def add_bounds(results: list[dict], one_expert_bytes: int, store_bytes_per_s: float | None,
               median_bytes_per_s: float | None = None) -> None:
    """Per row (in place): the bound and the share of it reached, disk bytes per decode step beside the
    resident-set floor, and decode/prefill speed relative to accelerate at the same batch. The bound takes the best
    bandwidth sample (the physical limit); this disk swings 2x between samples, so the share of the bound at the
    median sample is recorded beside it (`decode_over_median_bound`)."""
    for r in succeeded(results):
        r["bound"] = row_bound(results, r, one_expert_bytes, store_bytes_per_s)
        if r["bound"] is not None and median_bytes_per_s and r["system"] != "resident":
            median = row_bound(results, r, one_expert_bytes, median_bytes_per_s)
            r["bound"]["median_bandwidth_bytes_per_s"] = median_bytes_per_s
            r["bound"]["decode_over_median_bound"] = median["decode_over_bound"]
        r["read_bytes_per_step"] = r["decode_read_bytes"] / r["decode_steps"]
        found = floors(r, one_expert_bytes)
        r["floor_bytes_per_step"] = statistics.fmean(found[0]) if found else None
        r["bytes_over_floor"] = r["decode_read_bytes"] / sum(found[0]) if found and sum(found[0]) else None
        fixed = fixed_floors(r, one_expert_bytes)
        r["fixed_floor_bytes_per_step"] = statistics.fmean(fixed) if fixed else None
        r["bytes_over_fixed_floor"] = r["decode_read_bytes"] / sum(fixed) if fixed and sum(fixed) else None
        acc = same_setting(results, r, "accelerate")
        r["vs_accelerate"] = r["decode_tok_s"] / acc["decode_tok_s"] if acc and acc is not r else None
        r["prefill_vs_accelerate"] = r["prefill_tok_s"] / acc["prefill_tok_s"] \
            if acc and acc is not r and "prefill_tok_s" in r else None


def memory_read_bandwidth(threads: int) -> dict[str, float]:
    """Weight bytes/s this machine reads at `threads` threads (`planning.measure.weight_read_rates`): a streaming
    read, and one-row bf16/int8/int4 products."""
    import torch

    from hf_moe_offload.planning.measure import weight_read_rates

    rates = weight_read_rates(threads=(threads or torch.get_num_threads(),))
    return {kind.rsplit("_", 1)[0]: rate for kind, rate in rates.items()}


def add_weight_reads(results: list[dict], shape: ModelShape, memory: dict[str, float]) -> None:
    """Per row (in place): the weight bytes a decode step reads (every non-expert weight but the embedding, plus
    the experts a step of `batch` tokens touches under uniform routing), the rate it read them at, and the decode
    rate if they streamed at the measured memory read bandwidth (the bound when the model fits in RAM)."""
    embedding = 2 * shape.vocab * shape.hidden
    for r in succeeded(results):
        touched = touched_share(shape, r["batch"]) * shape.experts * shape.layers
        nbytes = shape.non_expert_bytes() - embedding + touched * shape.one_expert_bytes()
        step_s = r["decode_s"] / max(1, r["decode_steps"])
        r["weight_bytes_per_step"] = nbytes
        r["weight_bytes_per_s"] = nbytes / step_s
        r["memory_bound_tok_s"] = r["batch"] * memory["stream"] / nbytes
        r["decode_over_memory_bound"] = r["decode_tok_s"] / r["memory_bound_tok_s"]


def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def row_order(r: dict) -> tuple:
    return (r["batch"], r.get("cap_bytes") or 0, r.get("store") or "", SYSTEMS.index(r["system"]))


def ratio(x: float | None) -> str:
    return fmt(x, ".2f")


def mb(x: float | None) -> str:
    return fmt(None if x is None else x / 1e6, ".1f")


def markdown_table(results: list[dict]) -> str:
    """One line per row. bound: the (batch / max(resident step time, bytes that must move per step / store-like
    read bandwidth)); I/O ceiling: the older per-token one (sequential bandwidth / bytes moved per token)."""
    header = ("| system | store | cap GiB | batch | load s | prefill tok/s | prefill / bound | decode tok/s | "
              "bound tok/s | decode / bound | decode / bound at median bw | vs accelerate | I/O ceiling tok/s | "
              "disk MB/step | floor MB/step | disk / floor | disk / fixed-set floor | disk busy | GB/s while busy | disk MB/token | moved MB/token | hit rate | peak RSS GiB | peak device GiB | "
              "weight MB/step | weight GB/s | / memory bound | greedy tokens = ref | other CPU load |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in sorted(results, key=row_order):
        cap = fmt(r["cap_bytes"] / GiB if r.get("cap_bytes") else None, "g")
        if "error" in r:
            lines.append(f"| {r['system']} | {r.get('store') or '–'} | {cap} | {r['batch']} | failed: {r['error']} |")
            continue
        ours, bound = r.get("ours"), r.get("bound") or {}
        busy = ours["decode"] if ours else {}           # the store's read clock (absent in older runs)
        ref = r.get("reference", "resident")           # runs before `reference` was recorded compared to resident
        match = "ref" if r.get("tokens_match") is None else (
            f"yes ({ref})" if r["tokens_match"] else
            f"no ({r['mismatched_tokens']} of {r['decode_tokens'] + r['batch']} differ from {ref}"
            + (f", first at step {r['first_mismatch_step']})" if r.get("first_mismatch_step") is not None else ")"))
        lines.append("| " + " | ".join([
            r["system"], r.get("store") or "–", cap, str(r["batch"]), f"{r['load_s']:.1f}",
            fmt(r.get("prefill_tok_s"), ".1f"), ratio(bound.get("prefill_over_bound")), f"{r['decode_tok_s']:.2f}",
            fmt(bound.get("decode_tok_s"), ".2f"), ratio(bound.get("decode_over_bound")),
            ratio(bound.get("decode_over_median_bound")), ratio(r.get("vs_accelerate")),
            fmt(r["io_ceiling_tok_s"], ".2f"), mb(r.get("read_bytes_per_step")), mb(r.get("floor_bytes_per_step")),
            ratio(r.get("bytes_over_floor")), ratio(r.get("bytes_over_fixed_floor")),
            fmt(busy.get("read_busy_share"), ".0%"),
            fmt(busy["read_bytes_per_busy_s"] / 1e9 if busy.get("read_bytes_per_busy_s") else None, ".2f"),
            f"{r['read_bytes_per_token'] / 1e6:.1f}",
            mb(r["must_move_bytes_per_token"]), fmt(ours["decode_hit_rate"] if ours else None, ".0%"),
            f"{r['peak_rss_bytes'] / 2**30:.2f}",
            fmt(r["peak_device_bytes"] / GiB if r.get("peak_device_bytes") else None, ".2f"),
            mb(r.get("weight_bytes_per_step")),
            fmt(r["weight_bytes_per_s"] / 1e9 if r.get("weight_bytes_per_s") else None, ".1f"),
            ratio(r.get("decode_over_memory_bound")), match,
            f"{r['foreign_cpu_share']:.0%}",
        ]) + " |")
    return "\n".join(lines)


def cb_table(batching: dict[str, Any]) -> str:
    """The generate_batch comparison: one line per system and mode (skipped or failed systems say why)."""
    header = ("| system | mode | prompts | generated tok/s | bound tok/s (share) | prompt + generated tok/s | "
              "vs static | forwards | disk MB/token | moved MB/token | peak RSS GiB | greedy tokens = resident |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in batching["rows"]:
        if "modes" not in r:
            lines.append(f"| {r['system']} | {'skipped' if 'skipped' in r else 'failed'}: "
                         f"{r.get('skipped') or r.get('error')} |")
            continue
        static = r["modes"][-1]
        for m in r["modes"]:
            moved = m["ours"]["bytes_to_device_per_token"] if "ours" in m else None
            match = {None: "ref" if r["system"] == "resident" else "–", True: "yes", False: "no"}[m["tokens_match"]]
            bound = m.get("bound")
            bound_cell = f"{bound['tok_s']:.2f} ({bound['over_bound']:.2f})" if bound else "–"
            lines.append("| " + " | ".join([
                r["system"], m["mode"], str(r["prompts"]), f"{m['tok_s']:.2f}", bound_cell, f"{m['total_tok_s']:.1f}",
                ratio(m["tok_s"] / static["tok_s"]), str(m["forwards"]), mb(m["read_bytes_per_token"]), mb(moved),
                f"{r['peak_rss_bytes'] / GiB:.2f}", match]) + " |")
    return "\n".join(lines)


COLORS = {"resident": "#7f7f7f", "accelerate": "#d62728", "hf_moe_offload": "#1f77b4",
          "hf_moe_offload_layer": "#2ca02c", "hf_moe_offload_int8": "#9467bd", "hf_moe_offload_int4": "#ff7f0e",
          "hf_moe_offload_int8_same_bytes": "#8c564b", "hf_moe_offload_int4_same_bytes": "#e377c2",
          "hf_moe_offload_lookahead": "#17becf", "hf_moe_offload_cpu_compute": "#bcbd22",
          "hf_moe_offload_auto_compute": "#393b79", "hf_moe_offload_readahead": "#637939",
          "hf_moe_offload_cpu_attention": "#843c39", "hf_moe_offload_cpu_attention_mb2": "#d6616b",
          "hf_moe_offload_cpu_store": "#7b4173", "hf_moe_offload_direct": "#e6550d"}
CACHE_COLORS = {"hf_moe_offload": "#9ecae1", "hf_moe_offload_layer": "#a1d99b", "hf_moe_offload_int8": "#c5b0d5",
                "hf_moe_offload_int4": "#ffbb78", "hf_moe_offload_int8_same_bytes": "#c49c94",
                "hf_moe_offload_int4_same_bytes": "#f7b6d2", "hf_moe_offload_lookahead": "#9edae5",
                "hf_moe_offload_cpu_compute": "#dbdb8d", "hf_moe_offload_auto_compute": "#6b6ecf",
                "hf_moe_offload_readahead": "#b5cf6b", "hf_moe_offload_cpu_attention": "#ad494a",
                "hf_moe_offload_cpu_attention_mb2": "#e7969c", "hf_moe_offload_cpu_store": "#a55194",
                "hf_moe_offload_direct": "#fdae6b"}
Group = tuple[int, "str | None", "int | None"]       # (batch, store, cap bytes)


def row_groups(results: list[dict]) -> list[Group]:
    """One bar group per (batch, store, cap) of the offloading rows (resident joins every store's group)."""
    offloading = [r for r in results if r["system"] != "resident"] or results
    keys = {(r["batch"], r.get("store"), r.get("cap_bytes")) for r in offloading}
    return sorted(keys, key=lambda k: (k[0], k[2] or 0, k[1] or ""))


def group_label(group: Group) -> str:
    batch, store, cap = group
    return f"batch {batch}" if cap is None else f"batch {batch}\n{store} store, {cap / GiB:g} GiB"


def row_in(results: list[dict], system: str, group: Group) -> dict | None:
    batch, store, cap = group
    return next((r for r in results if r["system"] == system and r["batch"] == batch and r.get("cap_bytes") == cap
                 and (system == "resident" or r.get("store") == store)), None)


def grouped_bars(ax, groups: list[Group], series: list[tuple[str, list[float], str, str | None]]
                 ) -> list[list[float]]:
    """One group of bars per row group, one bar per (label, values, color, hatch); returns each series' x's."""
    width = 0.8 / len(series)
    all_xs = []
    for j, (label, vals, color, hatch) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, vals, width, label=label, color=color, hatch=hatch, edgecolor="white" if hatch else None)
        ax.bar_label(bars, labels=[f"{v:.1f}" if v >= 1 or v == 0 else f"{v:.2f}" for v in vals], fontsize=8,
                     padding=2)
        all_xs.append(xs)
    ax.set_xticks(range(len(groups)), [group_label(g) for g in groups], fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return all_xs


def decode_panel(ax, results: list[dict], groups: list[Group], systems: list[str]) -> None:
    """Decode tokens/s per system and row group (log scale), with every offloading row's bound as a dashed mark."""
    from matplotlib import ticker

    def values(system: str, key: str) -> list[float]:
        return [(row_in(results, system, g) or {}).get(key) or 0.0 for g in groups]

    xs = grouped_bars(ax, groups, [(s, values(s, "decode_tok_s"), COLORS[s], None) for s in systems])
    width = 0.8 / len(systems)
    for system in [s for s in systems if s != "resident"]:
        for x, c in zip(xs[systems.index(system)], values(system, "io_ceiling_tok_s")):
            if c:
                ax.hlines(c, x - width / 2, x + width / 2, colors="black", linestyles="--", linewidth=1.5,
                          label="bound (slowest link's bandwidth / bytes moved per token)")
                ax.annotate(f"{c:.1f}", (x, c), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    ax.set_yscale("log")      # resident and offloading systems differ by an order of magnitude or more
    top = max([r["decode_tok_s"] for r in results] + [r.get("io_ceiling_tok_s") or 0 for r in results])
    ax.set_ylim(top=top * 2)
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
    ax.set_ylabel("decode tokens/s, log scale (higher is better)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))          # one entry for all the bound marks
    ax.legend(unique.values(), unique.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8,
              frameon=False)


def bytes_panel(ax, results: list[dict], groups: list[Group], systems: list[str]) -> None:
    """CPU: MB read from disk per generated token, plus the MB hf_moe_offload copied into its cache per token."""
    def values(system: str, get: Callable[[dict], float]) -> list[float]:
        return [get(r) if (r := row_in(results, system, g)) else 0.0 for g in groups]

    series = [(f"{s}: read from disk", values(s, lambda r: r["read_bytes_per_token"] / 1e6), COLORS[s], None)
              for s in systems]
    series += [(f"{s}: copied into its cache", values(s, lambda r: r["ours"]["bytes_to_device_per_token"] / 1e6),
                CACHE_COLORS[s], "//") for s in systems if s in POLICIES]
    grouped_bars(ax, groups, series)
    ax.margins(y=0.12)
    ax.set_ylabel("MB per generated token (lower is better)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)


def prefill_panel(ax, results: list[dict], groups: list[Group], systems: list[str]) -> None:
    """CUDA: prefill (prompt) tokens/s per system and row group."""
    series = [(s, [(row_in(results, s, g) or {}).get("prefill_tok_s") or 0.0 for g in groups], COLORS[s], None)
              for s in systems]
    grouped_bars(ax, groups, series)
    ax.set_yscale("log")
    ax.set_ylabel("prefill tokens/s, log scale (higher is better)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)


def plot(results: list[dict], title: str, png: Path) -> None:
    """Left: decode tokens/s with the bounds. Right: bytes per token (CPU) or prefill tokens/s (CUDA)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = succeeded(results)
    groups = row_groups(results)
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in results)]
    cuda = any(r.get("device") == "cuda" for r in results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(12.5, 2.2 * len(groups) * 2), 6.2))
    decode_panel(left, results, groups, systems)
    (prefill_panel if cuda else bytes_panel)(right, results, groups, systems)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
def machine_info(workdir: Path) -> dict[str, Any]:
    import accelerate
    import psutil
    import safetensors
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    real = str(workdir.resolve())
    mount = max((m for m in mounts if real == m[1] or real.startswith(m[1].rstrip("/") + "/")),
                key=lambda m: len(m[1]), default=None)
    readahead = None
    if mount and mount[0].startswith("/dev/"):
        ra = Path(f"/sys/class/block/{Path(mount[0]).name}/queue/read_ahead_kb")
        readahead = int(ra.read_text()) if ra.exists() else None
    return {
        "cpu": cpu, "logical_cores": os.cpu_count(), "torch_default_threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total, "kernel": platform.release(), "python": platform.python_version(),
        "workdir_filesystem": {"device": mount[0], "mountpoint": mount[1], "type": mount[2],
                               "read_ahead_kb": readahead} if mount else None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__, "safetensors": safetensors.__version__},
    }


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty_files": git("status", "--porcelain").splitlines()}


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the 1.5 GB model on the CPU; cuda: Mixtral-8x7B layers on GPU 0 under device-memory caps")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 layers, 16-token prompts, 4 new tokens, 1 warm-up token, one 16 GiB cap")
    p.add_argument("--small", action="store_true", help=f"small shape for a CPU smoke run ({SMALL.tag})")
    p.add_argument("--tiny", action="store_true", help=f"the smallest shape, for tests ({TINY.tag})")
    p.add_argument("--throughput", action="store_true",
                   help="the throughput regime: batches 8 32 128, 64-token prompts, systems resident accelerate "
                        "hf_moe_offload_layer, and generate_batch over 128 mixed-length prompts vs static batches of 32")
    for dim in ("hidden", "intermediate", "layers", "experts", "top-k", "heads", "kv-heads", "vocab"):
        p.add_argument(f"--{dim}", type=int, default=None,
                       help="default: the device's shape (cpu: ModelShape(); cuda: Mixtral-8x7B)"
                       + ("; cuda: as many layers as the work dir's disk holds, at most 32" if dim == "layers" else ""))
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the prompt")
    p.add_argument("--quantize", nargs="+", default=[], choices=QUANTIZATIONS,
                   help="also run hf_moe_offload with experts stored quantized (rows hf_moe_offload_int8 / _int4: "
                        "the default eviction, quantize=int8 or int4 with the default group size), beside the "
                        "dense rows; the quantized folder is written once under --workdir")
    p.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                   help="hf_moe_offload uses eviction='lru' (LRU eviction); hf_moe_offload_layer the library's "
                        "default eviction='layer' (cpu: all four; cuda: resident accelerate hf_moe_offload_layer)")
    p.add_argument("--stores", nargs="+", default=None, choices=("cpu", "disk"),
                   help="cuda: where the offloaded experts live (default: cpu disk); the CPU benchmark reads disk")
    p.add_argument("--caps-gib", type=float, nargs="+", default=None,
                   help="cuda: device-memory caps in GiB (default: 16 24)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default: cpu 1 8, cuda 1 64")
    p.add_argument("--prompt-len", type=int, default=None, help="default: cpu 16, cuda 128")
    p.add_argument("--new-tokens", type=int, default=None, help="default: 16")
    p.add_argument("--cb-prompts", type=int, default=None,
                   help="continuous batching: generate_batch over this many mixed-length prompts (up to twice "
                        "--prompt-len) vs static-batch generate over the same prompts; 0: skip (default; "
                        "--throughput: 128)")
    p.add_argument("--cb-static-batch", type=int, default=None,
                   help="batch size of the static generate that generate_batch is compared with (default 32)")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="tokens of an untimed generate (other prompt) before the measured one; 0 to skip (default 2)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker; 0: torch's default. cpu default 1 (on a small shared machine two "
                        "OpenMP threads contending with other work run several times slower; hf_moe_offload's copy "
                        "thread also needs a core); cuda default 0")
    p.add_argument("--no-evict", action="store_true",
                   help="keep the page cache warm (no posix_fadvise eviction before the run and after every step)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hf_moe_offload_bench"),
                   help="where the random checkpoint and accelerate's offload folder live")
    p.add_argument("--out", type=Path, default=None,
                   help="output path without extension (default: benchmarks/results/cpu_mixtral_1.5gb[_warm], "
                        "cpu_mixtral_small / _tiny, or gpu_mixtral8x7b_<gpu name>[_quick][_warm]); with --out, each row is "
                        "also appended to <out>.rows.jsonl as it finishes, removed once the report is written")
    p.add_argument("--idle-wait", type=float, default=None,
                   help="before each row, wait up to this many seconds for other work to leave the CPUs idle "
                        "(0: don't wait; default: cpu 30, cuda 0); the share of CPU other processes used during "
                        "each run is reported")
    p.add_argument("--worker-timeout", type=float, default=1800)
    p.add_argument("--from-json", type=Path, default=None,
                   help="don't run: re-render the table and the PNG from an earlier run's JSON")
    p.add_argument("--suite", choices=("cpu",), default=None,
                   help="cpu: every CPU regime in one sitting (scripts/bench_suite.py): the disk regime's batch 1, "
                        "32 and 128 rows, the memory-cap rows (scripts/bench_memcap.py) and the in-RAM CPU kernels "
                        "(scripts/bench_cpu_kernels.py), each beside the planner's prediction; --quick: the small "
                        "model, few tokens; --out, --workdir apply; writes OUT.json, OUT.md, OUT.png (default "
                        "benchmarks/results/cpu_suite[_quick])")
    p.add_argument("--profile", default=None,
                   help="--suite: the machine profile for the planner's predictions (a JSON from `hf-moe-offload "
                        "profile --out FILE`; default: this machine, measured at the start at one thread and written "
                        "beside OUT)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    return fill_defaults(p.parse_args(argv))


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Unset flags take the device's defaults, then --quick's or --throughput's (flags given on the command line
    win)."""
    defaults = {**DEVICE_DEFAULTS[args.device], **(QUICK if args.quick else {}),
                **(THROUGHPUT if args.throughput else {})}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.systems = list(args.systems) + [f"hf_moe_offload_{q}" for q in args.quantize
                                         if f"hf_moe_offload_{q}" not in args.systems]
    return args


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    """The preset (--tiny, --small) or the device's base shape with the dimensions given on the command line."""
    if args.tiny or args.small:
        return TINY if args.tiny else SMALL
    base = MIXTRAL_8X7B if args.device == "cuda" else ModelShape()
    dims = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelShape) if getattr(args, f.name) is not None}
    shape = dataclasses.replace(base, **dims)
    if args.device == "cuda" and args.layers is None:
        copies = 2 if "accelerate" in args.systems and "disk" in args.stores else 1
        shape = dataclasses.replace(shape, layers=default_layers(args.workdir, shape, args.seed, copies))
    return shape


def default_out(args: argparse.Namespace, report: dict[str, Any]) -> Path:
    warm = ("_throughput" if args.throughput else "") + ("_warm" if args.no_evict else "")
    if args.device == "cuda":
        name = (report["machine"]["gpu"] or {"name": "unknown gpu"})["name"]     # None: every row failed
        gpu = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
        name = f"gpu_mixtral8x7b_{gpu}" + ("_quick" if args.quick else "")
    else:
        name = "cpu_mixtral_tiny" if args.tiny else "cpu_mixtral_small" if args.small else "cpu_mixtral_1.5gb"
    return REPO_ROOT / "benchmarks" / "results" / (name + warm)


def cuda_missing() -> str | None:
    """Why `--device cuda` cannot run here (None: it can)."""
    import torch

    if torch.cuda.is_available():
        return None
    build = f"torch {torch.__version__} (CUDA {torch.version.cuda})" if torch.version.cuda else \
        f"torch {torch.__version__} is a CPU-only build"
    return f"--device cuda needs a visible CUDA GPU and a CUDA build of torch; {build}, torch.cuda.is_available() " \
           f"is False"


def worker_spec(args: argparse.Namespace, shape: ModelShape, path: Path, row: dict[str, Any]) -> dict[str, Any]:
    """Everything a worker needs for one row."""
    return {**row, "device": args.device, "evict": not args.no_evict, "checkpoint": str(path),
            "offload_folder": str(args.workdir / "accelerate_offload"), "threads": args.threads,
            "vocab": shape.vocab, "one_expert_bytes": shape.one_expert_bytes(), "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "seed": args.seed, "warmup_tokens": args.warmup_tokens}


def run_rows(args: argparse.Namespace, shape: ModelShape, path: Path, rows: list[dict[str, Any]]
             ) -> list[dict[str, Any]]:
    """Every planned row, one worker process each, in order."""
    from tqdm.auto import tqdm

    results = []
    partial = rows_file(args)          # each finished row at once: a run killed at a time limit keeps them
    for row in tqdm(rows, desc="rows", unit="run"):
        waited = wait_for_idle(args.idle_wait) if args.idle_wait > 0 else 0.0
        log.info("running %s at batch %d (store %s, cap %s, %s page cache)", row["system"], row["batch"],
                 row["store"], fmt(row["cap_bytes"] / GiB if row["cap_bytes"] else None, ".0f"),
                 "warm" if args.no_evict else "evicted")
        r = spawn_worker(worker_spec(args, shape, path, row), args.worker_timeout)
        r["idle_wait_s"] = waited
        r["loadavg_1m_after"] = os.getloadavg()[0]
        if "error" not in r:
            log.info("%s batch %d: prefill %.1f tok/s, decode %.2f tok/s, %.1f MB read/token, peak RSS %.2f GiB",
                     r["system"], r["batch"], r["prefill_tok_s"], r["decode_tok_s"], r["read_bytes_per_token"] / 1e6,
                     r["peak_rss_bytes"] / GiB)
        results.append(r)
        if partial is not None:
            with partial.open("a") as fh:
                fh.write(json.dumps(r) + "\n")
    shutil.rmtree(args.workdir / "accelerate_offload", ignore_errors=True)
    return results


def rows_file(args: argparse.Namespace) -> Path | None:
    """`<out>.rows.jsonl`, started empty, where `run_rows` appends each row as it finishes (only with `--out`); the
    whole report replaces it at the end."""
    if args.out is None:
        return None
    path = args.out.with_name(args.out.name + ".rows.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def run_cb_rows(args: argparse.Namespace, shape: ModelShape, path: Path) -> dict[str, Any]:
    """The generate_batch comparison: one worker per system (resident as the token reference where it is among
    the systems, and each hf_moe_offload system), each running continuous and static batching."""
    systems = [s for s in args.systems if s == "resident" or s in POLICIES]
    rows = []
    for system in systems:
        if args.idle_wait > 0:
            wait_for_idle(args.idle_wait)
        log.info("running %s: generate_batch over %d prompts vs static batches of %d", system, args.cb_prompts,
                 args.cb_static_batch)
        row = row_spec(system, args.cb_static_batch, None if system == "resident" else "disk", None)
        spec = {**worker_spec(args, shape, path, row), "kind": "continuous_batching", "cb_prompts": args.cb_prompts}
        r = spawn_worker(spec, args.worker_timeout)
        if "skipped" in r:
            log.warning("generate_batch row for %s skipped: %s", system, r["skipped"])
        rows.append(r)
    compare_cb_tokens(rows)
    return {"prompts": args.cb_prompts, "prompt_lengths": [max(1, args.prompt_len // 4), 2 * args.prompt_len],
            "new_tokens": args.new_tokens, "static_batch": args.cb_static_batch, "rows": rows}


def compare_cb_tokens(rows: list[dict]) -> None:
    """Each mode's greedy tokens against the resident row's same mode (in place; None: no resident reference)."""
    ran = [r for r in rows if "modes" in r]
    reference = next((r for r in ran if r["system"] == "resident"), None)
    ref_modes = {m["mode"]: m for m in reference["modes"]} if reference else {}
    for r in ran:
        for mode in r["modes"]:     # the library's budget mode has no resident twin (its budget differs): None
            ref = ref_modes.get(mode["mode"])
            mode["tokens_match"] = None if ref is None or r is reference else mode["tokens"] == ref["tokens"]


def add_cb_bounds(batching: dict[str, Any], store_bytes_per_s: float) -> None:
    """Each offloaded continuous mode's bound (in place): its generated tokens over max(compute, reads), compute
    being the resident model's generate_batch over the same prompts (its "continuous, packed attention" wall time)
    and reads the bytes the mode moved at the store-like read rate (as the batch-1 overlap bound, the bytes the row
    read, not a floor). Only for modes with as many forward passes as that reference: another token budget runs
    another number of passes, and the reference's time is then no bound for it."""
    rows = [r for r in batching["rows"] if "modes" in r]
    reference = next((r for r in rows if r["system"] == "resident"), None)
    ref = next((m for m in (reference or {}).get("modes", []) if m["mode"] == "continuous, packed attention"), None)
    for r in rows:
        for m in r["modes"]:
            m.pop("bound", None)                 # a report read again: recomputed
            if r is reference or "ours" not in m or ref is None or not m["mode"].startswith("continuous") \
                    or m["forwards"] != ref["forwards"]:
                continue
            compute = ref["wall_s"]
            read_s = m["ours"]["bytes_to_device"] / store_bytes_per_s
            bound_tok_s = m["generated_tokens"] / max(compute, read_s)
            m["bound"] = {"compute_s": compute, "read_s": read_s, "tok_s": bound_tok_s,
                          "over_bound": m["tok_s"] / bound_tok_s,
                          "basis": "max(resident generate_batch wall time, bytes moved / store-like read rate)"}


def gpu_facts(results: list[dict]) -> dict[str, Any] | None:
    """The GPU as the workers saw it, and the best pinned H2D bandwidth over all of them (None on the CPU)."""
    cuda_rows = [r for r in succeeded(results) if "gpu" in r]
    if not cuda_rows:
        return None
    rates = [x for r in cuda_rows for x in r["h2d"]["runs_bytes_per_s"]]
    return {**cuda_rows[0]["gpu"], "h2d_bytes_per_s": max(rates), "h2d_median_bytes_per_s": statistics.median(rates)}


def run_benchmark(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    load_before = os.getloadavg()
    git_start = git_commit()
    args.workdir.mkdir(parents=True, exist_ok=True)
    shape = shape_from_args(args)
    path = build_checkpoint(shape, args.seed, args.workdir)
    files = checkpoint_files(path)
    bandwidth, store_reads = disk_bandwidth(files), store_read_bandwidth(files)
    rows = plan_rows(args.device, shape, args.systems, args.stores, [int(c * GiB) for c in args.caps_gib],
                     args.batch_sizes, args.prompt_len + args.new_tokens)
    estimates = log_estimates(shape, args, rows, store_reads["bytes_per_s"]) if args.device == "cpu" else None
    results = run_rows(args, shape, path, rows)
    batching = run_cb_rows(args, shape, path) if args.cb_prompts > 0 else None
    compare_tokens(results)
    # again at the end: the disk may be shared
    bandwidth = combine_bandwidth(bandwidth, disk_bandwidth(files))
    store_reads = combine_bandwidth(store_reads, store_read_bandwidth(files))
    add_ceilings(results, bandwidth["bytes_per_s"])
    add_bounds(results, shape.one_expert_bytes(), store_reads["bytes_per_s"], store_reads["median_bytes_per_s"])
    if batching:
        add_cb_bounds(batching, store_reads["bytes_per_s"])
    memory = memory_read_bandwidth(args.threads) if args.device == "cpu" else None
    if memory:
        add_weight_reads(results, shape, memory)
    meta = json.loads((path / MARKER).read_text())
    return {
        "command": shlex.join(["python", "scripts/bench.py", *argv]),
        "git": git_start,
        "git_at_end": git_commit(),   # differs from "git" if the library changed during the run
        "machine": {**machine_info(args.workdir), "gpu": gpu_facts(results)},
        "model": {**meta, "checkpoint": str(path), "expert_bytes": shape.expert_bytes(),
                  "one_expert_bytes": shape.one_expert_bytes(), "non_expert_bytes": shape.non_expert_bytes()},
        "settings": {"device": args.device, "batch_sizes": args.batch_sizes, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "warmup_tokens": args.warmup_tokens, "systems": args.systems,
                     "stores": args.stores if args.device == "cuda" else ["disk"],
                     "caps_gib": args.caps_gib, "evict_page_cache": not args.no_evict, "threads": args.threads,
                     "seed": args.seed, "hf_moe_offload_policy": OURS_POLICY,
                     "estimates": estimates},
        "disk_bandwidth": bandwidth,             # sequential reads of the largest shard: for reference
        "store_read_bandwidth": store_reads,     # the store's kind of reads: the bound's bandwidth
        "memory_read_bandwidth": memory,         # weight reads from RAM (bytes/s): the bound of in-RAM rows
        "results": results,
        "continuous_batching": batching,
        "total_wall_s": time.perf_counter() - started,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    }


def reload_report(path: Path) -> dict[str, Any]:
    """An earlier run's report with its derived numbers (bandwidth estimate, bounds) recomputed; measurements as
    they were."""
    report = json.loads(path.read_text())
    bw = report["disk_bandwidth"]
    bw["bytes_per_s"] = max(bw["runs_bytes_per_s"])
    bw["median_bytes_per_s"] = statistics.median(bw["runs_bytes_per_s"])
    add_ceilings(report["results"], bw["bytes_per_s"])
    store = report.get("store_read_bandwidth")           # absent in runs saved before it was measured
    one_expert = ModelShape(**report["model"]["shape"]).one_expert_bytes()     # older runs did not record it
    add_bounds(report["results"], one_expert, store and max(store["runs_bytes_per_s"]),
               store and statistics.median(store["runs_bytes_per_s"]))
    if store and report.get("continuous_batching"):
        add_cb_bounds(report["continuous_batching"], max(store["runs_bytes_per_s"]))
    return report


def report_title(report: dict[str, Any]) -> str:
    settings, machine, model = report["settings"], report["machine"], report["model"]
    mode = "page cache evicted every step" if settings["evict_page_cache"] else "page cache warm"
    disk = f"disk {report['disk_bandwidth']['bytes_per_s'] / 1e6:.0f} MB/s sequential"
    if store := report.get("store_read_bandwidth"):
        disk += f", {store['bytes_per_s'] / 1e6:.0f} MB/s store-like ({store['readers']} threads, pread per expert)"
    if settings.get("device") == "cuda":
        gpu = machine["gpu"] or {"name": "GPU (no row ran)", "h2d_bytes_per_s": float("nan")}
        return (f"{model['shape']['layers']}-layer Mixtral-8x7B-shaped model ({model['bytes_on_disk'] / 1e9:.1f} GB, "
                f"random bf16), {gpu['name']}, prompt {settings['prompt_len']}, {settings['new_tokens']} new tokens, "
                f"{mode}; pinned H2D {gpu['h2d_bytes_per_s'] / 1e9:.1f} GB/s, {disk}")
    return (f"{model['bytes_on_disk'] / 1e9:.2f} GB random Mixtral, CPU ({machine['logical_cores']} cores, "
            f"{settings['threads']} torch thread(s)), {mode}, {settings['new_tokens']} new tokens; {disk}")


def write_outputs(report: dict[str, Any], out: Path) -> None:
    """`out`.json first (every measurement), then the markdown table on stdout, then `out`.png."""
    json_path, png_path = out.parent / (out.name + ".json"), out.parent / (out.name + ".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    title = report_title(report)
    print(f"\n{title}\n\n{markdown_table(report['results'])}\n")
    if batching := report.get("continuous_batching"):
        print(f"generate_batch over {batching['prompts']} prompts of {batching['prompt_lengths'][0]}-"
              f"{batching['prompt_lengths'][1]} tokens, {batching['new_tokens']} new tokens each, vs static batches "
              f"of {batching['static_batch']}:\n\n{cb_table(batching)}\n")
    written = [json_path] + ([png_path] if try_plot(report["results"], title, png_path) else [])
    print(f"wrote {' and '.join(map(str, written))} (run took {report['total_wall_s']:.0f} s)")


def try_plot(results: list[dict], title: str, png: Path) -> bool:
    """Render the PNG if matplotlib is there; without it, one warning line (the JSON holds every measurement)."""
    if not succeeded(results):
        log.warning("no plot: no row succeeded (the JSON has each row's error)")
        return False
    if not plotting_available():
        return False
    plot(results, title, png)
    return True


def fixed_length(new_tokens: int) -> dict[str, Any]:
    """`generate()` arguments for exactly `new_tokens` greedy tokens: no end-of-sequence token, so nothing stops
    early and no min-length processor runs (those scan the whole vocabulary at every step, which llama.cpp's loop
    does not)."""
    return dict(max_new_tokens=new_tokens, eos_token_id=None, do_sample=False, pad_token_id=0)


def plotting_available() -> bool:
    """Whether matplotlib is installed (the plots need it); without it, one warning line. The benchmarks write their
    JSON and tables either way."""
    try:
        import matplotlib  # noqa: F401  (optional: the plots only)
    except ImportError:
        log.warning("no plot: matplotlib is not installed; pip install matplotlib (or .[bench]) for the plot")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """0 when every row ran or was skipped with its reason, 1 when some row failed (its error is in the JSON), 2 for
    a device that is missing."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.worker is not None:
        result = run_worker(json.loads(args.worker.read_text()))
        args.worker_out.write_text(json.dumps(result))
        return 0
    if args.suite is not None:
        import bench_suite

        return bench_suite.main(args, argv)
    if args.from_json is not None:
        out = args.from_json.with_name(args.from_json.name.removesuffix(".json"))
        write_outputs(reload_report(args.from_json), out)
        return 0
    if args.device == "cuda" and (why := cuda_missing()):
        print(f"bench.py: error: {why}", file=sys.stderr)
        return 2
    report = run_benchmark(args, argv)
    write_outputs(report, args.out or default_out(args, report))
    if args.out is not None:
        args.out.with_name(args.out.name + ".rows.jsonl").unlink(missing_ok=True)
    batching = (report["continuous_batching"] or {}).get("rows", [])
    return 0 if not any("error" in r for r in report["results"] + batching) else 1


if __name__ == "__main__":
    sys.exit(main())
