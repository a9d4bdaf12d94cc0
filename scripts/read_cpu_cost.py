"""What a read from disk costs the CPU beside it: buffered (through the page cache) against direct (O_DIRECT).

Reads every safetensors file of a checkpoint in 4 MiB pieces on 4 threads (the store's pattern), the page cache
dropped first, alternating buffered and direct, once alone and once beside a compute thread (torch matmuls at the
expert shape, `--threads` torch threads), and runs that thread alone. Per run: the read rate, the process's CPU
seconds per GB read (the compute's included where it runs), and the matmuls the compute thread finished per second.
A buffered read copies every byte out of the page cache and allocates and frees its pages; on a small machine that
CPU time comes out of the compute.

    python scripts/read_cpu_cost.py --model /tmp/hf_moe_offload_bench/<checkpoint> --out read_cpu_cost.json
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench import evict_from_page_cache, machine_info  # this folder's benchmark: its page-cache eviction

log = logging.getLogger("read_cpu_cost")
PIECE = 4 << 20
READERS = 4


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class MatmulLoop:
    """A thread running `F.linear` at the expert shape until stopped, counting the calls."""

    def __init__(self, rows: int, hidden: int, intermediate: int):
        self.x = torch.randn(rows, hidden, dtype=torch.bfloat16)
        self.w = torch.randn(intermediate, hidden, dtype=torch.bfloat16)
        self.calls, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            torch.nn.functional.linear(self.x, self.w)
            self.calls += 1

    def __enter__(self) -> MatmulLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def read_all(files: list[Path], direct: bool) -> int:
    """Read every file in PIECE-sized pieces on READERS threads; the bytes read."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {path: os.open(path, flags) for path in files}
    jobs = [(path, off) for path in files for off in range(0, os.path.getsize(path) - PIECE + 1, PIECE)]
    local = threading.local()

    def read(job) -> int:
        if not hasattr(local, "buffer"):
            local.buffer = mmap.mmap(-1, PIECE)          # page-aligned, as O_DIRECT needs
        return os.preadv(fds[job[0]], [local.buffer], job[1])
    try:
        with ThreadPoolExecutor(READERS) as pool:
            return sum(pool.map(read, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def measure(files: list[Path], direct: bool, compute: MatmulLoop | None) -> dict:
    evict_from_page_cache(files)
    time.sleep(0.3)
    cpu, start = cpu_seconds(), time.perf_counter()
    if compute is None:
        nbytes = read_all(files, direct)
        calls = 0
    else:
        with compute:
            nbytes = read_all(files, direct)
        calls = compute.calls
    wall = time.perf_counter() - start
    return {"reads": "direct" if direct else "buffered", "compute": compute is not None, "bytes": nbytes,
            "gb_per_s": nbytes / wall / 1e9, "cpu_s_per_gb": (cpu_seconds() - cpu) / (nbytes / 1e9),
            "matmuls_per_s": calls / wall}


def compute_alone(loop: MatmulLoop, seconds: float = 3.0) -> dict:
    start = time.perf_counter()
    with loop:
        time.sleep(seconds)
    return {"reads": None, "compute": True, "matmuls_per_s": loop.calls / (time.perf_counter() - start)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a checkpoint folder (its *.safetensors are read)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the compute thread")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=128, help="rows of the compute thread's matmul")
    p.add_argument("--out", type=Path, help="write the runs here as JSON")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    files = sorted(args.model.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no *.safetensors in {args.model}")
    config = json.loads((args.model / "config.json").read_text())
    runs = []
    shape = (args.rows, config["hidden_size"], config["intermediate_size"])
    for _ in range(args.rounds):
        runs.append(compute_alone(MatmulLoop(*shape)))
        log.info("no reads, compute on: %.0f matmuls/s", runs[-1]["matmuls_per_s"])
        for with_compute in (False, True):
            for direct in (False, True):
                run = measure(files, direct, MatmulLoop(*shape) if with_compute else None)
                runs.append(run)
                log.info("%-8s compute %-3s: %.2f GB/s, %.2f CPU s per GB, %.0f matmuls/s", run["reads"],
                         "on" if with_compute else "off", run["gb_per_s"], run["cpu_s_per_gb"], run["matmuls_per_s"])
    if args.out:
        report = {"command": "python scripts/read_cpu_cost.py " + " ".join(sys.argv[1:]),
                  "machine": machine_info(args.model),
                  "threads": args.threads, "piece_bytes": PIECE, "readers": READERS, "runs": runs}
        args.out.write_text(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
