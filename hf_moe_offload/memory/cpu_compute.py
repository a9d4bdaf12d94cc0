"""The CPU-compute path of `ExpertCache` (`expert_compute="cpu"` or `"auto"`, see `placement.py`): a missing expert
is computed where its weights are, so only its tokens move.

Instead of a device slot, `fetch` then yields the expert's host slab: the CPU store's own copy, or a disk read into
one of `HOST_BUFFERS` reusable host buffers. "cpu" does so for every expert that is not resident, "auto" when the
measured CPU time beats the measured copy.

A dense bfloat16 store in host memory whose experts compute on the CPU (served in place, or `expert_compute` other
than "device") registers its slabs for prepacked oneDNN weights (`cpu_kernels.PrepackedWeights`, a copy of each
expert at its first use, within the RAM available), counted in the stats as `prepacked_bytes`.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from .cpu_kernels import PrepackedWeights
from .eviction import Key
from .placement import ExpertPlacement
from ..stats import OffloadStats
from ..storage.store import ExpertStore

HOST_BUFFERS = 2      # disk reads for CPU compute: the next expert's read overlaps this one's compute


class CpuCompute:
    """Chooses which missing experts compute on the CPU (`chooses`) and serves their host slabs (`serve`).

    Example:
        >>> cpu = CpuCompute(store, device, stats, copy, None, numel, "cpu")                     # doctest: +SKIP
        >>> for expert, slab in cpu.serve([(0, 3)], {}, after_each=lambda: None): ...            # doctest: +SKIP
    """

    def __init__(self, store: ExpertStore, device: torch.device, stats: OffloadStats, copy,
                 placement: ExpertPlacement | None, slot_numel: int, mode: str):
        self.store, self.device, self.stats, self.copy = store, device, stats, copy
        self.placement = placement                     # "auto": the measured decision
        self.mode = mode                               # the cache's `expert_compute`
        self.slot_numel = slot_numel
        self.host_buffers: list[torch.Tensor] = []     # made on first use
        # `copy` is None when the cache serves the store in place: every expert computes on the CPU from its slab.
        self.prepacked = PrepackedWeights.for_store(store) if copy is None or mode != "device" else None
        if self.prepacked is not None:
            stats.prepacked.append(self.prepacked)

    def chooses(self, key: Key, tokens: int, holding: bool) -> bool:
        """Whether missing expert `key` with `tokens` tokens computes on the CPU instead of being copied;
        `holding`: the fetch keeps its pins for the layer's next micro-batch."""
        if self.mode == "device":
            return False
        if holding and not self.store.in_host_memory:
            return False                         # a host buffer is not kept for the layer's next micro-batch
        if self.mode == "cpu":
            return True
        nbytes, numel = self.store.slab_bytes(key[0]), self.store.layouts[key[0]].numel
        self.placement.log_rule(nbytes, numel)
        return self.placement.on_cpu(nbytes, numel, tokens)

    def serve(self, keys: list[Key], tokens_of: dict[Key, int],
              after_each: Callable[[], None]) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield the host slabs of `keys`: the store's own (host store) or read into the host buffers, the next read
        running while this expert computes. Each expert's compute is timed from its yield to the resume, then
        `after_each` runs (the cache tops up its loads)."""
        host_store = self.store.in_host_memory
        buffers = [] if host_store else self._buffers()
        reads: dict[int, object] = {}

        def start_read(i: int) -> None:
            if buffers and i < len(keys):
                layer, expert = keys[i]
                reads[i] = self.copy.read_host(layer, expert, buffers[i % len(buffers)])

        for i in range(len(buffers)):
            start_read(i)
        try:
            for i, (layer, expert) in enumerate(keys):
                self.stats.record_cpu_compute(layer, 0 if host_store else self.store.slab_bytes(layer))
                if host_store:
                    slab = self.store.host_slab(layer, expert)
                else:
                    waited = time.perf_counter()
                    reads.pop(i).wait()          # a failed read raises here; nothing is resident to clean up
                    self.stats.record_stall(layer, time.perf_counter() - waited)
                    slab = buffers[i % len(buffers)][:self.store.layouts[layer].numel]
                yield from self._timed(layer, expert, slab, tokens_of.get((layer, expert), 1))
                start_read(i + len(buffers))     # its buffer was read by the compute that just finished
                after_each()
        finally:
            for load in reads.values():          # stopped early or failed: no read may land in a reused buffer
                try:
                    load.wait()
                except Exception:
                    pass

    def _timed(self, layer: int, expert: int, slab: torch.Tensor, tokens: int) -> Iterator[tuple[int, torch.Tensor]]:
        if self.device.type == "cuda":
            # The forward's token gather waits for the device's queued work anyway: wait here, so that the timer
            # below measures the CPU compute, not the GPU queue.
            torch.cuda.current_stream(self.device).synchronize()
        started = time.perf_counter()
        yield expert, slab
        seconds = time.perf_counter() - started
        self.stats.record_cpu_time(layer, seconds)
        if self.placement is not None:
            self.placement.record_cpu(tokens, seconds)

    def close(self) -> None:
        self.host_buffers.clear()
        if self.prepacked is not None:
            self.prepacked.close()

    def _buffers(self) -> list[torch.Tensor]:
        if not self.host_buffers:
            with torch.inference_mode(False):    # written by reader threads, read under no_grad
                self.host_buffers = [torch.empty(self.slot_numel, dtype=self.store.dtype)
                                     for _ in range(HOST_BUFFERS)]
        return self.host_buffers
