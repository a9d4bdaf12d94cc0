"""The staging room: the cache slots kept for read-ahead guesses while an on-demand pass reads ahead.

Demand loads leave the room to the guesses (`regular_full`), and a guess lands only there (`take`), so a guess never
evicts a resident expert: a wrong one costs its read, on disk time that was idle, and nothing else. A guess that is
used becomes an ordinary resident; the next load then evicts by the cache's policy, which gives the room back.
Streamed passes bound their loads with a window instead, and have no room.
"""

from __future__ import annotations

from .pass_state import PassState
from .slots import Slot, SlotTable

MAX_SHARE = 4       # the room is at most 1 / MAX_SHARE of the cache's slots


class StagingRoom:
    """How many slots the guesses of the running pass may hold, and which one the next guess takes.

    Example:
        >>> table, state = SlotTable(8), PassState(num_layers=4)
        >>> state.begin(window=None, ahead_room=2); room = StagingRoom(table, state, num_slots=8)
        >>> room.room(), room.regular_full()
        (2, False)
    """

    def __init__(self, table: SlotTable, pass_state: PassState, num_slots: int, permanent: int = 0):
        """`permanent`: slots pinned for good (`resident_layers`), of `num_slots`; the room is a share of the rest."""
        self.table, self.pass_state, self.num_slots = table, pass_state, num_slots
        self.evictable = num_slots - permanent

    def room(self) -> int:
        """Slots kept for guesses now: the pass's read-ahead room, for an on-demand pass (no window)."""
        state = self.pass_state
        return min(state.ahead_room, self.evictable // MAX_SHARE) if state.window is None else 0

    def regular_full(self) -> bool:
        """Whether the experts loaded on demand (or used guesses) fill the cache but for the room."""
        return self.room() > 0 and self._regular() >= self.num_slots - self.room()

    def overdrawn(self) -> bool:
        """Whether they hold part of the room (reading ahead has just started, or a guess was used): the next guess
        may then evict one of them, as the next demand load would."""
        return self.room() > 0 and self._regular() > self.num_slots - self.room()

    def guesses_of(self, layer: int) -> int:
        """Unused guesses of `layer` held now (those of other layers are wrong, and leave as guesses come)."""
        return sum(1 for slot in self.table.prefetched() if slot.key[0] == layer)

    def _regular(self) -> int:
        return len(self.table.resident) - self.table.unused_prefetches

    def take(self, layer: int) -> Slot | None:
        """A slot for a guess of `layer`: a free one (taken off the free list), else one that still holds an unused,
        landed guess of another layer, which was wrong (its layer ran without it); the caller evicts that guess.
        None: every slot of the room holds a guess still to be judged (or still being read)."""
        table = self.table
        if table.free:
            return table.free.pop()
        return next((s for s in table.prefetched() if s.key[0] != layer and s.pins == 0 and s.load is None), None)
