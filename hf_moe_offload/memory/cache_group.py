"""Several devices' expert caches behind one face: a `DevicePlan` (where a device map puts each MoE layer's
cache, and each device's budget) and the `CacheGroup` that sends each call to the cache of the layer it names."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Sequence

import torch

from .cache import ExpertCache
from .eviction import make_eviction
from ..policy.offload_policy import OffloadPolicy
from ..stats import DeviceStats, OffloadStats
from ..storage.store import ExpertStore


@dataclass(frozen=True)
class DevicePlan:
    """Where things go when a device map is given.

    Example:
        >>> plan = DevicePlan(module_map={"": "cpu"}, hook_map=None, layer_devices=("cpu",),
        ...                   physical={"cpu": torch.device("cpu")}, budgets={"cpu": 1024},
        ...                   primary=torch.device("cpu"))
        >>> plan.cache_devices
        ['cpu']
    """

    module_map: dict[str, str]               # what transformers loads with: physical devices, experts on "meta"
    hook_map: dict[str, str] | None          # block-level physical placement for accelerate's hooks (None: none)
    layer_devices: tuple[str, ...]           # each MoE layer's logical cache device, forward order
    physical: dict[str, torch.device]        # logical device -> torch device
    budgets: dict[str, int]                  # logical device -> expert-cache bytes
    primary: torch.device                    # the policy's device from now on (first GPU holding layers, else CPU)

    @property
    def cache_devices(self) -> list[str]:
        """Logical devices holding MoE layers, in the order of their first layer."""
        return list(dict.fromkeys(self.layer_devices))

    def layers_of(self, device: str) -> list[int]:
        return [i for i, d in enumerate(self.layer_devices) if d == device]



class _Resident(Mapping):
    """The union of the caches' resident maps ((layer, expert) -> slot), looked up in the layer's own cache."""

    def __init__(self, group: "CacheGroup"):
        self._group = group

    def __getitem__(self, key):
        return self._group.by_layer[key[0]].resident[key]

    def __contains__(self, key) -> bool:
        return key in self._group.by_layer[key[0]].resident

    def __iter__(self):
        for cache in self._group.caches.values():
            yield from cache.resident

    def __len__(self) -> int:
        return sum(len(c.resident) for c in self._group.caches.values())


class CacheGroup:
    """One `ExpertCache` (and copy engine) per device, looking like one cache to the engine: each call goes to the
    cache of the layer it names; every cache shares one lock (threads take turns per MoE layer, as with one
    cache; passed to each at construction) and one eviction policy (its per-key state never mixes: each layer is
    in one cache).

    Example:
        >>> group = build_cache_group(store, plan, policy, stats)           # doctest: +SKIP
        >>> for expert, slab in group.fetch(layer=1, experts=[0, 3]): ...    # doctest: +SKIP
    """

    def __init__(self, caches: Mapping[str, ExpertCache], layer_devices: Sequence[str], stats: OffloadStats):
        self.caches = dict(caches)
        self.layer_devices = tuple(layer_devices)
        self.by_layer = [self.caches[d] for d in layer_devices]
        self.stats = stats
        first = next(iter(self.caches.values()))
        if any(cache.lock is not first.lock for cache in self.caches.values()):
            raise ValueError("the caches of a CacheGroup must share one lock (ExpertCache(..., lock=...))")
        self.lock = first.lock
        self.store, self.eviction, self.expert_compute = first.store, first.eviction, first.expert_compute
        self.slot_bytes = first.slot_bytes
        self.zero_copy = all(c.zero_copy for c in self.caches.values())
        self.num_slots = sum(c.num_slots for c in self.caches.values())
        self.resident = _Resident(self)
        self._computing: ExpertCache | None = None      # the cache whose layer computes now

    @property
    def copy(self):
        """A copy engine (its meter: measured read bandwidth); the first device's that copies."""
        return next((c.copy for c in self.caches.values() if c.copy is not None), None)

    def fetch(self, layer: int, experts: Sequence[int], on_pinned=None, tokens: Sequence[int] | None = None,
              hold: bool = False):
        self._computing = self.by_layer[layer]
        return self.by_layer[layer].fetch(layer, experts, on_pinned, tokens, hold)

    def release_held(self) -> None:
        for cache in self.caches.values():
            cache.release_held()

    @property
    def held(self) -> int:
        return sum(cache.held for cache in self.caches.values())

    def begin_pass(self, window: int | None, ahead_room: int | None = None) -> None:
        with self.lock:
            for cache in self.caches.values():
                cache.begin_pass(window, ahead_room)

    def issue_read_ahead(self) -> None:
        """Start every cache's queued read-ahead now (no layer of theirs is loading: between passes)."""
        for cache in self.caches.values():
            cache.issue_read_ahead()

    def read_ahead(self, layer: int, experts: Sequence[int]) -> None:
        target = self.by_layer[layer]
        target.read_ahead(layer, experts)
        if target is not self._computing:
            # Another device: its own copy engine can read now, while this device computes (its queue is
            # otherwise drained only by its own next fetch, which is that layer's demand).
            target.issue_read_ahead()

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        return self.by_layer[layer].prefetch(layer, experts)

    def resident_bytes(self) -> int:
        return sum(c.resident_bytes() for c in self.caches.values())

    def settle_stalls(self, block: bool = True) -> None:
        for cache in self.caches.values():
            cache.settle_stalls(block)

    def close(self) -> None:
        with self.lock:
            for cache in self.caches.values():
                cache.close()


def build_cache_group(store: ExpertStore, plan: DevicePlan, policy: OffloadPolicy,
                      stats: OffloadStats) -> CacheGroup:
    """One cache per device of `plan`, each with its budget and its own copy engine; the stats show each device."""
    eviction = make_eviction(policy.eviction, num_layers=len(store.layouts))
    lock = threading.RLock()            # threads take turns per MoE layer, as with one cache
    caches: dict[str, ExpertCache] = {}
    try:
        for device in plan.cache_devices:
            caches[device] = ExpertCache(store, plan.physical[device], plan.budgets[device], eviction,
                                         DeviceStats(stats, device), policy.expert_compute, policy.resident_layers,
                                         lock=lock)
    except BaseException:
        for cache in caches.values():
            cache.close()
        raise
    stats.devices = {d: plan.layers_of(d) for d in plan.cache_devices}
    return CacheGroup(caches, plan.layer_devices, stats)
