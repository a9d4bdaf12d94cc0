"""GGUF checkpoints offloaded against transformers' own GGUF load (all resident), llama.cpp on the same files, and the bf16
offloaded model.

Builds a Qwen3-MoE-shaped GGUF checkpoint (Qwen3-30B-A3B's layer: hidden 2048, 128 experts of width 768, top-8; a
few layers, random weights, a stand-in vocabulary of 4096 tokens: the prompts are token ids) in Q4_K_M and in Q8_0
with the `gguf` package's writer, and the same model as bf16 safetensors (transformers' dequantized load, saved).
Then each system runs in its own process, the systems alternating within each format, and times greedy decoding
at batch 1 and batch 32 with the same thread count (`--threads`):

- `transformers-gguf`: `from_pretrained(dir, gguf_file=...)`, every tensor dequantized, all resident (bf16);
- `ours-gguf-disk`: the same file offloaded, experts read per expert in their GGUF blocks from disk (page cache
  dropped before each run) and dequantized into a dense cache of `--cache` (a share of the dense expert bytes, or
  bytes);
- `ours-gguf-cpu`: the GGUF blocks of every expert in host memory, dequantized into a dense cache ("auto" budget);
- `llama-cpp`: llama-cpp-python on the same file (its defaults: the file memory-mapped, every weight computed on
  in its blocks), batch 1 only: its `Llama` object decodes one sequence;
- `ours-bf16-disk`: the bf16 safetensors checkpoint offloaded from disk, same cache share.

`--slots default quantized` runs each `ours-gguf-*` system twice in a row: with the library's choice of cache
form, and with a cache that keeps the GGUF blocks and dequantizes an expert at every use (`dense_slots_on`
answering False, as on CUDA): the A/B behind that choice.

Each row: decode tokens/s, seconds per step, bytes moved into the expert cache per token (`stats(model)`), bytes
the process read from storage per token (`/proc/self/io` read_bytes over the generation, prefill included, and
over the load), resident memory after the run (VmRSS, its file-backed part RssFile, and the peak VmHWM), and the
1-minute load average before and after (this machine is shared: numbers are noisy). Writes JSON and a PNG.

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
from gguf import GGUFReader  # noqa: E402
from gguf_checkpoints import Q4_K_M, Dims, stand_in_vocab, write_gguf  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import hf_moe_offload  # noqa: E402
from bench import proc_read_bytes  # noqa: E402  (this folder's benchmark: the same /proc/self/io probe)

FILES = {"Q4_K_M": Q4_K_M, "Q8_0": lambda b: (Q.Q8_0,) * 3}
SYSTEMS = ("transformers-gguf", "ours-gguf-disk", "ours-gguf-cpu", "llama-cpp", "ours-bf16-disk")
VOCAB = 4096


def build(workdir: Path, layers: int) -> dict[str, Path]:
    """The GGUF files and the bf16 safetensors folder (built once, reused; a file written without a vocabulary,
    which llama.cpp refuses to load, is written again: same seed, same tensors)."""
    dims = Dims(hidden=2048, experts=128, top_k=8, layers=layers, vocab=VOCAB, heads=32, kv_heads=4, head_dim=128,
                expert_width=768)
    workdir.mkdir(parents=True, exist_ok=True)
    for name, types in FILES.items():
        path = workdir / f"qwen3moe-{layers}l-{name}.gguf"
        if not path.exists() or "tokenizer.ggml.model" not in GGUFReader(path).fields:
            partial = path.with_suffix(".partial")
            write_gguf(str(partial), dims=dims, experts=types, quantize=False, seed=1, vocab=stand_in_vocab(VOCAB))
            os.replace(partial, path)
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
    """Drop the files' pages from the OS page cache: the next read goes to the disk (pages a process has mapped,
    such as llama.cpp's, stay)."""
    for path in paths:
        for f in ([path] if path.is_file() else sorted(path.glob("*.safetensors"))):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def memory() -> dict[str, int]:
    """Resident bytes now (VmRSS, its anonymous and file-backed parts) and at the peak (VmHWM)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key.lower()] = int(value.split()[0]) * 1024
    return fields


def prompt(batch: int, prompt_len: int = 16) -> torch.Tensor:
    """The same token ids for every system."""
    return torch.randint(0, VOCAB, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))


def load(system: str, fmt: str, files: dict[str, Path], cache: str, threads: int):
    path = files[fmt]
    if system == "llama-cpp":
        from llama_cpp import Llama                # optional: pip install llama-cpp-python

        return Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=256, n_batch=64, verbose=False)
    kwargs = {"dtype": torch.bfloat16}
    if fmt != "bf16":
        kwargs["gguf_file"] = path.name
        path = path.parent
    if system == "transformers-gguf":
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    policy = {"device": "cpu", "store": "cpu"} if system == "ours-gguf-cpu" else \
        {"device": "cpu", "store": "disk", "expert_cache": cache}
    return AutoModelForCausalLM.from_pretrained(path, offload_policy=policy, **kwargs)


def _row(batch: int, new_tokens: int, start: float, stamps: list[float], end: float) -> dict:
    """Decode tokens/s from the steps after the first (prefill) token: `stamps` are the times each token's logits
    were ready."""
    steps = [b - a for a, b in zip(stamps, stamps[1:])] + [end - stamps[-1]]
    return {"batch": batch, "new_tokens": new_tokens, "prefill_s": stamps[0] - start,
            "decode_s_per_step": sum(steps) / len(steps), "decode_tok_s": batch * len(steps) / sum(steps)}


def run(model, batch: int, new_tokens: int, prompt_len: int = 16) -> dict:
    """Greedy generation with transformers; per-step times and the cache's counters."""
    ids = prompt(batch, prompt_len)
    engine = hf_moe_offload.get_engine(model)
    if engine is not None:
        engine.stats.reset()
    stamps = []

    class Clock:                       # a logits processor: called once per generated token
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         logits_processor=[Clock()], pad_token_id=0)
    row = {**_row(batch, new_tokens, start, stamps, time.perf_counter()), "tokens": out[0, prompt_len:].tolist()}
    if engine is not None:
        s = hf_moe_offload.stats(model)
        row["bytes_read_per_token"] = s["bytes_to_device"] / (batch * (prompt_len + new_tokens))
        row["misses"], row["hits"] = s["misses"], s["hits"]
    return row


def run_llama_cpp(llm, new_tokens: int, prompt_len: int = 16) -> dict:
    """Greedy decoding of the batch-1 prompt with llama.cpp, timed as `run` times transformers."""
    import numpy as np

    llm.reset()
    stamps, tokens = [], []
    start = time.perf_counter()
    llm.eval(prompt(1, prompt_len)[0].tolist())
    for i in range(new_tokens):
        stamps.append(time.perf_counter())
        # the last position's logits (llama-cpp-python keeps `scores` only with logits_all=True)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
        tokens.append(int(np.argmax(logits)))
        if i < new_tokens - 1:
            llm.eval([tokens[-1]])
    return {**_row(1, new_tokens, start, stamps, time.perf_counter()), "tokens": tokens}


def worker(spec: dict) -> list[dict]:
    """One system on one format in this process: load, then each batch; a row per batch."""
    files = {k: Path(v) for k, v in spec["files"].items()}
    system, fmt, threads = spec["system"], spec["format"], spec["threads"]
    torch.set_num_threads(threads)
    if spec["slots"] == "quantized":
        import hf_moe_offload.loading.load as load_module    # the A/B switch, as tests/test_dequantized_cache.py
        import hf_moe_offload.storage.dequantizing_store as dequantizing_store

        for module in (dequantizing_store, load_module):
            module.dense_slots_on = lambda device: False
    evict(list(files.values()))
    load_avg = os.getloadavg()[0]
    read0, t0 = proc_read_bytes(), time.perf_counter()
    model = load(system, fmt, files, spec["cache"], threads)
    load_s, load_read = time.perf_counter() - t0, proc_read_bytes() - read0
    rows = []
    for batch, new in zip(spec["batches"], spec["new_tokens"]):
        if system == "llama-cpp" and batch != 1:
            continue                           # one sequence per `Llama` object: no batch of independent prompts
        evict(list(files.values()))
        before, read0 = os.getloadavg()[0], proc_read_bytes()
        row = run_llama_cpp(model, new) if system == "llama-cpp" else run(model, batch, new)
        read = proc_read_bytes() - read0
        rows.append({"system": system, "format": fmt, "slots": spec["slots"], "threads": threads,
                     "torch_threads": torch.get_num_threads(),
                     "load_s": load_s, "load_read_bytes": load_read, **row,
                     "storage_read_per_token": read / (batch * (16 + new)), **memory(),
                     "loadavg_1min": [load_avg if not rows else before, os.getloadavg()[0]]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
    del model
    gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/hf_moe_offload_bench_gguf")
    parser.add_argument("--cache", default="25%", help="expert_cache of the disk rows (a share of the experts' bytes as "
                                                         "the cache holds them, or a size such as 576MiB)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[8, 4], help="per batch")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads and llama.cpp threads, every system (default: every CPU)")
    parser.add_argument("--formats", nargs="+", default=list(FILES), choices=list(FILES))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--slots", nargs="+", default=["default"], choices=("default", "quantized"),
                        help="cache forms of the ours-gguf-* systems (module docstring)")
    parser.add_argument("--out", default="benchmarks/results/cpu_gguf_qwen3moe")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        Path(spec["out"]).write_text(json.dumps(worker(spec)))
        return
    if len(args.new_tokens) != len(args.batches):
        parser.error(f"--new-tokens has {len(args.new_tokens)} values; --batches has {len(args.batches)}: one each")
    torch.manual_seed(0)
    files = build(Path(args.workdir), args.layers)
    # The thread count is the bench's choice, not the load's: the library keeps a set OMP_NUM_THREADS.
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    rows = []
    for fmt in args.formats:
        for system in args.systems:                # the systems alternate within each format
            if system == "ours-bf16-disk" and fmt != "Q4_K_M":
                continue
            for slots in (args.slots if system.startswith("ours-gguf") else ["default"]):
                spec_file = Path(args.workdir) / "bench_gguf_spec.json"
                spec = {"system": system, "format": "bf16" if system == "ours-bf16-disk" else fmt, "slots": slots,
                        "files": {k: str(v) for k, v in files.items()}, "cache": args.cache,
                        "batches": args.batches, "new_tokens": args.new_tokens, "threads": args.threads,
                        "out": str(Path(args.workdir) / "bench_gguf_rows.json")}
                spec_file.write_text(json.dumps(spec))
                subprocess.run([sys.executable, __file__, "--worker", str(spec_file)], env=env, check=True)
                rows += json.loads(Path(spec["out"]).read_text())
                _write(args, rows)                 # after every system: a run stopped early keeps what it measured
    _plot(rows, args.out + ".png")


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    ref = {(r["format"], r["batch"]): r["tokens"] for r in rows if r["system"] == "transformers-gguf"}
    for r in rows:
        if (r["format"], r["batch"]) in ref:
            r["same_tokens_as_transformers"] = r["tokens"] == ref[r["format"], r["batch"]]
    report = {"command": " ".join(["scripts/bench_gguf.py", *sys.argv[1:]]), "cpu": _cpu(), "threads": args.threads,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d"), "layers": args.layers, "cache": args.cache,
              "llama_cpp": _version("llama_cpp"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
    bf16 = ", avx512_bf16" if "avx512_bf16" in Path("/proc/cpuinfo").read_text() else ""
    return f"{model} ({os.cpu_count()} CPUs, {platform.machine()}{bf16})"


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib                          # the bench extra
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4))
    for ax, batch in zip(axes if len(batches) > 1 else [axes], batches):
        sel = [r for r in rows if r["batch"] == batch]
        ax.barh([f"{r['system']} ({r['format']}{', quantized slots' if r.get('slots') == 'quantized' else ''})"
                 for r in sel], [r["decode_tok_s"] for r in sel])
        ax.set_xlabel("decode tokens/s")
        ax.set_title(f"batch {batch}")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
