"""Pins that `ExpertCache.fetch(hold=True)` keeps for a layer's later micro-batches (`runtime/microbatch.py`), one
record per generating thread, until that thread's `release_held`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .eviction import Key


@dataclass
class _Hold:
    layer: int | None                                 # no expert of this layer leaves until the release
    keys: list[Key] = field(default_factory=list)     # the pins kept


class HeldPins:
    """Held pins of one cache, per thread; used under the cache's lock.

    `active` says whether the fetch running now (under the lock) keeps its pins; `hold_layer` starts a hold,
    `keep` moves a pin into it, `release` hands the thread's pins back for unpinning, `protects` guards eviction.

    Example:
        >>> pins = HeldPins(); pins.hold_layer(2); pins.keep((2, 5)); pins.protects(2), pins.count
        (True, 1)
    """

    def __init__(self) -> None:
        self._by_thread: dict[int, _Hold] = {}
        self.active = False

    def hold_layer(self, layer: int) -> None:
        hold = self._by_thread.get(threading.get_ident())
        if hold is None:
            self._by_thread[threading.get_ident()] = _Hold(layer)
        else:
            hold.layer = layer

    def keep(self, key: Key) -> None:
        self._by_thread.setdefault(threading.get_ident(), _Hold(None)).keys.append(key)

    def release(self) -> list[Key]:
        """End this thread's hold; returns its kept pins, for the caller to unpin."""
        hold = self._by_thread.pop(threading.get_ident(), None)
        return [] if hold is None else hold.keys

    def protects(self, layer: int) -> bool:
        """Whether a thread holds `layer` (a later micro-batch of it may route to any of its experts)."""
        return any(hold.layer == layer for hold in self._by_thread.values())

    @property
    def count(self) -> int:
        """Pins kept now, over all threads."""
        return sum(len(hold.keys) for hold in self._by_thread.values())
