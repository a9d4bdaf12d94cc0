"""Packed checkpoints against bf16: the same random Mixtral-shaped model offloaded from its bf16 checkpoint and from a
compressed-tensors W4A16 checkpoint of it (int4, group 128, symmetric, packed by compressed-tensors' own
compressor), experts read from disk (page cache dropped before each run) into a cache of the same byte budget.
Batch 1 and batch 32 greedy decoding; the two systems alternate within one run, so a busy machine slows both alike.

Reports per row: decode tok/s, bytes moved per token (`stats()["bytes_to_device"]`), the slab size of one expert in
bits per weight, hits and misses, and the machine's load average before the run. Writes JSON and PNG.

    python scripts/bench_packed.py --out benchmarks/results/cpu_packed_w4a16 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the project's benchmark: model shape, checkpoint builder, machine info, page cache)

log = logging.getLogger("bench_packed")
SHAPE = bench.ModelShape(layers=4)             # the default 1024 x 3584 Mixtral shape, 4 layers (0.8 GB in bf16)
GROUP = 128


def w4a16_checkpoint(dense: Path) -> Path:
    """compressed-tensors W4A16 (int4, group 128, symmetric) of every attention and expert linear of `dense`,
    packed by compressed-tensors' PackedQuantizationCompressor; reused when it exists."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    path = dense.with_name(dense.name + "_w4a16_g128")
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    index = json.loads((dense / "model.safetensors.index.json").read_text())
    for file in sorted(dense.glob("*.safetensors")):
        out = {}
        for key, w in load_file(file).items():
            if not (key.endswith(".weight") and w.dim() == 2 and (".self_attn." in key or ".experts." in key)):
                out[key] = w
                continue
            groups = w.float().reshape(w.shape[0], -1, GROUP)
            scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(w.dtype)}, scheme)
            module = key.removesuffix(".weight")
            del index["weight_map"][key]
            for suffix, tensor in packed.items():
                out[f"{module}.{suffix}"] = tensor.contiguous()
                index["weight_map"][f"{module}.{suffix}"] = file.name
        save_file(out, path / file.name, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", quantization_status="compressed",
        ignore=["lm_head"]).model_dump(mode="json")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    bench.fsync_files(list(path.glob("*.safetensors")))
    return path


def run(system: str, path: Path, batch: int, prompt_len: int, new_tokens: int, cache_bytes: int) -> dict:
    """Load `path` offloaded (disk store, page cache dropped), greedy-decode `batch` prompts, report the numbers."""
    import hf_moe_offload
    from transformers import AutoModelForCausalLM

    bench.evict_from_page_cache(list(path.glob("*.safetensors")))
    load_avg = os.getloadavg()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, offload_policy={"device": "cpu", "store": "disk", "expert_cache": cache_bytes})
    ids = torch.randint(3, SHAPE.vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)                       # prefill (and first token)
        prefill_s = time.perf_counter() - start
        before = dict(hf_moe_offload.stats(model))
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        total_s = time.perf_counter() - start
    after = dict(hf_moe_offload.stats(model))
    engine = hf_moe_offload.get_engine(model)
    weights = sum(s[0] * s[1] for _, s in engine.layers[0].layout.parts)
    decode_s = max(total_s - prefill_s, 1e-9)
    moved = after["bytes_to_device"] - before["bytes_to_device"]
    # bytes_per_token: what the generate call moved (its prefill included) per generated token
    row = {"system": system, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "decode_tok_s": batch * (new_tokens - 1) / decode_s, "prefill_s": prefill_s,
           "bytes_per_token": moved / (batch * new_tokens), "expert_slab_bytes": engine.store.slab_bytes(0),
           "bits_per_weight": engine.store.slab_bytes(0) * 8 / weights, "cache_bytes": cache_bytes,
           "hits": after["hits"] - before["hits"], "misses": after["misses"] - before["misses"],
           "load_avg_before": load_avg}
    hf_moe_offload.disable(model)
    log.info("%s", json.dumps(row))
    return row


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "decode_tok_s", "decode tok/s"), (axes[1], "bytes_per_token", "MB per token")):
        for system, color in (("bf16", "tab:blue"), ("w4a16", "tab:orange")):
            pts = [(r["batch"], r[key] / (1e6 if key == "bytes_per_token" else 1)) for r in rows if r["system"] == system]
            ax.scatter([str(b) for b, _ in pts], [v for _, v in pts], label=system, color=color)
        ax.set_xlabel("batch")
        ax.set_title(label)
        ax.legend()
    fig.suptitle(f"{SHAPE.tag}\nbf16 vs compressed-tensors W4A16 g{GROUP}, disk store, same cache bytes", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "hfmo_bench")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_packed_w4a16"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--small", action="store_true", help=f"smoke run on {bench.SMALL.tag}")
    p.add_argument("--cache-share", type=float, default=0.25, help="expert cache, a share of the bf16 expert bytes")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    global SHAPE
    SHAPE = bench.SMALL if args.small else SHAPE
    args.workdir.mkdir(parents=True, exist_ok=True)
    dense = bench.build_checkpoint(SHAPE, seed=0, workdir=args.workdir)
    systems = {"bf16": dense, "w4a16": w4a16_checkpoint(dense)}
    cache_bytes = int(SHAPE.expert_bytes() * args.cache_share)
    rows = []
    for repeat in range(args.repeats):
        for batch, prompt_len, new_tokens in ((1, 16, 16), (32, 16, 8)):
            for system in (("bf16", "w4a16") if repeat % 2 == 0 else ("w4a16", "bf16")):   # alternated
                rows.append({**run(system, systems[system], batch, prompt_len, new_tokens, cache_bytes),
                             "repeat": repeat})
    result = {"command": shlex.join(["python", "scripts/bench_packed.py", *(argv or sys.argv[1:])]),
              "shape": SHAPE.tag, "machine": bench.machine_info(args.workdir), "git": bench.git_commit(),
              "threads": args.threads, "uptime_after": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    log.info("wrote %s.{json,png}", args.out)


if __name__ == "__main__":
    main()
