"""`ExpertCache`: a fixed number of device slots (the byte budget), an eviction policy, and pins so an expert that
is loading or computing is never evicted.

`fetch(layer, experts)` yields `(expert, slab)` with the experts already resident first; the missing ones are
loaded asynchronously meanwhile, as many at once as there are slots free of pins, and yielded in the order they
arrive. A slot's pin is dropped when the consumer moves on to the next expert, so a batch that needs more experts
than the cache holds still runs, in waves.

One lock serialises every caller (two threads generating on one model take turns per MoE layer), and a load that
fails leaves nothing behind: its key is evicted and its slot freed before the error reaches the caller, so the
next fetch reads the expert again.

Streaming (passes that touch most experts, see `schedule.py`): `window` bounds the slots a layer may have loading or
landed-but-unused at once, so the rest of the cache keeps a stable resident set instead of churning, and
`read_ahead` queues the next layer's likely experts, loaded in forward order into that window as the current layer's
experts finish. Loads for later layers only ever evict experts whose next use is furthest away as seen from the
layer computing now (the layer-aware order), never what that layer or the next still needs.

When the store already lives in the compute device's memory (CPU store, CPU device), there is nothing to move:
the cache hands out the store's slabs directly ("zero-copy") and allocates no slots.

CPU compute of missing experts (`expert_compute`, see `placement.py`): instead of a device slot, `fetch` may yield
an expert's HOST slab (the CPU store's own copy, or a disk read into one of two reusable host buffers); the
forward computes an expert where its weights are, so only its tokens move. "cpu" does so for every expert that is
not resident, "auto" when the measured CPU time beats the measured copy. Such experts are yielded after the
resident ones (their compute overlaps the copies in flight) and before the copies. `resident_layers=N` loads the
experts of the first N MoE layers at construction and pins them for good (llama.cpp's static split).
`zero_copy=False` forces slots on a CPU store with a CPU device, so that both paths run on a machine without a GPU.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .copy_engine import make_copy_engine
from .eviction import EvictionPolicy, HotFirst, Key, RecencyIndex, make_eviction
from .placement import ExpertPlacement
from ..policy.offload_policy import EXPERT_COMPUTES, PolicyError
from ..stats import OffloadStats
from ..storage.store import ExpertStore

logger = logging.getLogger(__name__)

HOST_BUFFERS = 2      # disk reads for CPU compute: the next expert's read overlaps this one's compute


@dataclass(eq=False)
class Slot:
    """One device slot and what it holds."""

    index: int
    key: Key | None = None            # the (layer, expert) resident or loading here
    pins: int = 0                     # consumers that need it to stay
    load: object | None = None        # the in-flight load (a copy-engine handle), None once landed
    release: object | None = None     # marker after the compute that last read this slot (a CUDA event)
    prefetched: bool = False          # brought in by a prefetch and not used yet
    permanent: bool = False           # a resident layer's expert: pinned for good, never evicted


class ExpertCache:
    """Device-resident experts within a byte budget.

    Example:
        >>> cache = ExpertCache(store, torch.device("cpu"), 2**28, "lru", stats)  # doctest: +SKIP
        >>> for expert, slab in cache.fetch(layer=0, experts=[1, 5]): ...        # doctest: +SKIP
        >>> cache = ExpertCache(store, torch.device("cuda:0"), 2**34, "layer", stats, expert_compute="auto",
        ...                     resident_layers=4)                                 # doctest: +SKIP
    """

    def __init__(self, store: ExpertStore, device: torch.device, budget_bytes: int,
                 eviction: str | EvictionPolicy, stats: OffloadStats, expert_compute: str = "device",
                 resident_layers: int = 0, zero_copy: bool | None = None,
                 placement: ExpertPlacement | None = None):
        """`expert_compute`: "device" | "cpu" | "auto" (module docstring); `resident_layers`: the first N MoE layers'
        experts loaded now and never evicted; `zero_copy`: None decides (CPU store and CPU device), False forces
        slots; `placement`: the "auto" decision with injected measurements (default: calibrated here)."""
        if expert_compute not in EXPERT_COMPUTES:
            raise ValueError(f"expert_compute={expert_compute!r} is not allowed; allowed: {list(EXPERT_COMPUTES)}")
        can_zero_copy = device.type == "cpu" and store.in_host_memory
        if zero_copy and not can_zero_copy:
            raise ValueError(f"zero_copy=True needs a store in host memory and the CPU device (got a "
                             f"{type(store).__name__} and device={device})")
        if not 0 <= resident_layers <= len(store.layouts):
            raise PolicyError(f"resident_layers={resident_layers} is not allowed for a model with "
                              f"{len(store.layouts)} MoE layers; allowed: 0 to {len(store.layouts)}")
        self.store, self.device, self.stats = store, device, stats
        self.expert_compute = expert_compute
        self.eviction = eviction if isinstance(eviction, EvictionPolicy) else \
            make_eviction(eviction, num_layers=len(store.layouts))
        # A streamed pass visits every layer in forward order, so what is needed furthest away is known: the
        # layer-aware order, whatever policy serves the on-demand passes; within a layer the coldest expert leaves,
        # so the hottest stay resident (the layer's least recent rotated the resident set every pass: with skewed
        # routing, 3-18% more reads in tests/test_streaming.py's simulation; a tie with uniform routing).
        self.stream_eviction = HotFirst(num_layers=len(store.layouts))
        self.zero_copy = can_zero_copy if zero_copy is None else zero_copy
        self.slot_numel = max(lay.numel for lay in store.layouts)
        self.slot_bytes = self.slot_numel * store.dtype.itemsize
        self.num_slots = 0 if self.zero_copy else budget_bytes // self.slot_bytes
        # Zero-copy: every expert is in place already, so there is nothing to pin or to decide.
        self.resident_layers = 0 if self.zero_copy else resident_layers
        pinned_for_good = sum(store.num_experts[:self.resident_layers])
        others_copy = expert_compute != "cpu" and self.resident_layers < len(store.layouts)
        if self.resident_layers and self.num_slots < pinned_for_good + others_copy:   # before allocating
            raise PolicyError(f"an expert cache of {self.num_slots} slots ({budget_bytes} bytes) cannot hold "
                              f"resident_layers={resident_layers} ({pinned_for_good} experts)"
                              f"{' and still load the other layers' if others_copy else ''}; use at least "
                              f"{(pinned_for_good + others_copy) * self.slot_bytes} bytes, or fewer "
                              f"resident_layers")
        stats.capacity_bytes = self.num_slots * self.slot_bytes
        with torch.inference_mode(False):   # a model built under inference mode must still copy into its slots
            self.memory = torch.empty(self.num_slots, self.slot_numel, dtype=store.dtype, device=device)
        self.copy = None if self.zero_copy else make_copy_engine(store, device)
        self.placement = None
        if expert_compute == "auto" and not self.zero_copy:
            # Calibrated in the dtype experts compute in (a quantized store's slabs are uint8 bytes).
            self.placement = placement or ExpertPlacement.calibrated(device, store.compute_dtype, self.slot_numel,
                                                                     store.in_host_memory, self.copy.meter)
            stats.placement = self.placement.measurements
        self._host_buffers: list[torch.Tensor] = []   # disk reads of experts computed on the CPU, made on first use
        self.slots = [Slot(i) for i in range(self.num_slots)]
        self.free = self.slots[::-1]                             # a stack: slot 0 is handed out first
        self.resident: dict[Key, Slot] = {}                      # resident or loading
        self.recency = RecencyIndex()                             # least recently used first, overall and per layer
        # Kept as sets so that no step scans every slot (thousands for a fine-grained MoE).
        self._prefetched: set[Slot] = set()                      # slots holding an unused speculative load
        self._in_flight: set[Slot] = set()                       # slots whose load nobody has waited for yet
        self.lock = threading.RLock()
        self.window: int | None = None       # streaming: most loads in flight or landed-unused at once
        self.ahead_room = 0                  # most read-ahead loads in flight or landed-unused at once
        self.ahead: list[Key] = []           # streaming: the next layer's experts to load, in order
        self.current_layer = 0               # the layer being computed (victims are chosen as seen from it)
        self._loaded_this_pass: set[Key] = set()
        # Micro-batches (`fetch(hold=True)`), per generating thread: the pins kept for the layer's later slices,
        # and that layer, none of whose experts leaves before the thread's `release_held`.
        self._held: dict[int, list[Key]] = {}
        self._hold_layers: dict[int, int] = {}
        self._holding = False                # the running fetch (under the lock) holds its pins
        # On CUDA a wait does not block the host, the compute stream does: stalls are timed there, by an event
        # pair around each wait, and added to the stats once both events have run.
        self._device_stalls: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        if self.resident_layers:
            self._load_resident_layers()

    # -- public -------------------------------------------------------------------------------------------------

    def fetch(self, layer: int, experts: Sequence[int], on_pinned: Callable[[], None] | None = None,
              tokens: Sequence[int] | None = None, hold: bool = False) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (expert, flat slab on the device) for each expert, resident ones first; an expert computed on the
        CPU (`expert_compute`) comes as a flat slab in host memory instead.

        `on_pinned` runs once this layer's experts are pinned and their loads issued: the moment to prefetch for
        later layers without evicting anything this layer needs. `tokens[i]`: how many tokens `experts[i]` serves
        (what `expert_compute="auto"` weighs; None: one each). The cache's lock is held until the generator is
        exhausted or closed.

        `hold=True` (a micro-batch other than its layer's last, `microbatch.py`): every expert served stays pinned
        after use, and no other expert of the layer is evicted, so no later micro-batch of the layer reads one
        again, until `release_held()`. Experts of a disk store are then copied to the device rather than computed
        on the CPU from a host buffer (which a later micro-batch would read again).
        """
        if self.zero_copy:
            if on_pinned is not None:
                on_pinned()
            for e in experts:
                self.stats.record_hit(layer)
                yield e, self.store.host_slab(layer, e)
            return
        with self.lock:
            self._holding = hold
            if hold:
                self._hold_layers[threading.get_ident()] = layer
            try:
                yield from self._fetch_locked(layer, experts, on_pinned, tokens)
            finally:
                self._holding = False

    def release_held(self) -> None:
        """Drop the pins this thread's `fetch(hold=True)` kept: its layer's last micro-batch is done (or failed)."""
        with self.lock:
            thread = threading.get_ident()
            held = self._held.pop(thread, [])
            for key in list(held):
                self._unpin(key, held)
            self._hold_layers.pop(thread, None)

    @property
    def held(self) -> int:
        """Pins kept for later micro-batches now, over all threads."""
        return sum(len(keys) for keys in self._held.values())

    def begin_pass(self, window: int | None, ahead_room: int | None = None) -> None:
        """A forward pass starts: `window` bounds its loads in flight (None: no bound, on-demand schedule);
        `ahead_room` bounds its read-ahead (default: the window's room, none without a window)."""
        with self.lock:
            self.window, self.ahead = window, []
            self.ahead_room = (window or 0) if ahead_room is None else ahead_room
            self._loaded_this_pass.clear()

    def read_ahead(self, layer: int, experts: Sequence[int]) -> None:
        """Queue `experts` of `layer` (the next one) to load, in order, into the window while the current layer
        computes; replaces any earlier queue. Exact: the router still decides, a wrong guess costs bytes."""
        if self.zero_copy or self.expert_compute == "cpu":   # "cpu" copies nothing but the resident layers
            return
        with self.lock:
            self.ahead = [(layer, e) for e in experts if (layer, e) not in self.resident]

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Start loading `experts` of `layer` ahead of need, into free slots or slots whose expert is neither in
        use, nor in flight, nor itself prefetched and unused. Never exceeds the budget. Returns loads started."""
        if self.zero_copy or self.expert_compute == "cpu":   # "cpu" copies nothing but the resident layers
            return 0
        started = 0
        with self.lock:
            for e in experts:
                if (layer, e) in self.resident:
                    continue
                if not self._load_speculative((layer, e), readahead=False):
                    break
                started += 1
        return started

    def resident_bytes(self) -> int:
        return len(self.resident) * self.slot_bytes

    def close(self) -> None:
        with self.lock:
            if self.copy is not None:
                for slot in self.slots:
                    self._wait_quietly(slot)
                self.copy.close()
            self.memory = torch.empty(0)
            self._host_buffers.clear()
            self.resident.clear()
            self.recency.clear()

    # -- one fetch, under the lock ------------------------------------------------------------------------------

    def _fetch_locked(self, layer: int, experts: Sequence[int], on_pinned: Callable[[], None] | None,
                      tokens: Sequence[int] | None) -> Iterator[tuple[int, torch.Tensor]]:
        numel = self.store.layouts[layer].numel
        self.current_layer = layer
        self.stream_eviction.on_route(layer, experts)
        self.ahead = [key for key in self.ahead if key[0] != layer]   # queued for this layer: its demand covers it
        keys = [(layer, e) for e in experts]
        for key in keys:
            slot = self.resident.get(key)
            if slot is not None and slot.prefetched:
                self._set_prefetched(slot, False)
                self.stats.record_prefetch_hit(layer)
        landed = [k for k in keys if k in self.resident and self.resident[k].load is None]
        issued = [k for k in keys if k in self.resident and k not in landed]   # already on their way (prefetched)
        missing = [k for k in keys if k not in self.resident]
        tokens_of = dict(zip(keys, tokens)) if tokens is not None else {}
        cpu = {k for k in missing if self._computes_on_cpu(k, tokens_of.get(k, 1))}
        on_cpu = [k for k in missing if k in cpu]                               # computed from the host copy
        pending = [k for k in missing if k not in cpu]                          # to load, in order
        total = len(issued) + len(pending)
        pinned: list[Key] = []                   # pins this fetch holds, dropped as it moves on
        for key in landed + issued:              # pinned now: nothing this layer needs can be evicted for it
            self.stats.record_hit(layer)
            self._pin(key, pinned)
        try:
            self._top_up(pending, issued, pinned, served=0)
            if on_pinned is not None:
                on_pinned()
            for key in landed:
                yield key[1], self.memory[self.resident[key].index][:numel]
                self._done_with(key, pinned)
                self._top_up(pending, issued, pinned, served=0)
            if on_cpu:                           # while the copies of this layer's other misses are in flight
                yield from self._compute_on_cpu(on_cpu, tokens_of, pending, issued, pinned)
            for done in range(total):
                if done >= len(issued):          # every slot was pinned by earlier loads: now some are free
                    self._issue(pending, issued, pinned, served=done)
                    if done >= len(issued):
                        raise RuntimeError(f"expert cache has no free slot for layer {layer} "
                                           f"({self.num_slots} slots, all pinned)")
                key = self._first_arrived(issued, done)
                self._wait(self.resident[key])
                # The expert leaves the stream window as it starts computing, so the next read starts now: admitted
                # only after the compute, each read waited 1/window of an expert's compute with the disk idle.
                self._top_up(pending, issued, pinned, served=done + 1)
                yield key[1], self.memory[self.resident[key].index][:numel]
                self._done_with(key, pinned)
                self._top_up(pending, issued, pinned, served=done + 1)
        finally:
            # Done, or an exception mid-layer: let in-flight loads land, drop our pins; the cache stays consistent.
            for key in issued:
                slot = self.resident.get(key)
                if slot is not None:
                    self._wait_quietly(slot)
            for key in list(pinned):
                self._unpin(key, pinned)

    def _computes_on_cpu(self, key: Key, tokens: int) -> bool:
        """Whether missing expert `key` with `tokens` tokens computes on the CPU instead of being copied."""
        if self.expert_compute == "device" or key[0] < self.resident_layers:
            return False                         # (a resident layer's expert is missing only after a failed read)
        if self._holding and not self.store.in_host_memory:
            return False                         # a host buffer is not kept for the layer's next micro-batch
        if self.expert_compute == "cpu":
            return True
        nbytes, numel = self.store.slab_bytes(key[0]), self.store.layouts[key[0]].numel
        self.placement.log_rule(nbytes, numel)
        return self.placement.on_cpu(nbytes, numel, tokens)

    def _compute_on_cpu(self, keys: list[Key], tokens_of: dict[Key, int], pending: list[Key], issued: list[Key],
                        pinned: list[Key]) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield the host slabs of `keys`: the store's own (host store) or read into the host buffers, the next
        read running while this expert computes. Each expert's compute is timed from its yield to the resume."""
        host_store = self.store.in_host_memory
        buffers = [] if host_store else self._host_buffer_pool()
        reads: dict[int, object] = {}

        def start_read(i: int) -> None:
            if buffers and i < len(keys):
                layer, expert = keys[i]
                reads[i] = self.copy.read_host(layer, expert, buffers[i % len(buffers)])

        for i in range(len(buffers)):
            start_read(i)
        try:
            for i, key in enumerate(keys):
                layer, expert = key
                numel = self.store.layouts[layer].numel
                self.stats.record_cpu_compute(layer, 0 if host_store else self.store.slab_bytes(layer))
                if host_store:
                    slab = self.store.host_slab(layer, expert)
                else:
                    waited = time.perf_counter()
                    reads.pop(i).wait()          # a failed read raises here; nothing is resident to clean up
                    self.stats.record_stall(layer, time.perf_counter() - waited)
                    slab = buffers[i % len(buffers)][:numel]
                if self.device.type == "cuda":
                    # The forward's token gather waits for the device's queued work anyway: wait here, so that
                    # the timer below measures the CPU compute, not the GPU queue.
                    torch.cuda.current_stream(self.device).synchronize()
                started = time.perf_counter()
                yield expert, slab
                seconds = time.perf_counter() - started
                self.stats.record_cpu_time(layer, seconds)
                if self.placement is not None:
                    self.placement.record_cpu(tokens_of.get(key, 1), seconds)
                start_read(i + len(buffers))     # its buffer was read by the compute that just finished
                self._top_up(pending, issued, pinned, served=0)
        finally:
            for load in reads.values():          # stopped early or failed: no read may land in a reused buffer
                try:
                    load.wait()
                except Exception:
                    pass

    def _host_buffer_pool(self) -> list[torch.Tensor]:
        if not self._host_buffers:
            with torch.inference_mode(False):    # written by reader threads, read under no_grad
                self._host_buffers = [torch.empty(self.slot_numel, dtype=self.store.dtype)
                                      for _ in range(HOST_BUFFERS)]
        return self._host_buffers

    def _load_resident_layers(self) -> None:
        """Load every expert of the first `resident_layers` MoE layers and pin them for good."""
        keys = [(layer, e) for layer in range(self.resident_layers) for e in range(self.store.num_experts[layer])]
        try:
            for key in keys:
                slot = self.free.pop()
                self._load(slot, key, demand=True)
                slot.permanent, slot.pins = True, 1
            for key in keys:
                self._wait(self.resident[key])
        except BaseException:
            self.close()
            raise
        finally:
            self._loaded_this_pass.clear()
        self._device_stalls.clear()          # waits at attach are not a forward's stalls
        self.stats.reset()                   # (the peak starts at the resident layers' bytes)
        logger.info("hf_moe_offload: resident_layers=%d: %d experts (%d bytes) loaded into the device cache and "
                    "pinned for good; %d slots left for the other layers", self.resident_layers, len(keys),
                    len(keys) * self.slot_bytes, len(self.free))

    def _top_up(self, pending: list[Key], issued: list[Key], pinned: list[Key], served: int) -> None:
        """This layer's missing experts first, then the read-ahead queue, within the window."""
        self._issue(pending, issued, pinned, served)
        if not pending:
            self._issue_ahead(in_flight=len(issued) - served)

    def _issue(self, pending: list[Key], issued: list[Key], pinned: list[Key], served: int) -> None:
        """Start loads for this layer's pending experts while a slot can be freed without touching a pin (and, when
        streaming, while fewer than `window` of its loads are issued and not yet served)."""
        while pending:
            if pending[0] in self.resident:      # brought in meanwhile (a prefetch): no second read
                key = pending.pop(0)
                self.stats.record_hit(key[0])
                self._pin(key, pinned)
                issued.append(key)
                continue
            if self.window is not None and len(issued) - served >= max(self.window, 1):
                return
            slot = self._free_slot(pending[0][0])
            if slot is None:
                return
            key = pending.pop(0)
            self._load(slot, key, demand=True)
            self._pin(key, pinned)
            if key[0] < self.resident_layers:    # read again after a failed read: pinned for good again
                slot.permanent, slot.pins = True, slot.pins + 1
            self.stats.record_miss(key[0], self.store.slab_bytes(key[0]))
            issued.append(key)

    def _issue_ahead(self, in_flight: int) -> None:
        """Load queued next-layer experts into the window's remaining room, as prefetches."""
        demand = in_flight if self.window is not None else 0     # a streamed layer shares its window
        room = self.ahead_room - demand - len(self._prefetched)
        while self.ahead and room > 0:
            if self.ahead[0] in self.resident:
                self.ahead.pop(0)
                continue
            if not self._load_speculative(self.ahead[0], readahead=True):
                return
            self.ahead.pop(0)
            room -= 1

    def _load_speculative(self, key: Key, readahead: bool) -> bool:
        """Start loading `key` before anyone asked for it, if a slot can be had without displacing a sure use."""
        slot = self._free_slot(self.current_layer, speculative_for=key[0])
        if slot is None:
            return False
        self._load(slot, key, demand=False)
        self._set_prefetched(slot, True)
        self.stats.record_prefetch(key[0], self.store.slab_bytes(key[0]), readahead=readahead)
        return True

    def _first_arrived(self, issued: list[Key], start: int) -> Key:
        """Of the issued keys not yet served (`issued[start:]`), the first whose load has landed, else the oldest;
        moved to position `start` so that served keys stay in front."""
        for i in range(start, len(issued)):
            if self._landed(self.resident[issued[i]]):
                issued[start], issued[i] = issued[i], issued[start]
                break
        return issued[start]

    # -- slots ----------------------------------------------------------------------------------------------------

    def _load(self, slot: Slot, key: Key, demand: bool) -> None:
        if key in self._loaded_this_pass:
            self.stats.record_repeat_read(key[0])
        self._loaded_this_pass.add(key)
        slot.key = key
        self._set_prefetched(slot, False)
        self.resident[key] = slot
        self.recency.touch(key)
        slot.load = self.copy.load(key[0], key[1], self.memory[slot.index], after=slot.release, demand=demand)
        self._in_flight.add(slot)
        self.stats.set_resident(self.resident_bytes())

    def _free_slot(self, layer: int, speculative_for: int | None = None) -> Slot | None:
        """A slot for a load while `layer` computes: a demand load of `layer`, or (`speculative_for`) a prefetch
        or read-ahead of that later layer."""
        if not self.free:
            self._reap_finished_loads()
        if self.free:
            return self.free.pop()
        victim = self._victim(layer, speculative_for)
        if victim is None and speculative_for is None:
            # Demand beats prefetch: let an unused prefetch still in flight land, then it may be evicted.
            in_flight = [s for s in self._in_flight if s.load is not None and s.pins == 0]
            if in_flight:
                self._wait_quietly(in_flight[0])
                if self.free:                    # its read failed: the slot is free already
                    return self.free.pop()
                victim = self._victim(layer)
        if victim is None:
            return None
        self.stats.record_eviction(victim.key[0])
        if victim.prefetched:
            self.stats.record_prefetch_wasted(victim.key[0])
        self._forget(victim)
        return victim

    def _victim(self, layer: int, speculative_for: int | None = None) -> Slot | None:
        """Which unpinned, landed expert leaves to make room while `layer` computes. A speculative load never
        evicts another unused speculative load, nor an expert whose layer comes up no later than its own (that
        would trade a sure use for a guess)."""
        policy = self.eviction if self.window is None else self.stream_eviction
        key = policy.select(self.recency, layer, lambda k: self._evictable(self.resident[k], speculative_for))
        return None if key is None else self.resident[key]

    def _evictable(self, slot: Slot, speculative_for: int | None) -> bool:
        if slot.pins or slot.load is not None:
            return False
        if slot.key[0] in self._hold_layers.values():   # a later micro-batch of that layer may route to it
            return False
        if speculative_for is None:
            return True
        if slot.prefetched:
            return False
        if slot.key[0] == speculative_for == self.current_layer:   # both next needed a whole cycle from now
            return True
        return self._layers_until(slot.key[0]) > self._layers_until(speculative_for)

    def _layers_until(self, layer: int) -> int:
        """How many MoE layers from now until `layer` runs again, in the forward order (the current one last)."""
        return (layer - self.current_layer - 1) % len(self.store.layouts)

    def _forget(self, slot: Slot) -> None:
        """The slot no longer holds its key (its memory may still be read by queued compute: `release` stays)."""
        del self.resident[slot.key]
        self.recency.remove(slot.key)
        self._set_prefetched(slot, False)
        self._in_flight.discard(slot)
        slot.key, slot.pins, slot.load, slot.permanent = None, 0, None, False

    def _set_prefetched(self, slot: Slot, prefetched: bool) -> None:
        slot.prefetched = prefetched
        if prefetched:
            self._prefetched.add(slot)
        else:
            self._prefetched.discard(slot)

    def _reap_finished_loads(self) -> None:
        """Prefetched loads that nobody waited for yet: once landed, their slots are ordinary residents."""
        for slot in list(self._in_flight):
            if slot.load is not None and slot.pins == 0 and self._landed(slot):
                self._wait_quietly(slot)

    @staticmethod
    def _landed(slot: Slot) -> bool:
        try:
            return slot.load.done()
        except Exception:   # a failed load is finished too; `wait` reports it
            return True

    def _wait(self, slot: Slot) -> None:
        """Wait for the slot's load; on failure evict its key and free the slot, then re-raise."""
        load = slot.load
        if load is None:
            return
        start = time.perf_counter()
        before = self._device_event()
        try:
            load.wait()
        except BaseException:
            self._forget(slot)
            self.free.append(slot)
            self.stats.set_resident(self.resident_bytes())
            raise
        slot.load = None
        self._in_flight.discard(slot)
        if before is None:
            self.stats.record_stall(slot.key[0], time.perf_counter() - start)
        else:
            self._device_stalls.append((slot.key[0], before, self._device_event()))
            if len(self._device_stalls) > 4096:
                self.settle_stalls(block=False)

    def _device_event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def settle_stalls(self, block: bool = True) -> None:
        """Add the compute stream's measured waits to `stall_s` (CUDA; all of them when `block`, else those done)."""
        with self.lock:   # re-entrant: `_wait` settles under it too
            pending = []
            for layer, before, after in self._device_stalls:
                if block:
                    after.synchronize()
                if block or after.query():
                    self.stats.record_stall(layer, before.elapsed_time(after) / 1e3)
                else:
                    pending.append((layer, before, after))
            self._device_stalls = pending

    def _wait_quietly(self, slot: Slot) -> None:
        """`_wait` for cleanup paths and prefetches: a failure is logged, the slot freed, nothing raised (the
        next fetch of that expert reads it again and reports its error)."""
        key = slot.key
        try:
            self._wait(slot)
        except Exception as err:
            logger.warning("hf_moe_offload: loading expert %s of MoE layer %s failed (%s); it will be read again "
                           "when next needed", key[1] if key else "?", key[0] if key else "?", err)

    def _pin(self, key: Key, pinned: list[Key]) -> None:
        self.resident[key].pins += 1
        pinned.append(key)
        self.eviction.on_use(key)
        self.recency.touch(key)

    def _done_with(self, key: Key, pinned: list[Key]) -> None:
        """The consumer moved past `key`: unpin it, or keep the pin for the layer's next micro-batch."""
        if self._holding and key in self.resident:
            pinned.remove(key)
            self._held.setdefault(threading.get_ident(), []).append(key)
        else:
            self._unpin(key, pinned)

    def _unpin(self, key: Key, pinned: list[Key]) -> None:
        pinned.remove(key)
        slot = self.resident.get(key)
        if slot is None:                         # its load failed: already evicted
            return
        slot.pins -= 1
        if slot.pins == 0:
            slot.release = self.copy.release_marker(self.device)
