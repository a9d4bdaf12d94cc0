"""`ExpertCache`: a fixed number of device slots (the byte budget), LRU or LFU eviction, and pins so an expert that
is loading or computing is never evicted.

`fetch(layer, experts)` yields `(expert, slab)` with the experts already resident first; the missing ones are
loaded asynchronously meanwhile, as many at once as there are slots free of pins, and yielded as they arrive.
A slot's pin is dropped when the consumer moves on to the next expert, so a batch that needs more experts than
the cache holds still runs, in waves.

When the store already lives in the compute device's memory (CPU store, CPU device), there is nothing to move:
the cache hands out the store's slabs directly ("zero-copy") and allocates no slots.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from typing import Callable, Iterator, Sequence

import torch

from .copy_engine import make_copy_engine
from .stats import OffloadStats
from .store import ExpertStore

logger = logging.getLogger(__name__)

Key = tuple[int, int]   # (layer, expert)


class ExpertCache:
    """Device-resident experts within a byte budget.

    Example:
        >>> cache = ExpertCache(store, torch.device("cpu"), 2**28, "lru", stats)  # doctest: +SKIP
        >>> for expert, slab in cache.fetch(layer=0, experts=[1, 5]): ...        # doctest: +SKIP
    """

    def __init__(self, store: ExpertStore, device: torch.device, budget_bytes: int, eviction: str,
                 stats: OffloadStats):
        self.store, self.device, self.eviction, self.stats = store, device, eviction, stats
        self.zero_copy = device.type == "cpu" and store.host_slab(0, 0) is not None
        self.slot_numel = max(lay.numel for lay in store.layouts)
        self.slot_bytes = self.slot_numel * store.dtype.itemsize
        self.num_slots = 0 if self.zero_copy else budget_bytes // self.slot_bytes
        stats.capacity_bytes = self.num_slots * self.slot_bytes
        self.slots = torch.empty(self.num_slots, self.slot_numel, dtype=store.dtype, device=device)
        self.copy = None if self.zero_copy else make_copy_engine(store, device)
        self.where: dict[Key, int] = {}                          # resident or loading key -> slot
        self.owner: list[Key | None] = [None] * self.num_slots
        self.release: list[object | None] = [None] * self.num_slots   # compute-done markers (CUDA events)
        self.pins: Counter[Key] = Counter()
        self.loading: dict[Key, object] = {}                     # key -> load handle
        self.recency: OrderedDict[Key, None] = OrderedDict()     # least recently used first
        self.frequency: Counter[Key] = Counter()
        self.prefetched: set[Key] = set()                        # brought in by a prefetch, not used yet

    # -- public -------------------------------------------------------------------------------------------------

    def fetch(self, layer: int, experts: Sequence[int], on_pinned: Callable[[], None] | None = None
              ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (expert, flat slab on the device) for each expert, resident ones first.

        `on_pinned` runs once this layer's experts are pinned and their loads issued: the moment to prefetch for
        later layers without evicting anything this layer needs.
        """
        numel = self.store.layouts[layer].numel
        if self.zero_copy:
            if on_pinned is not None:
                on_pinned()
            for e in experts:
                self.stats.record_hit(layer)
                yield e, self.store.host_slab(layer, e)
            return
        keys = [(layer, e) for e in experts]
        for k in keys:
            if k in self.prefetched:
                self.prefetched.discard(k)
                self.stats.record_prefetch_hit(layer)
        resident = [k for k in keys if k in self.where and k not in self.loading]
        missing = [k for k in keys if k not in resident]
        for k in resident:
            self.stats.record_hit(layer)
            self._pin(k)
        issued: list[Key] = []
        try:
            self._issue(missing, issued)
            if on_pinned is not None:
                on_pinned()
            for k in resident:
                yield k[1], self.slots[self.where[k]][:numel]
                self._unpin(k)
                self._issue(missing, issued)
            for i in range(len(missing)):
                if i >= len(issued):      # every slot was pinned by earlier loads: now some are free
                    self._issue(missing, issued)
                    if i >= len(issued):
                        raise RuntimeError(f"expert cache has no free slot for layer {layer} "
                                           f"({self.num_slots} slots, all pinned)")
                k = issued[i]
                self._wait(k)
                yield k[1], self.slots[self.where[k]][:numel]
                self._unpin(k)
                self._issue(missing, issued)
        finally:
            # An exception mid-layer: let in-flight loads land, drop our pins; the cache stays consistent.
            for k in issued:
                if k in self.loading:
                    self._wait(k)
            for k in keys:
                while self.pins[k] > 0:
                    self._unpin(k)

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Start loading `experts` of `layer` ahead of need, into free slots or slots whose expert is neither in
        use, nor in flight, nor itself prefetched and unused. Never exceeds the budget. Returns loads started."""
        if self.zero_copy:
            return 0
        started = 0
        for e in experts:
            k = (layer, e)
            if k in self.where:
                continue
            slot = self._free_slot(layer, for_prefetch=True)
            if slot is None:
                break
            self.where[k] = slot
            self.owner[slot] = k
            self.recency[k] = None
            self.prefetched.add(k)
            self.loading[k] = self.copy.load(layer, e, self.slots[slot], after=self.release[slot])
            self.stats.record_prefetch(layer, self.store.slab_bytes(layer))
            started += 1
        self.stats.set_resident(self.resident_bytes())
        return started

    def resident_bytes(self) -> int:
        return len(self.where) * self.slot_bytes

    def close(self) -> None:
        if self.copy is not None:
            for k in list(self.loading):
                self._wait(k)
            self.copy.close()
        self.slots = torch.empty(0)
        self.where.clear()

    # -- internals ----------------------------------------------------------------------------------------------

    def _issue(self, missing: list[Key], issued: list[Key]) -> None:
        """Start loads for the next missing experts while a slot can be freed without touching a pin."""
        while len(issued) < len(missing):
            k = missing[len(issued)]
            if k in self.where:                   # arrived meanwhile (already loading, e.g. by a prefetch)
                self.stats.record_hit(k[0])
                self._pin(k)
                issued.append(k)
                continue
            slot = self._free_slot(k[0])
            if slot is None:
                return
            self.where[k] = slot
            self.owner[slot] = k
            self._pin(k)
            self.loading[k] = self.copy.load(k[0], k[1], self.slots[slot], after=self.release[slot])
            self.stats.record_miss(k[0], self.store.slab_bytes(k[0]))
            self.stats.set_resident(self.resident_bytes())
            issued.append(k)

    def _free_slot(self, layer: int, for_prefetch: bool = False) -> int | None:
        for slot, owner in enumerate(self.owner):
            if owner is None:
                return slot
        self._reap_finished_loads()
        victim = self._victim(layer, for_prefetch)
        if victim is None and not for_prefetch:
            # Demand beats prefetch: let an unused prefetch still in flight land, then it may be evicted.
            in_flight = [k for k in self.loading if self.pins[k] == 0]
            if in_flight:
                self._wait(in_flight[0])
                victim = self._victim(layer)
        if victim is None:
            return None
        slot = self.where.pop(victim)
        self.owner[slot] = None
        self.recency.pop(victim, None)
        self.stats.record_eviction(victim[0])
        if victim in self.prefetched:
            self.prefetched.discard(victim)
            self.stats.record_prefetch_wasted(victim[0])
        return slot

    def _reap_finished_loads(self) -> None:
        """Prefetched loads that nobody waited for yet: once landed, their slots are ordinary residents."""
        for k in [k for k, handle in self.loading.items() if self.pins[k] == 0 and handle.done()]:
            self.loading.pop(k).wait()   # surfaces a failed read; no blocking, the load is done

    def _victim(self, layer: int, for_prefetch: bool = False) -> Key | None:
        """Which unpinned, landed expert leaves to make room for one of `layer` (candidates are in LRU order)."""
        candidates = [k for k in self.recency if self.pins[k] == 0 and k not in self.loading
                      and not (for_prefetch and k in self.prefetched)]
        if not candidates:
            return None
        if self.eviction == "lfu":   # least frequently used; the least recent among equals
            return min(candidates, key=lambda k: self.frequency[k])
        if self.eviction == "layer":
            # Layers run in a cycle (decode), so the expert needed furthest in the future belongs to the layer that
            # comes up last: this one (its next use is the next token), then the one before, ...; LRU among equals.
            n = len(self.store.layouts)
            return max(candidates, key=lambda k: (k[0] - layer - 1) % n)
        return candidates[0]

    def _wait(self, key: Key) -> None:
        handle = self.loading.pop(key, None)
        if handle is not None:
            start = time.perf_counter()
            handle.wait()
            self.stats.record_stall(key[0], time.perf_counter() - start)

    def _pin(self, key: Key) -> None:
        self.pins[key] += 1
        self.frequency[key] += 1
        self.recency[key] = None
        self.recency.move_to_end(key)

    def _unpin(self, key: Key) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]
            slot = self.where.get(key)
            if slot is not None and self.copy is not None:
                self.release[slot] = self.copy.release_marker(self.device)
