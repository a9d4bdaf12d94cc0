"""Bring one expert slab from the store into a device cache slot, asynchronously.

- `CudaCopyEngine`: copies run on a dedicated CUDA stream from pinned host memory; an event marks each copy's end
  and the compute stream waits on it (the host does not block). Disk reads go through a worker thread into pinned
  staging buffers first. Before a slot is overwritten, the copy stream waits for the compute that last read it.
- `CpuCopyEngine`: the CPU twin, for machines without a GPU: a worker thread fills CPU cache slots, so disk reads
  overlap with expert compute on the CPU.

Example:
    >>> engine = make_copy_engine(store, torch.device("cpu"))    # doctest: +SKIP
    >>> engine.load(layer=0, expert=2, slot=cache_slot).wait()   # doctest: +SKIP
"""

from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .store import ExpertStore

# Disk reads of different experts run in parallel: SSDs serve several requests at once far faster than one.
DISK_READERS = 4


class CpuLoad:
    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def done(self) -> bool:
        return self._future.done()


class CpuCopyEngine:
    """Loads run on worker threads (reads and copies release the GIL, so they overlap with compute)."""

    def __init__(self, store: ExpertStore):
        self.store = store
        workers = 1 if store.host_slab(0, 0) is not None else DISK_READERS
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hf_moe_offload_copy")

    def load(self, layer: int, expert: int, slot: torch.Tensor, after: object | None = None,
             demand: bool = True) -> CpuLoad:
        return CpuLoad(self._pool.submit(self.store.read_into, layer, expert, slot))

    def release_marker(self, device: torch.device) -> None:
        return None   # compute on the CPU is synchronous: a slot is free as soon as its expert returned

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaLoad:
    def __init__(self, device: torch.device, event: torch.cuda.Event | None = None, future: Future | None = None):
        self.device, self._event, self._future = device, event, future

    def wait(self) -> None:
        event = self._future.result() if self._future is not None else self._event
        torch.cuda.current_stream(self.device).wait_event(event)   # compute waits, the host does not

    def done(self) -> bool:
        if self._future is not None and not self._future.done():
            return False
        event = self._future.result() if self._future is not None else self._event
        return event.query()


class CudaCopyEngine:
    """Host-to-device copies on their own stream, ordered against compute by events."""

    def __init__(self, store: ExpertStore, device: torch.device, readers: int = DISK_READERS):
        self.store, self.device = store, device
        self.stream = torch.cuda.Stream(device)
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="hf_moe_offload_copy")
        self._staging: queue.Queue[torch.Tensor] = queue.Queue()
        if store.host_slab(0, 0) is None:   # disk store: reads land in pinned staging buffers first
            numel = max(lay.numel for lay in store.layouts)
            for _ in range(readers):
                self._staging.put(torch.empty(numel, dtype=store.dtype, pin_memory=True))

    def load(self, layer: int, expert: int, slot: torch.Tensor, after: torch.cuda.Event | None = None,
             demand: bool = True) -> CudaLoad:
        host = self.store.host_slab(layer, expert)
        if host is not None:
            return CudaLoad(self.device, event=self._copy(host, slot, after))
        return CudaLoad(self.device, future=self._pool.submit(self._read_and_copy, layer, expert, slot, after))

    def _copy(self, host: torch.Tensor, slot: torch.Tensor, after: torch.cuda.Event | None) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)      # the compute that last read this slot is done
            slot[:host.numel()].copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def _read_and_copy(self, layer: int, expert: int, slot: torch.Tensor,
                       after: torch.cuda.Event | None) -> torch.cuda.Event:
        staging = self._staging.get()
        try:
            numel = self.store.layouts[layer].numel
            self.store.read_into(layer, expert, staging)
            event = self._copy(staging[:numel], slot, after)
            event.synchronize()                     # the staging buffer may be reused only after the copy
            return event
        finally:
            self._staging.put(staging)

    def release_marker(self, device: torch.device) -> torch.cuda.Event:
        """An event on the compute stream after the work that reads a slot; the next copy into it waits on it."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def make_copy_engine(store: ExpertStore, device: torch.device) -> CpuCopyEngine | CudaCopyEngine:
    return CudaCopyEngine(store, device) if device.type == "cuda" else CpuCopyEngine(store)
