"""GGUF checkpoints offloaded against transformers' own GGUF load (all resident) and the bf16 offloaded model.

Builds a Qwen3-MoE-shaped GGUF checkpoint (Qwen3-30B-A3B's layer: hidden 2048, 128 experts of width 768, top-8; a
few layers and a small vocabulary, random weights) in Q4_K_M and in Q8_0 with the `gguf` package's writer, and the
same model as bf16 safetensors (transformers' dequantized load, saved). Then, alternating the systems within one
run, it times greedy decoding at batch 1 and batch 32:

- `transformers-gguf`: `from_pretrained(dir, gguf_file=...)`, every tensor dequantized, all resident (bf16);
- `ours-gguf-disk`: the same file offloaded, experts read per expert in their GGUF blocks from disk (page cache
  dropped before each run) and dequantized into a dense cache of `--cache` (a share of the dense expert bytes, or
  bytes);
- `ours-gguf-cpu`: the GGUF blocks of every expert in host memory, dequantized into a dense cache ("auto" budget);
- `ours-bf16-disk`: the bf16 safetensors checkpoint offloaded from disk, same cache share.

Each row: decode tokens/s, seconds per step, bytes read per token (`stats(model)`), and the load's `uptime` load
averages (this machine is shared: numbers are noisy). Writes JSON and a PNG.

    HF_HUB_OFFLINE=1 python scripts/bench_gguf.py --layers 2 --out benchmarks/results/cpu_gguf_qwen3moe
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # the GGUF checkpoint writer
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf_checkpoints import Q4_K_M, Dims, write_gguf  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import hf_moe_offload  # noqa: E402

FILES = {"Q4_K_M": Q4_K_M, "Q8_0": lambda b: (Q.Q8_0,) * 3}


def build(workdir: Path, layers: int) -> dict[str, Path]:
    """The GGUF files and the bf16 safetensors folder (built once, reused)."""
    dims = Dims(hidden=2048, experts=128, top_k=8, layers=layers, vocab=4096, heads=32, kv_heads=4, head_dim=128,
                expert_width=768)
    workdir.mkdir(parents=True, exist_ok=True)
    for name, types in FILES.items():
        path = workdir / f"qwen3moe-{layers}l-{name}.gguf"
        if not path.exists():
            write_gguf(str(path), dims=dims, experts=types, quantize=False, seed=1)
    bf16 = workdir / f"qwen3moe-{layers}l-bf16"
    if not (bf16 / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(workdir, gguf_file=f"qwen3moe-{layers}l-Q4_K_M.gguf",
                                                     dtype=torch.bfloat16)
        # transformers refuses save_pretrained on a GGUF-loaded model: the tensors and a plain config instead.
        bf16.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(bf16 / "model.safetensors"))
        del model.config.quantization_config
        model.config.save_pretrained(bf16)
        del model
    return {"Q4_K_M": workdir / f"qwen3moe-{layers}l-Q4_K_M.gguf",
            "Q8_0": workdir / f"qwen3moe-{layers}l-Q8_0.gguf", "bf16": bf16}


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the OS page cache: the next read goes to the disk."""
    for path in paths:
        for f in ([path] if path.is_file() else sorted(path.glob("*.safetensors"))):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load(system: str, fmt: str, files: dict[str, Path], cache: str):
    path = files[fmt]
    kwargs = {"dtype": torch.bfloat16}
    if fmt != "bf16":
        kwargs["gguf_file"] = path.name
        path = path.parent
    if system == "transformers-gguf":
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    policy = {"device": "cpu", "store": "cpu"} if system == "ours-gguf-cpu" else \
        {"device": "cpu", "store": "disk", "expert_cache": cache}
    return AutoModelForCausalLM.from_pretrained(path, offload_policy=policy, **kwargs)


def run(model, batch: int, new_tokens: int, prompt_len: int = 16) -> dict:
    """Greedy generation; decode tokens/s from the steps after the first (prefill) token."""
    ids = torch.randint(0, 4096, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
    engine = hf_moe_offload.get_engine(model)
    if engine is not None:
        engine.stats.reset()
    stamps = []

    class Clock:                       # a logits processor: called once per generated token
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   logits_processor=[Clock()], pad_token_id=0)
    end = time.perf_counter()
    steps = [b - a for a, b in zip(stamps, stamps[1:])] + [end - stamps[-1]]
    row = {"batch": batch, "new_tokens": new_tokens, "prefill_s": stamps[0] - start,
           "decode_s_per_step": sum(steps) / len(steps), "decode_tok_s": batch * len(steps) / sum(steps)}
    if engine is not None:
        s = hf_moe_offload.stats(model)
        row["bytes_read_per_token"] = s["bytes_to_device"] / (batch * (prompt_len + new_tokens))
        row["misses"], row["hits"] = s["misses"], s["hits"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/hf_moe_offload_bench_gguf")
    parser.add_argument("--cache", default="25%", help="expert_cache of the disk rows (a share of the experts' bytes as "
                                                         "the cache holds them, or a size such as 576MiB)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[8, 4], help="per batch")
    parser.add_argument("--systems", nargs="+", default=["transformers-gguf", "ours-gguf-disk", "ours-gguf-cpu",
                                                         "ours-bf16-disk"])
    parser.add_argument("--out", default="benchmarks/results/cpu_gguf_qwen3moe")
    args = parser.parse_args()
    torch.manual_seed(0)
    files = build(Path(args.workdir), args.layers)
    rows = []
    for fmt in ("Q4_K_M", "Q8_0"):
        for system in args.systems:                # the systems alternate within each format
            if system == "ours-bf16-disk" and fmt != "Q4_K_M":
                continue
            source = "bf16" if system == "ours-bf16-disk" else fmt
            evict(list(files.values()))
            t0 = time.perf_counter()
            model = load(system, source, files, args.cache)
            load_s = time.perf_counter() - t0
            for batch, new in zip(args.batches, args.new_tokens):
                evict(list(files.values()))
                row = {"system": system, "format": source, "load_s": load_s, **run(model, batch, new),
                       "loadavg": os.getloadavg()}
                print(json.dumps(row), flush=True)
                rows.append(row)
                _write(args, rows)              # after every row: a run stopped early keeps what it measured
            del model
            gc.collect()
    _plot(rows, args.out + ".png")


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    report = {"command": " ".join(sys.argv), "cpu": _cpu(), "torch_threads": torch.get_num_threads(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d"), "layers": args.layers, "cache": args.cache, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
    return f"{model} ({os.cpu_count()} CPUs, {platform.machine()})"


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib                          # the bench extra
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4))
    for ax, batch in zip(axes if len(batches) > 1 else [axes], batches):
        sel = [r for r in rows if r["batch"] == batch]
        ax.barh([f"{r['system']} ({r['format']})" for r in sel], [r["decode_tok_s"] for r in sel])
        ax.set_xlabel("decode tokens/s")
        ax.set_title(f"batch {batch}")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
