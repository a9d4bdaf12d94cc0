"""Long runs stay flat: 2,500 generated tokens without growing memory, threads or open files; offloaded models
dropped without `disable()` give their files and threads back."""

from __future__ import annotations

import gc
import os
import threading
import time

import torch

from conftest import VOCAB, offloaded
from hf_moe_offload.memory.copy_engine import DISK_READERS
from hf_moe_offload.storage.store import CHUNK_READERS

DISK = {"device": "cpu", "store": "disk", "expert_cache": "34%"}


def _open_files(under: str) -> int:
    """Open file descriptors on files below `under` (the checkpoint: the only files the library opens). Counted
    per path, not process-wide: threads left by other tests may open and close their own files meanwhile."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(under)
        except OSError:                      # closed between listing and reading
            pass
    return count


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _settle(checkpoint: str) -> tuple[int, int, int]:
    gc.collect()
    return _rss_bytes(), threading.active_count(), _open_files(checkpoint)


def test_long_generation_keeps_rss_threads_and_open_files_flat(tiny_models):
    """2,500 tokens, one at a time (25 generate calls of 100): each step and each call would leave its leak behind,
    and the limits below are per step and per call what 32 MiB over 10,000 tokens and 100 calls were."""
    model = offloaded("mixtral", tiny_models["mixtral"], **DISK)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=100, min_new_tokens=100, do_sample=False, pad_token_id=0)
    for _ in range(3):                                     # warm-up: allocator pools, thread pools, open shards
        model.generate(ids, **kwargs)
    rss, threads, files = _settle(tiny_models["mixtral"])
    generated = 0
    for _ in range(25):
        generated += model.generate(ids, **kwargs).shape[1] - ids.shape[1]
    rss_after, threads_after, files_after = _settle(tiny_models["mixtral"])
    assert generated == 2_500
    # Bounded, not growing with calls: the reader pools start threads lazily, up to their fixed sizes, so one may
    # start after the warm-up; a leak would add threads per generate (25 here, above that bound). Earlier tests'
    # dropped models may still be winding their threads down, so fewer is fine.
    assert threads_after <= threads + DISK_READERS + CHUNK_READERS
    assert files_after <= files
    # Measured growth: ~0.2 MiB. 8 MiB catches a leak of 3.4 KB per token or 330 KB per call. Bytes, not time:
    # a busy machine does not change them.
    assert rss_after - rss < 8 * 2**20, f"RSS grew by {(rss_after - rss) / 2**20:.1f} MiB over 2,500 tokens"


def test_models_dropped_without_disable_give_back_files_and_threads(tiny_models):
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    _, threads, files = _settle(tiny_models["mixtral"])
    for _ in range(10):
        model = offloaded("mixtral", tiny_models["mixtral"], **DISK)
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)   # opens shards, starts readers
        del model
    # A read still running when its model is dropped holds the store until it ends: the store's files close then,
    # and a collected pool's threads exit shortly after it, not at once. A leak stays past the 5 s waited here.
    for _ in range(100):
        _, threads_after, files_after = _settle(tiny_models["mixtral"])
        if threads_after <= threads and files_after == files:
            break
        time.sleep(0.05)
    assert files_after == files
    assert threads_after <= threads


MAIN_RETURNS_WHILE_A_THREAD_GENERATES = """
import sys, threading, torch
sys.path.insert(0, {tests!r})
from conftest import VOCAB, offloaded, reference
ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
want = reference("mixtral", {path!r}).generate(ids, **kwargs)
model = offloaded("mixtral", {path!r}, device="cpu", store="disk", expert_cache="34%", prefetch="auto")

def worker():
    for _ in range(3):
        print("same" if torch.equal(model.generate(ids, **kwargs), want) else "DIFFERENT", flush=True)

threading.Thread(target=worker).start()       # not a daemon: the process lives until it ends
"""


def test_a_thread_generating_after_the_main_thread_returned_finishes_and_the_process_exits(tiny_models):
    """At interpreter exit Python stops every thread pool before it waits for the user's threads: the readers'
    pools refuse new work then, and the reads run on the generating thread instead of waiting forever."""
    import subprocess
    import sys
    from pathlib import Path
    script = MAIN_RETURNS_WHILE_A_THREAD_GENERATES.format(tests=str(Path(__file__).parent),
                                                           path=tiny_models["mixtral"])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["same"] * 3, done.stdout
