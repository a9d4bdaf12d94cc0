"""Serving benchmark: N concurrent streaming clients (the openai client, /v1/completions, greedy) against three
servers of one random-weight Mixtral-shaped checkpoint, in one run:

- ``ours``: ``hf-moe-offload serve`` with continuous batching, experts read from the checkpoint (``--store disk``)
  into an expert cache of ``--expert-cache`` of their bytes;
- ``accelerate``: ``transformers serve`` with the model loaded by accelerate with every ``mlp.experts`` module on
  "disk" (``device_map`` + ``offload_folder``, as ``scripts/bench.py`` loads it). transformers serve has no flag for
  a device_map, so this script launches it with a ``ModelManager`` subclass whose ``_load_model`` passes them
  (``--launch accelerate``); ``--continuous-batching`` is passed to it too when ``--baseline-cb`` is given;
- ``resident``: plain ``transformers serve`` with the whole model in RAM (``--continuous-batching`` as for ours).

Each system gets a fresh server process, started after the checkpoint's pages (and accelerate's offload folder)
are dropped from the page cache (``posix_fadvise(DONTNEED)``, ``scripts/bench.py``'s way), one warm-up request,
then one wave of C requests for each C of ``--clients``. Per (system, C): generated tokens per second (all
completion tokens / the wave's wall time), time to first token p50/p95, inter-token latency p50/p95 (each
request's mean gap between its first and last token), requests failed. The machine's load (``os.getloadavg``)
is recorded before and after each system: on a shared machine wall-clock numbers are noisy; ``--repeats``
alternates the systems.

Usage:
    python scripts/bench_serve.py --out benchmarks/results/serve_cpu       # -> .json, .png
    python scripts/bench_serve.py --clients 1 8 --new-tokens 8 --out /tmp/serve_smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (ModelShape, accelerate_device_map, build_checkpoint, checkpoint_files,  # noqa: E402
                   evict_from_page_cache, fsync_files)

log = logging.getLogger("bench_serve")
REPO_ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("ours", "accelerate", "resident")
# Mixtral-shaped, about 0.2 GB in bf16; the demo model's tokenizer (2048 ids) gives it text in and out.
SHAPE = ModelShape(hidden=512, intermediate=1536, layers=6, experts=8, top_k=2, heads=8, kv_heads=4, vocab=2048)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
STARTUP_S = 600
REQUEST_TIMEOUT_S = 900


def prepare_checkpoint(workdir: Path, seed: int) -> Path:
    """The random checkpoint (built once, reused) with the demo model's tokenizer beside it, and its architecture
    in its config (transformers serve picks the model class from it)."""
    from hf_moe_offload.demo import DEMO_MODEL

    path = build_checkpoint(SHAPE, seed, workdir)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(DEMO_MODEL) / name, path / name)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MixtralForCausalLM"]
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def prompts(count: int, words: int) -> list[str]:
    """`count` distinct prompts of `words` words from the demo model's held-out texts."""
    from hf_moe_offload.demo import DEMO_MODEL

    with open(Path(DEMO_MODEL) / "heldout.jsonl") as f:
        text = " ".join(json.loads(line)["text"] for line in f).split()
    return [" ".join(text[(i * 13) % (len(text) - words):][:words]) for i in range(count)]


# ------------------------------------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, path: Path, port: int, args: argparse.Namespace, folder: Path) -> list[str]:
    kv = ["--max-batch-size", str(max(args.clients)), "--max-seq-len", str(args.prompt_words * 4 + args.new_tokens)]
    if system == "ours":
        return [sys.executable, "-m", "hf_moe_offload.cli", "serve", str(path), "--port", str(port), "--device", "cpu",
                "--store", "disk", "--expert-cache", args.expert_cache, "--continuous-batching", *kv]
    cb = ["--continuous-batching"] if system == "resident" or args.baseline_cb else []
    if system == "accelerate":
        return [sys.executable, __file__, "--launch", "accelerate", str(path), str(port), str(folder), *cb]
    return [str(Path(sys.executable).parent / "transformers"), "serve", str(path), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", *cb]


def launch_accelerate(path: str, port: int, folder: str, continuous_batching: bool) -> None:
    """transformers serve with the model placed by accelerate: experts on "disk" (in `folder`), the rest on the CPU.
    transformers serve takes no device_map, so its ModelManager is subclassed the way Serve imports it (at call
    time, from its module)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.cli.serve import Serve
    from transformers.cli.serving import model_manager

    class AccelerateModelManager(model_manager.ModelManager):
        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            shutil.rmtree(folder, ignore_errors=True)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload_folder=folder,
                                                         device_map=accelerate_device_map(Path(path)))
            fsync_files(sorted(p for p in Path(folder).rglob("*") if p.is_file()))
            return model.eval()

    model_manager.ModelManager = AccelerateModelManager
    Serve(force_model=path, host="127.0.0.1", port=port, device="cpu", continuous_batching=continuous_batching)


def start(system: str, path: Path, args: argparse.Namespace, folder: Path) -> tuple[subprocess.Popen, str, float]:
    """A server of `system` after dropping the checkpoint's (and offload folder's) pages; its address and load
    seconds."""
    evict_from_page_cache(checkpoint_files(path) + sorted(p for p in folder.rglob("*") if p.is_file()))
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    log_file = open(Path(args.workdir) / f"serve_{system}.log", "w")   # the server's own lines
    started = time.perf_counter()
    proc = subprocess.Popen(server_command(system, path, port, args, folder), env=env, stdout=log_file,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    while time.perf_counter() - started < STARTUP_S:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return proc, base, time.perf_counter() - started
        except OSError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{system} server did not start; see {log_file.name}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# ------------------------------------------------------------------------------------------------------ clients


def one_request(client, model: str, prompt: str, new_tokens: int) -> dict[str, Any]:
    """One streamed completion: its start, token arrival times (one per content chunk), token count, error."""
    start = time.perf_counter()
    arrivals, tokens = [], None
    try:
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0,
                                           stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())
            if getattr(chunk, "usage", None) is not None:
                tokens = chunk.usage.completion_tokens
        return {"start": start, "arrivals": arrivals, "tokens": tokens or len(arrivals), "error": None}
    except Exception as error:    # a failed request is a result: counted, with its message
        return {"start": start, "arrivals": arrivals, "tokens": 0, "error": f"{type(error).__name__}: {error}"}


def wave(base: str, model: str, texts: list[str], new_tokens: int) -> dict[str, Any]:
    """All of `texts` at once, one client thread each; the wave's metrics."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    barrier = threading.Barrier(len(texts))

    def run(text: str) -> dict[str, Any]:
        barrier.wait()
        return one_request(client, model, text, new_tokens)

    started = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        results = list(pool.map(run, texts))
    wall = max((r["arrivals"][-1] if r["arrivals"] else r["start"]) for r in results) - started
    return metrics(results, wall)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def metrics(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """A wave's numbers; a request that ends without error counts as served even when its tokens decode to no text
    (random weights: special or partial-character ids), but only requests with text give latencies."""
    ok = [r for r in results if r["error"] is None]
    ttft = [r["arrivals"][0] - r["start"] for r in ok if r["arrivals"]]
    itl = [(r["arrivals"][-1] - r["arrivals"][0]) / (len(r["arrivals"]) - 1) for r in ok if len(r["arrivals"]) > 1]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(results), "failed": len(results) - len(ok), "tokens": tokens, "wall_s": wall,
            "tok_per_s": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "itl_p50_s": percentile(itl, 50), "itl_p95_s": percentile(itl, 95),
            "errors": sorted({r["error"] for r in results if r["error"]})[:5]}


# ---------------------------------------------------------------------------------------------------------- run


def run_system(system: str, path: Path, args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    folder = Path(args.workdir) / "accelerate_offload"
    load_before = os.getloadavg()
    proc, base, load_s = start(system, path, args, folder)
    try:
        one_request_warm = wave(base, str(path), texts[-1:], args.new_tokens)   # lazy set-up, first reads
        rows = []
        for clients in args.clients:
            row = {"system": system, "clients": clients, **wave(base, str(path), texts[:clients], args.new_tokens)}
            log.info("%-10s %4d clients: %7.1f tok/s, TTFT p50 %.2f s p95 %.2f s, ITL p50 %s, failed %d", system,
                     clients, row["tok_per_s"], row["ttft_p50_s"] or -1, row["ttft_p95_s"] or -1,
                     row["itl_p50_s"], row["failed"])
            rows.append(row)
    finally:
        stop(proc)
        shutil.rmtree(folder, ignore_errors=True)
    return {"system": system, "load_s": load_s, "warmup": one_request_warm, "rows": rows,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets reported against: at 32 clients >= 2x accelerate's tok/s with no request failed; at 8 clients
    ours' TTFT p95 under 2x its single-client TTFT."""
    def best(system: str, clients: int) -> dict[str, Any] | None:
        found = [r for r in rows if r["system"] == system and r["clients"] == clients]
        return max(found, key=lambda r: r["tok_per_s"]) if found else None

    out: dict[str, Any] = {}
    ours32, acc32 = best("ours", 32), best("accelerate", 32)
    if ours32 and acc32:
        ratio = ours32["tok_per_s"] / acc32["tok_per_s"] if acc32["tok_per_s"] else None
        out["throughput_32_vs_accelerate"] = ratio
        out["throughput_target_met"] = bool(ratio and ratio >= 2 and ours32["failed"] == 0)
    ours1, ours8 = best("ours", 1), best("ours", 8)
    if ours1 and ours8 and ours1["ttft_p50_s"] and ours8["ttft_p95_s"]:
        out["ttft_p95_8_over_single"] = ours8["ttft_p95_s"] / ours1["ttft_p50_s"]
        out["ttft_target_met"] = out["ttft_p95_8_over_single"] < 2
    return out


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"cpu_model": model, "cpus": os.cpu_count(), "avx512_bf16": "avx512_bf16" in lscpu, "commit": commit,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("tok_per_s", "generated tokens/s"), ("ttft_p95_s", "time to first token p95 (s)"),
              ("itl_p95_s", "inter-token latency p95 (s)"))
    for ax, (key, label) in zip(axes, panels):
        for system in result["args"]["systems"]:
            rows = [r for r in result["rows"] if r["system"] == system and r[key] is not None]
            by_clients: dict[int, list[float]] = {}
            for r in rows:
                by_clients.setdefault(r["clients"], []).append(r[key])
            xs = sorted(by_clients)
            ax.plot(xs, [statistics.median(by_clients[x]) for x in xs], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    m = result["machine"]
    fig.suptitle(f"serving {result['checkpoint_gb']:.2f} GB Mixtral-shaped checkpoint, {m['cpu_model']} "
                 f"({m['cpus']} CPUs, shared), commit {m['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 128], help="concurrency levels")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--new-tokens", type=int, default=16, help="max_tokens of each request")
    parser.add_argument("--prompt-words", type=int, default=24, help="words per prompt")
    parser.add_argument("--expert-cache", default="25%", help="ours: expert cache (share of the experts' bytes)")
    parser.add_argument("--baseline-cb", action="store_true", help="accelerate: with --continuous-batching too")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every system, alternated")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS of each server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "hf_moe_offload_bench"))
    parser.add_argument("--out", default="benchmarks/results/serve_cpu", help="output path without extension")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--launch":   # a server process of this script
        _, _, _system, path, port, folder, *rest = sys.argv
        launch_accelerate(path, int(port), folder, "--continuous-batching" in rest)
        return 0
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)     # one line per request otherwise
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    path = prepare_checkpoint(Path(args.workdir), args.seed)
    texts = prompts(max(args.clients) + 1, args.prompt_words)
    runs = []
    for repeat in range(args.repeats):
        order = args.systems if repeat % 2 == 0 else args.systems[::-1]   # alternated: drift hits every system
        for system in order:
            runs.append({"repeat": repeat, **run_system(system, path, args, texts)})
    rows = [{**row, "repeat": run["repeat"]} for run in runs for row in run["rows"]]
    result = {"command": shlex.join([sys.executable, *sys.argv]), "args": vars(args), "machine": machine(),
              "shape": dataclasses.asdict(SHAPE),
              "checkpoint_gb": sum(f.stat().st_size for f in checkpoint_files(path)) / 1e9,
              "runs": [{k: v for k, v in run.items() if k != "rows"} for run in runs], "rows": rows,
              "targets": targets(rows)}
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, Path(args.out).with_suffix(".png"))
    log.info("targets: %s; wrote %s.{json,png}", result["targets"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
