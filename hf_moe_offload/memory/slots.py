"""The expert cache's slot table: one `Slot` record per device slot, and the lookups the cache needs over them
(which key is where, which slots are free, recency, loads not yet waited for, prefetches not yet used).

`ExpertCache` owns one table and changes slots only through its methods, so the lookups never disagree with the
records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .eviction import Key, RecencyIndex


@dataclass(eq=False)
class Slot:
    """One device slot and what it holds."""

    index: int
    key: Key | None = None            # the (layer, expert) resident or loading here
    pins: int = 0                     # consumers that need it to stay
    load: Any = None                  # the in-flight load (a copy-engine handle), None once landed
    # {consumer stream: event after the compute that last read this slot from it} (CUDA); the next copy into the
    # slot waits for all of them, since consumers on different streams are not ordered against each other.
    release: Any = None
    ready: Any = None                 # the landed load's handle (CUDA): every reader's stream waits on it
    permanent: bool = False           # a resident layer's expert: pinned for good, never evicted


class SlotTable:
    """The slots of one cache: `resident` maps each resident or loading key to its slot, `free` is a stack of empty
    slots (slot 0 first), `recency` orders the resident keys (least recent first, overall and per layer).

    Example:
        >>> table = SlotTable(2)
        >>> slot = table.take_free()
        >>> table.occupy(slot, (0, 3)); table.start_load(slot, None); table.resident[(0, 3)].index
        0
    """

    def __init__(self, num_slots: int):
        self.slots = [Slot(i) for i in range(num_slots)]
        self.free = self.slots[::-1]
        self.resident: dict[Key, Slot] = {}
        self.recency = RecencyIndex()
        # Sets, so that no step scans every slot (thousands for a fine-grained MoE). `_unwaited` indexes the slots
        # whose `load` is set; `_prefetched` is the only record of a prefetch not used yet.
        self._unwaited: set[Slot] = set()
        self._prefetched: set[Slot] = set()

    def take_free(self) -> Slot | None:
        return self.free.pop() if self.free else None

    def occupy(self, slot: Slot, key: Key) -> None:
        """`slot` now holds `key` (its load starts next, `start_load`)."""
        slot.key = key
        self._prefetched.discard(slot)
        self.resident[key] = slot
        self.recency.touch(key)

    def start_load(self, slot: Slot, load: Any) -> None:
        slot.load, slot.ready = load, None
        self._unwaited.add(slot)

    def landed(self, slot: Slot) -> None:
        """Someone waited for the slot's load: it holds its expert's bytes."""
        slot.load = None
        self._unwaited.discard(slot)

    def forget(self, slot: Slot) -> None:
        """The slot no longer holds its key (its memory may still be read by queued compute: `release` stays)."""
        del self.resident[slot.key]
        self.recency.remove(slot.key)
        self._prefetched.discard(slot)
        self._unwaited.discard(slot)
        slot.key, slot.pins, slot.load, slot.permanent, slot.ready = None, 0, None, False, None

    def unwaited(self) -> list[Slot]:
        """Slots whose load nobody has waited for yet."""
        return list(self._unwaited)

    def is_prefetched(self, slot: Slot) -> bool:
        """Whether the slot was filled by a prefetch that no fetch has used yet."""
        return slot in self._prefetched

    def set_prefetched(self, slot: Slot, prefetched: bool) -> None:
        if prefetched:
            self._prefetched.add(slot)
        else:
            self._prefetched.discard(slot)

    def prefetched(self) -> list[Slot]:
        """The slots filled by a prefetch that no fetch has used yet."""
        return list(self._prefetched)

    @property
    def unused_prefetches(self) -> int:
        return len(self._prefetched)

    @staticmethod
    def has_landed(slot: Slot) -> bool:
        """Whether the slot's load has finished (a failed one too: waiting for it reports the error)."""
        try:
            return slot.load.done()
        except Exception:
            return True
