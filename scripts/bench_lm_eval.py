"""Wall time of an lm-eval loglikelihood task at `--batch_size 32`: hf_moe_offload vs lm-eval's `hf` model on
accelerate's `device_map` disk offload of the experts, same scores.

The model is `scripts/bench.py`'s 1.59 GB random Mixtral shape with the demo model's vocabulary (2048 tokens) and
tokenizer, so lm-eval can tokenize; the task is the shipped `hfmo_pydoc_cloze` (84 four-way multiple-choice
sentences, 336 loglikelihood requests). Its scores on random weights mean nothing; that both systems get the same
scores, and how long they take, does. Experts are treated as larger than RAM: before every forward pass the
checkpoint's (and accelerate's offload folder's) pages are dropped from the OS page cache, and the time that takes
is subtracted. Each (system, repeat) runs in its own process; systems alternate, so a drift of the shared disk hits
both.

Example:
    HF_HUB_OFFLINE=1 python scripts/bench_lm_eval.py --repeats 2 --out benchmarks/results/cpu_lm_eval_bs32.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the checkpoint builder, accelerate's device map, page-cache helpers)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO = REPO_ROOT / "hf_moe_offload" / "demo_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OURS_POLICY = {"device": "cpu", "store": "disk", "expert_cache": "25%"}


def prepare_checkpoint(workdir: Path, seed: int) -> Path:
    """The bench shape with the demo vocabulary, its tokenizer copied in (ids 1/2/3 = bos/eos/pad, as the demo's)."""
    path = bench.build_checkpoint(bench.ModelShape(vocab=2048), seed, workdir)
    for name in TOKENIZER_FILES:
        if not (path / name).exists():
            shutil.copy(DEMO / name, path / name)
    return path


def worker(spec: dict) -> dict:
    """Load one system, run the task through lm-eval, return the timings and scores."""
    import torch
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_moe_offload
    from hf_moe_offload.integrations import task_manager

    torch.set_num_threads(spec["threads"])
    path, folder = Path(spec["checkpoint"]), Path(spec["offload_folder"])
    files = bench.checkpoint_files(path)
    bench.evict_from_page_cache(files)
    start = time.perf_counter()
    if spec["system"] == "hf_moe_offload":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload_policy=OURS_POLICY)
    else:
        shutil.rmtree(folder, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload_folder=str(folder),
                                                     device_map=bench.accelerate_device_map(path))
        offloaded = sorted(p for p in folder.rglob("*") if p.is_file())
        bench.fsync_files(offloaded)
        files = files + offloaded
    load_s = time.perf_counter() - start
    evict = {"s": 0.0, "calls": 0}

    def drop_page_cache(module, args):
        t = time.perf_counter()
        bench.evict_from_page_cache(files)
        evict["s"] += time.perf_counter() - t
        evict["calls"] += 1

    if spec["evict"]:
        model.register_forward_pre_hook(drop_page_cache)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=spec["batch_size"], max_length=512)
    read_before = bench.proc_read_bytes()
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=[spec["task"]], task_manager=task_manager(),
                                      limit=spec["limit"], log_samples=False)
    wall_s = time.perf_counter() - start
    scores = results["results"][spec["task"]]
    out = {**spec, "load_s": load_s, "eval_s": wall_s - evict["s"], "evict_s": evict["s"],
           "forwards": evict["calls"], "disk_read_bytes": bench.proc_read_bytes() - read_before,
           "acc": scores.get("acc,none"), "acc_norm": scores.get("acc_norm,none")}
    if spec["system"] == "hf_moe_offload":
        snap = hf_moe_offload.stats(model)
        out.update(passes=snap["passes"], bytes_to_device=snap["bytes_to_device"], hit_rate=snap["hit_rate"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hf_moe_offload_bench"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", nargs="+", default=["hf_moe_offload", "accelerate"],
                   choices=["hf_moe_offload", "accelerate"])
    p.add_argument("--task", default="hfmo_pydoc_cloze")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="documents of the task (default: all)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-evict", dest="evict", action="store_false", help="keep the page cache warm")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "cpu_lm_eval_bs32.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))))
        return
    path = prepare_checkpoint(args.workdir, args.seed)
    runs = []
    for repeat in range(args.repeats):
        for system in args.systems:
            spec = {"system": system, "repeat": repeat, "checkpoint": str(path), "task": args.task,
                    "offload_folder": str(args.workdir / "lm_eval_accelerate_offload"),
                    "batch_size": args.batch_size, "limit": args.limit, "threads": args.threads, "evict": args.evict}
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                                  text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"{system} failed (exit {proc.returncode})")
            run = json.loads(line[len("RESULT "):])
            runs.append(run)
            print(f"{system} repeat {repeat}: eval {run['eval_s']:.1f} s (load {run['load_s']:.1f} s, "
                  f"{run['forwards']} forwards, disk {run['disk_read_bytes'] / 1e9:.2f} GB), acc {run['acc']:.4f} "
                  f"acc_norm {run['acc_norm']:.4f}", flush=True)
    report = {"command": " ".join(["python scripts/bench_lm_eval.py", *sys.argv[1:]]), "git": bench.git_commit(),
              "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
