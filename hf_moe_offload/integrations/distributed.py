"""Data-parallel batch jobs: one offloaded model per process, the prompts split by rank, the results gathered in
the original order. Launch with `torchrun` or `accelerate launch`; on CPUs the processes talk over gloo, on GPUs
each process takes the GPU of its local rank (`device_for_rank`).

Example (examples/generate_data_parallel.py does exactly this):
    torchrun --nproc_per_node 2 examples/generate_data_parallel.py --model PATH --prompts prompts.jsonl

    >>> shard([10, 11, 12, 13, 14], rank=1, world_size=2)    # every other prompt, so long and short ones mix
    [(1, 11), (3, 13)]
    >>> shard([10, 11, 12, 13, 14], rank=0, world_size=2, chunk=2)   # whole batches: the same batches as alone
    [(0, 10), (1, 11), (4, 14)]
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence, TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def launch_world() -> tuple[int, int, int]:
    """(rank, local rank, world size) of this process as `torchrun` / `accelerate launch` set them; (0, 0, 1)
    when launched alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), world


def device_for_rank(device: str | None = None) -> str:
    """The policy device for this process: its local rank's GPU when launched several times on a CUDA machine
    and `device` is unset, "auto" or "cuda"; otherwise `device` unchanged (or "auto")."""
    _, local_rank, world = launch_world()
    if world > 1 and torch.cuda.is_available() and device in (None, "auto", "cuda"):
        return f"cuda:{local_rank}"
    return device or "auto"


def init_process_group() -> bool:
    """Join the launch's process group (gloo on CPUs, nccl on GPUs) if several processes were launched and none
    is joined yet; returns whether this is a multi-process run."""
    _, _, world = launch_world()
    if world <= 1:
        return False
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend=backend)
    return True


def shard(items: Sequence[T], rank: int, world_size: int, chunk: int = 1) -> list[tuple[int, T]]:
    """This rank's (index, item) pairs: the items cut into runs of `chunk`, every `world_size`-th run from `rank`
    on. With `chunk` = the batch size, every batch is the one a single process would have run, so left padding
    and the numbers come out the same."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} is not allowed; allowed: a whole number >= 1")
    return [(i, items[i]) for i in range(len(items)) if (i // chunk) % world_size == rank]


def map_sharded(items: Sequence[T], work: Callable[[list[T]], list[R]], chunk: int = 1) -> list[R]:
    """Run `work` on this process's share of `items` (runs of `chunk` dealt round-robin, see `shard`) and return
    every process's results in `items`' order, on every rank. Alone, it is `work(items)`.

    `work` gets a list and returns one result per element (e.g. prompts -> their generations); give `chunk` = its
    batch size so each process forms the batches a single process would.
    """
    if not init_process_group():
        return list(work(list(items)))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = shard(items, rank, world, chunk)
    results = list(work([item for _, item in mine])) if mine else []
    if len(results) != len(mine):
        raise ValueError(f"work returned {len(results)} results for {len(mine)} items")
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, list(zip((i for i, _ in mine), results)))
    ordered: list[Any] = [None] * len(items)
    for part in gathered:
        for index, result in part:
            ordered[index] = result
    logger.info("hf_moe_offload: rank %d of %d computed %d of %d items", rank, world, len(mine), len(items))
    return ordered
