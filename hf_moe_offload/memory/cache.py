"""`ExpertCache`: a fixed number of device slots (the byte budget), an eviction policy, and pins so that an expert
that is loading or computing is never evicted.

`fetch(layer, experts)` yields `(expert, slab)`, the resident experts first; the missing ones load asynchronously
meanwhile, as many at once as there are slots free of pins, and are yielded as they arrive. A pin is dropped when
the consumer moves on, so a batch that needs more experts than the cache holds still runs, in waves. One lock
serialises the callers, and a failed load leaves nothing behind (its slot is freed before the error is raised).

Streaming passes (`runtime/schedule.py`) bound the loads outstanding with a window and queue the next layer's likely
experts with `read_ahead`. A CPU store with the CPU device is served in place ("zero-copy", no slots). The parts:
`SlotTable` (slots.py), `PassState` (pass_state.py), `HeldPins` (held_pins.py, micro-batches), `CpuCompute`
(cpu_compute.py, `expert_compute`), `StallClock` (stall_clock.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterator, Sequence

import torch

from .copy_engine import make_copy_engine
from .cpu_compute import CpuCompute
from .eviction import EvictionPolicy, HotFirst, Key, make_eviction
from .held_pins import HeldPins
from .pass_state import PassState
from .placement import ExpertPlacement
from .slots import Slot, SlotTable
from .stall_clock import StallClock
from .staging import StagingRoom
from .stream_order import StreamOrder
from ..policy.offload_policy import EXPERT_COMPUTES, PolicyError
from ..stats import OffloadStats
from ..storage.store import ExpertStore

logger = logging.getLogger(__name__)

__all__ = ["ExpertCache", "Slot"]


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
                 placement: ExpertPlacement | None = None, lock: threading.RLock | None = None):
        """`expert_compute`: "device" | "cpu" | "auto" (cpu_compute.py); `resident_layers`: the first N MoE layers'
        experts loaded now and pinned for good; `zero_copy`: None decides (CPU store and CPU device), False forces
        slots; `placement`: the "auto" decision with injected measurements (default: calibrated here); `lock`: one
        shared with other caches (`build_cache_group`), default a new one."""
        self.zero_copy = _check_arguments(store, device, expert_compute, resident_layers, zero_copy)
        self.store, self.device, self.stats = store, device, stats
        self.eviction = eviction if isinstance(eviction, EvictionPolicy) else \
            make_eviction(eviction, num_layers=len(store.layouts))
        # A streamed pass visits every layer in forward order, so what is needed furthest away is known: the
        # layer-aware order, whatever policy serves the on-demand passes; within a layer the coldest expert leaves,
        # so that the hottest stay resident instead of the resident set rotating every pass.
        self.stream_eviction = HotFirst(num_layers=len(store.layouts))
        self.slot_numel = max(lay.numel for lay in store.layouts)
        self.slot_bytes = self.slot_numel * store.dtype.itemsize
        self.num_slots = 0 if self.zero_copy else budget_bytes // self.slot_bytes
        # Zero-copy: every expert is in place already, so there is nothing to pin or to decide.
        self.resident_layers = 0 if self.zero_copy else resident_layers
        _check_room(store, expert_compute, self.resident_layers, self.num_slots, self.slot_bytes, budget_bytes)
        # The slots that take turns (the resident layers' stay): how much routing the eviction order can keep.
        permanent = sum(store.num_experts[:self.resident_layers])
        self.eviction.add_slots(self.num_slots - permanent)
        stats.capacity_bytes = self.num_slots * self.slot_bytes
        with torch.inference_mode(False):   # a model built under inference mode must still copy into its slots
            self.memory = torch.empty(self.num_slots, self.slot_numel, dtype=store.dtype, device=device)
        self.copy = None if self.zero_copy else make_copy_engine(store, device)
        self.order = StreamOrder(self.memory, getattr(self.copy, "stream", None), device)
        if expert_compute == "auto" and not self.zero_copy:
            # Calibrated in the dtype experts compute in (a quantized store's slabs are uint8 bytes).
            placement = placement or ExpertPlacement.calibrated(device, store.compute_dtype, self.slot_numel,
                                                                store.in_host_memory, self.copy.meter)
            stats.placement = placement.measurements
        else:
            placement = None
        self.cpu = CpuCompute(store, device, stats, self.copy, placement, self.slot_numel, expert_compute)
        self.table = SlotTable(self.num_slots)
        self.lock = lock if lock is not None else threading.RLock()
        self.pass_state = PassState(len(store.layouts))
        self.staging = StagingRoom(self.table, self.pass_state, self.num_slots, permanent=permanent)
        self.held_pins = HeldPins()
        self.stalls = StallClock(device, stats)
        if self.resident_layers:
            _load_resident_layers(self)

    # -- public -------------------------------------------------------------------------------------------------

    @property
    def resident(self) -> dict[Key, Slot]:
        """(layer, expert) -> slot, for every expert resident or loading (`slots`: every slot)."""
        return self.table.resident

    @property
    def slots(self) -> list[Slot]:
        return self.table.slots

    @property
    def expert_compute(self) -> str:
        """Where missing experts compute: "device" | "cpu" | "auto" (owned by the CPU-compute path)."""
        return self.cpu.mode

    @expert_compute.setter
    def expert_compute(self, mode: str) -> None:
        self.cpu.mode = mode

    @property
    def placement(self) -> ExpertPlacement | None:
        """`expert_compute="auto"`: the measured decision (None otherwise)."""
        return self.cpu.placement

    @placement.setter
    def placement(self, placement: ExpertPlacement | None) -> None:
        self.cpu.placement = placement

    def fetch(self, layer: int, experts: Sequence[int], on_pinned: Callable[[], None] | None = None,
              tokens: Sequence[int] | None = None, hold: bool = False) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (expert, flat slab on the device) for each expert, resident ones first; an expert computed on the
        CPU (`expert_compute`) comes as a flat slab in host memory, after the resident ones.

        `on_pinned` runs once this layer's experts are pinned and their loads issued: the moment to prefetch for
        later layers without evicting anything this layer needs. `tokens[i]`: how many tokens `experts[i]` serves
        (what "auto" weighs; None: one each). The lock is held until the generator is exhausted or closed.
        `hold=True` (a micro-batch other than its layer's last): every expert served stays pinned, and no other
        expert of the layer is evicted, until `release_held()`."""
        if self.zero_copy:
            yield from _serve_in_place(self, layer, experts, on_pinned)
            return
        with self.lock:
            self.held_pins.active = hold
            if hold:
                self.held_pins.hold_layer(layer)
            try:
                yield from _LayerFetch(self, layer, experts, tokens).run(on_pinned)
            finally:
                self.held_pins.active = False

    def release_held(self) -> None:
        """Drop the pins this thread's `fetch(hold=True)` kept: its layer's last micro-batch is done (or failed)."""
        with self.lock:
            held = self.held_pins.release()
            for key in list(held):
                self._unpin(key, held)

    @property
    def held(self) -> int:
        """Pins kept for later micro-batches now, over all threads."""
        return self.held_pins.count

    def begin_pass(self, window: int | None, ahead_room: int | None = None) -> None:
        """A forward pass starts: `window` bounds its loads in flight (None: no bound, on-demand schedule);
        `ahead_room` bounds its read-ahead (default: the window's room, none without a window)."""
        with self.lock:
            self.pass_state.begin(window, ahead_room)

    def read_ahead(self, layer: int, experts: Sequence[int]) -> None:
        """Queue `experts` of `layer` (the next one) to load, in order, into the window while the current layer
        computes; replaces any earlier queue. Exact: the router still decides, a wrong guess costs bytes."""
        if self.zero_copy or self.expert_compute == "cpu":   # "cpu" copies nothing but the resident layers
            return
        with self.lock:
            self.pass_state.ahead = [(layer, e) for e in experts if (layer, e) not in self.table.resident]

    def issue_read_ahead(self) -> None:
        """Start the queued read-ahead now, as if no load of this cache were in flight: for a cache whose device is
        not computing (`CacheGroup`), whose queue its own next fetch would only drain at that layer's demand."""
        if self.zero_copy or self.expert_compute == "cpu":
            return
        with self.lock:
            self._issue_ahead(in_flight=0)

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Start loading `experts` of `layer` ahead of need, into free slots or slots whose expert is neither in
        use, nor in flight, nor itself prefetched and unused. Never exceeds the budget. Returns loads started."""
        if self.zero_copy or self.expert_compute == "cpu":   # "cpu" copies nothing but the resident layers
            return 0
        started = 0
        with self.lock:
            for e in experts:
                if (layer, e) in self.table.resident:
                    continue
                if not self._load_speculative((layer, e), readahead=False):
                    break
                started += 1
        return started

    def resident_bytes(self) -> int:
        return len(self.table.resident) * self.slot_bytes

    def settle_stalls(self, block: bool = True) -> None:
        """Add the compute stream's measured waits to `stall_s` (CUDA; all of them when `block`, else those done)."""
        with self.lock:
            self.stalls.settle(block)

    def close(self) -> None:
        with self.lock:
            if self.copy is not None:
                for slot in self.table.slots:
                    self._wait_quietly(slot)
                self.copy.close()
            self.order.before_free()    # readers on other streams (a user's, continuous batching's) are done
            self.memory = torch.empty(0)
            self.cpu.close()
            self.table.resident.clear()
            self.table.recency.clear()

    def _issue_ahead(self, in_flight: int) -> None:
        """Load queued next-layer experts into the window's remaining room, as prefetches."""
        state = self.pass_state
        demand = in_flight if state.window is not None else 0     # a streamed layer shares its window
        if not state.ahead:
            return
        # Staging: the guesses of layers that have run are judged (wrong), and their slots are the next guesses'.
        unused = self.staging.guesses_of(state.ahead[0][0]) if self.staging.room() else self.table.unused_prefetches
        room = state.ahead_room - demand - unused
        while state.ahead and room > 0:
            if state.ahead[0] in self.table.resident:
                state.ahead.pop(0)
                continue
            if not self._load_speculative(state.ahead[0], readahead=True):
                return
            state.ahead.pop(0)
            room -= 1

    def _load_speculative(self, key: Key, readahead: bool) -> bool:
        """Start loading `key` before anyone asked for it, if a slot can be had without displacing a sure use."""
        if readahead and self.staging.room():
            slot = _staging_slot(self, key[0])
        else:
            slot = self._free_slot(self.pass_state.current_layer, speculative_for=key[0])
        if slot is None:
            return False
        self._load(slot, key, demand=False)
        self.table.set_prefetched(slot, True)
        self.stats.record_prefetch(key[0], self.store.slab_bytes(key[0]), readahead=readahead)
        return True

    # -- slots (also used by `_LayerFetch`) -------------------------------------------------------------------------

    def _load(self, slot: Slot, key: Key, demand: bool) -> None:
        if self.pass_state.note_load(key):
            self.stats.record_repeat_read(key[0])
        self.table.occupy(slot, key)
        self.table.start_load(slot, self.copy.load(key[0], key[1], self.memory[slot.index],
                                                   after=self.order.markers_for_copy(slot), demand=demand))
        self.stats.set_resident(self.resident_bytes())

    def _free_slot(self, layer: int, speculative_for: int | None = None) -> Slot | None:
        """A slot for a load while `layer` computes: a demand load of `layer`, or (`speculative_for`) a prefetch
        or read-ahead of that later layer."""
        table = self.table
        if not table.free:
            self._settle_landed()
        # While guesses are read ahead, demand loads leave the staging room to them (`StagingRoom.regular_full`).
        keep_guesses = speculative_for is None and self.staging.regular_full()
        if table.free and not keep_guesses:
            return table.free.pop()
        victim = _victim(self, layer, speculative_for, keep_guesses)
        if victim is None and table.free:
            return table.free.pop()
        if victim is None and speculative_for is None:
            victim = _demand_victim(self, layer)
            if victim is None and table.free:    # a read in flight failed: its slot is free already
                return table.free.pop()
        if victim is None:
            return None
        self._evict(victim)
        return victim

    def _settle_landed(self) -> None:
        """Prefetches nobody waited for: once landed, ordinary residents (a failed read frees its slot)."""
        for slot in self.table.unwaited():
            if slot.load is not None and slot.pins == 0 and SlotTable.has_landed(slot):
                self._wait_quietly(slot)

    def _evict(self, slot: Slot) -> None:
        self.stats.record_eviction(slot.key[0])
        if self.table.is_prefetched(slot):
            self.stats.record_prefetch_wasted(slot.key[0])
        self._forget(slot)

    def _forget(self, slot: Slot) -> None:
        """Evict the slot's key (kept as a method so that tests can watch evictions)."""
        self.table.forget(slot)

    def _wait(self, slot: Slot) -> None:
        """Wait for the slot's load; on failure evict its key and free the slot, then re-raise."""
        load = slot.load
        if load is None:
            return
        started = self.stalls.start()
        try:
            load.wait()
        except BaseException:
            self._forget(slot)
            self.table.free.append(slot)
            self.stats.set_resident(self.resident_bytes())
            raise
        self.table.landed(slot)
        self.order.landed(slot, load)
        self.stalls.stop(slot.key[0], started)

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
        self.table.resident[key].pins += 1
        pinned.append(key)
        self.eviction.on_use(key)
        self.table.recency.touch(key)

    def _unpin(self, key: Key, pinned: list[Key]) -> None:
        pinned.remove(key)
        slot = self.table.resident.get(key)
        if slot is None:                         # its load failed: already evicted
            return
        slot.pins -= 1
        if slot.pins == 0:
            self.order.released(slot, self.copy.release_marker(self.device))


class _LayerFetch:
    """One `fetch` of one layer, under the cache's lock. Its keys are sorted into `landed` (resident, served first),
    `on_cpu` (computed from the host copy), `pending` (to load, in order) and `issued` (loading or landed, not yet
    served; served ones are kept in front); `pinned` holds the pins it must drop as it moves on."""

    def __init__(self, cache: ExpertCache, layer: int, experts: Sequence[int], tokens: Sequence[int] | None):
        self.cache, self.layer = cache, layer
        resident, table, stats = cache.table.resident, cache.table, cache.stats
        cache.pass_state.enter_layer(layer)
        cache.eviction.on_route(layer, experts)
        cache.stream_eviction.on_route(layer, experts)
        keys = [(layer, e) for e in experts]
        for key in keys:
            slot = resident.get(key)
            if slot is not None and table.is_prefetched(slot):
                table.set_prefetched(slot, False)
                stats.record_prefetch_hit(layer)
        self.landed = [k for k in keys if k in resident and resident[k].load is None]
        self.issued = [k for k in keys if k in resident and k not in self.landed]   # prefetched, on their way
        missing = [k for k in keys if k not in resident]
        self.tokens_of = dict(zip(keys, tokens)) if tokens is not None else {}
        # (A resident layer's expert is missing only after a failed read: it is read again, never computed on the CPU.)
        cpu = {k for k in missing if k[0] >= cache.resident_layers
               and cache.cpu.chooses(k, self.tokens_of.get(k, 1), cache.held_pins.active)}
        self.on_cpu = [k for k in missing if k in cpu]
        self.pending = [k for k in missing if k not in cpu]
        self.pinned: list[Key] = []
        for key in self.landed + self.issued:    # pinned now: nothing this layer needs can be evicted for it
            stats.record_hit(layer)
            cache._pin(key, self.pinned)

    def run(self, on_pinned: Callable[[], None] | None) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (expert, slab): the landed experts, then the CPU-computed ones (while this layer's copies are in
        flight), then the loads as they arrive; `on_pinned` runs once all are pinned and the first loads issued."""
        cache, issued, total = self.cache, self.issued, len(self.issued) + len(self.pending)
        try:
            self.top_up(served=0)
            if on_pinned is not None:
                on_pinned()
            for key in self.landed:
                cache.order.order_read(cache.table.resident[key])   # landed, maybe for another stream
                yield key[1], self._slab(key)
                self.done_with(key)
                self.top_up(served=0)
            if self.on_cpu:
                yield from cache.cpu.serve(self.on_cpu, self.tokens_of, after_each=lambda: self.top_up(served=0))
            for done in range(total):
                if done >= len(issued):          # every slot was pinned by earlier loads: now some are free
                    self.issue(served=done)
                    if done >= len(issued):
                        raise RuntimeError(f"expert cache has no free slot for layer {self.layer} "
                                           f"({cache.num_slots} slots, all pinned)")
                key = self.first_arrived(done)
                slot = cache.table.resident[key]
                waited = slot.load is not None
                if waited and slot.load.promote():   # a guess still being read: the rest is read as demand
                    cache.stats.record_prefetch_promoted(key[0])
                cache._wait(slot)
                if not waited:                   # landed for someone else meanwhile: order this stream too
                    cache.order.order_read(slot)
                # The expert leaves the stream window as it starts computing, so the next read starts now rather
                # than after the compute, which would leave the disk idle meanwhile.
                self.top_up(served=done + 1)
                yield key[1], self._slab(key)
                self.done_with(key)
                self.top_up(served=done + 1)
        finally:
            # Done, or an exception mid-layer: let in-flight loads land, drop our pins; the cache stays consistent.
            for key in issued:
                slot = cache.table.resident.get(key)
                if slot is not None:
                    cache._wait_quietly(slot)
            for key in list(self.pinned):
                cache._unpin(key, self.pinned)

    def done_with(self, key: Key) -> None:
        """The consumer moved past `key`: unpin it, or keep the pin for the layer's next micro-batch."""
        if self.cache.held_pins.active and key in self.cache.table.resident:
            self.pinned.remove(key)
            self.cache.held_pins.keep(key)
        else:
            self.cache._unpin(key, self.pinned)

    def _slab(self, key: Key) -> torch.Tensor:
        return self.cache.memory[self.cache.table.resident[key].index][:self.cache.store.layouts[self.layer].numel]

    def top_up(self, served: int) -> None:
        """This layer's missing experts first, then the read-ahead queue, within the window; `served`: how many of
        `issued` were yielded."""
        self.issue(served)
        if not self.pending:
            self.cache._issue_ahead(in_flight=len(self.issued) - served)

    def issue(self, served: int) -> None:
        """Start loads for the pending experts while a slot can be freed without touching a pin (and, when
        streaming, while fewer than `window` of this layer's loads are issued and not yet served)."""
        cache, pending, issued = self.cache, self.pending, self.issued
        window = cache.pass_state.window
        while pending:
            if pending[0] in cache.table.resident:   # brought in meanwhile (a prefetch): no second read
                key = pending.pop(0)
                cache.stats.record_hit(key[0])
                cache._pin(key, self.pinned)
                issued.append(key)
                continue
            if window is not None and len(issued) - served >= max(window, 1):
                return
            slot = cache._free_slot(pending[0][0])
            if slot is None:
                return
            key = pending.pop(0)
            cache._load(slot, key, demand=True)
            cache._pin(key, self.pinned)
            if key[0] < cache.resident_layers:   # read again after a failed read: pinned for good again
                slot.permanent, slot.pins = True, slot.pins + 1
            cache.stats.record_miss(key[0], cache.store.slab_bytes(key[0]))
            issued.append(key)

    def first_arrived(self, start: int) -> Key:
        """Of the issued keys not yet served (`issued[start:]`), the first whose load has landed, else the oldest;
        moved to position `start` so that served keys stay in front."""
        issued = self.issued
        for i in range(start, len(issued)):
            if SlotTable.has_landed(self.cache.table.resident[issued[i]]):
                issued[start], issued[i] = issued[i], issued[start]
                break
        return issued[start]


def _staging_slot(cache: ExpertCache, layer: int) -> Slot | None:
    """A slot for a read-ahead guess of `layer` (`StagingRoom.take`); a wrong guess it held leaves."""
    if not cache.table.free:
        cache._settle_landed()                   # landed guesses can be judged
    slot = cache.staging.take(layer)
    if slot is not None and slot.key is not None:
        cache._evict(slot)
    if slot is None and cache.staging.overdrawn():
        slot = cache._free_slot(cache.pass_state.current_layer, speculative_for=layer)
    return slot


def _victim(cache: ExpertCache, layer: int, speculative_for: int | None = None, keep_guesses: bool = False
            ) -> Slot | None:
    """Which unpinned, landed expert leaves to make room while `layer` computes; none of a layer held for its next
    micro-batch, nor an unused guess when `keep_guesses`. A speculative load never evicts another unused one, nor an
    expert whose layer comes up no later than its own (that would trade a sure use for a guess)."""
    table, state = cache.table, cache.pass_state

    def evictable(key: Key) -> bool:
        slot = table.resident[key]
        if slot.pins or slot.load is not None or cache.held_pins.protects(key[0]):
            return False
        if keep_guesses and table.is_prefetched(slot):
            return False
        return speculative_for is None or (not table.is_prefetched(slot)
                                           and state.needed_after(key[0], speculative_for))

    policy = cache.eviction if state.window is None else cache.stream_eviction
    key = policy.select(table.recency, layer, evictable)
    return None if key is None else table.resident[key]


def fetch_landed(cache: ExpertCache, layer: int, experts: Sequence[int],
                 announce: Callable[[], Callable[[], None] | None] | None = None
                 ) -> Iterator[tuple[list[int], torch.Tensor]]:
    """A fetch of a layer whose experts have all landed in slots: yields once (the slot of each expert, the slot
    memory [slots, slot_numel]) for one grouped computation over the slots, and drops the pins when resumed (the
    consumer's kernels are queued by then, so each slot's release follows them). Yields nothing, and records
    nothing, when an expert is missing or still loading, or the cache serves in place: then `fetch` serves it.
    `announce` runs once the experts are known to have landed, before anything is pinned (the caller's
    bookkeeping of the layer's forward); it returns the `on_pinned` callback, as `fetch` takes one."""
    if cache.zero_copy:
        return
    with cache.lock:
        resident = cache.table.resident
        if any(resident.get((layer, e)) is None or resident[(layer, e)].load is not None for e in experts):
            return
        on_pinned = announce() if announce is not None else None
        fetch = _LayerFetch(cache, layer, experts, None)
        try:
            fetch.top_up(served=0)               # the read-ahead for later layers starts now, as in `fetch`
            if on_pinned is not None:
                on_pinned()
            slots = [resident[(layer, e)] for e in experts]
            for slot in slots:
                cache.order.order_read(slot)     # landed, maybe for another stream
            yield [slot.index for slot in slots], cache.memory
        finally:
            for key in list(fetch.pinned):
                cache._unpin(key, fetch.pinned)


def _serve_in_place(cache: ExpertCache, layer: int, experts: Sequence[int],
                    on_pinned: Callable[[], None] | None) -> Iterator[tuple[int, torch.Tensor]]:
    """Zero-copy: every expert is a hit, served from the store's own host slab."""
    if on_pinned is not None:
        on_pinned()
    for e in experts:
        cache.stats.record_hit(layer)
        yield e, cache.store.host_slab(layer, e)


def _demand_victim(cache: ExpertCache, layer: int) -> Slot | None:
    """The slot a demand load of `layer` takes when the cache's order gave none: demand beats prefetch, so an unused
    prefetch still in flight may land and be evicted, and a landed guess may be too (the forward needs this expert
    now). None when a read that failed freed a slot meanwhile, or every slot is pinned."""
    in_flight = [s for s in cache.table.unwaited() if s.pins == 0]
    if in_flight:
        cache._wait_quietly(in_flight[0])
        if cache.table.free:
            return None
    return _victim(cache, layer)


def _load_resident_layers(cache: ExpertCache) -> None:
    """Load every expert of the first `resident_layers` MoE layers and pin them for good."""
    keys = [(layer, e) for layer in range(cache.resident_layers) for e in range(cache.store.num_experts[layer])]
    try:
        for key in keys:
            slot = cache.table.free.pop()
            cache._load(slot, key, demand=True)
            slot.permanent, slot.pins = True, 1
        for key in keys:
            cache._wait(cache.table.resident[key])
    except BaseException:
        cache.close()
        raise
    finally:
        cache.pass_state.forget_loads()
    cache.stalls.clear()                  # waits at attach are not a forward's stalls
    cache.stats.reset()                   # (the peak starts at the resident layers' bytes)
    logger.info("hf_moe_offload: resident_layers=%d: %d experts (%d bytes) loaded into the device cache and "
                "pinned for good; %d slots left for the other layers", cache.resident_layers, len(keys),
                len(keys) * cache.slot_bytes, len(cache.table.free))


def _check_arguments(store: ExpertStore, device: torch.device, expert_compute: str, resident_layers: int,
                     zero_copy: bool | None) -> bool:
    """Refuse what cannot work; returns whether the cache serves the store in place (zero-copy)."""
    if expert_compute not in EXPERT_COMPUTES:
        raise ValueError(f"expert_compute={expert_compute!r} is not allowed; allowed: {list(EXPERT_COMPUTES)}")
    can_zero_copy = device.type == "cpu" and store.in_host_memory
    if zero_copy and not can_zero_copy:
        raise ValueError(f"zero_copy=True needs a store in host memory and the CPU device (got a "
                         f"{type(store).__name__} and device={device})")
    if not 0 <= resident_layers <= len(store.layouts):
        raise PolicyError(f"resident_layers={resident_layers} is not allowed for a model with "
                          f"{len(store.layouts)} MoE layers; allowed: 0 to {len(store.layouts)}")
    return can_zero_copy if zero_copy is None else zero_copy


def _check_room(store: ExpertStore, expert_compute: str, resident_layers: int, num_slots: int, slot_bytes: int,
                budget_bytes: int) -> None:
    """Before allocating: the slots must hold the resident layers, plus one for the others' loads if they copy."""
    pinned_for_good = sum(store.num_experts[:resident_layers])
    others_copy = expert_compute != "cpu" and resident_layers < len(store.layouts)
    if resident_layers and num_slots < pinned_for_good + others_copy:
        raise PolicyError(f"an expert cache of {num_slots} slots ({budget_bytes} bytes) cannot hold "
                          f"resident_layers={resident_layers} ({pinned_for_good} experts)"
                          f"{' and still load the other layers' if others_copy else ''}; use at least "
                          f"{(pinned_for_good + others_copy) * slot_bytes} bytes, or fewer resident_layers")
