"""What an `ExpertCache` knows about the forward pass running now: how many loads it may have outstanding (the
stream window), the next layer's experts queued to read ahead, the layer computing, and the experts loaded so far
(a second load of one is a repeat read). `begin_pass` resets it; each fetch moves it to its layer."""

from __future__ import annotations

from .eviction import Key


class PassState:
    """Per-pass state of one cache.

    Example:
        >>> state = PassState(num_layers=4)
        >>> state.begin(window=2, ahead_room=None); state.enter_layer(1); state.layers_until(0)
        2
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.window: int | None = None       # streaming: most loads in flight or landed-unused at once
        self.ahead_room = 0                  # most read-ahead loads in flight or landed-unused at once
        self.ahead: list[Key] = []           # streaming: the next layer's experts to load, in order
        self.current_layer = 0               # the layer being computed (victims are chosen as seen from it)
        self._loaded: set[Key] = set()

    def begin(self, window: int | None, ahead_room: int | None) -> None:
        """A pass starts: `window` None means no bound; `ahead_room` defaults to the window (none without one)."""
        self.window, self.ahead = window, []
        self.ahead_room = (window or 0) if ahead_room is None else ahead_room
        self._loaded.clear()

    def enter_layer(self, layer: int) -> None:
        """`layer` computes now; its own queued read-ahead is dropped (its demand covers it)."""
        self.current_layer = layer
        self.ahead = [key for key in self.ahead if key[0] != layer]

    def note_load(self, key: Key) -> bool:
        """Record a load of `key`; True when this pass loaded it before."""
        repeat = key in self._loaded
        self._loaded.add(key)
        return repeat

    def forget_loads(self) -> None:
        """Loads so far do not count toward repeat reads (the resident layers, loaded at construction)."""
        self._loaded.clear()

    def needed_after(self, layer: int, other: int) -> bool:
        """Whether `layer` runs again only after `other` does, seen from the layer computing now."""
        if layer == other == self.current_layer:     # both next needed a whole cycle from now
            return True
        return self.layers_until(layer) > self.layers_until(other)

    def layers_until(self, layer: int) -> int:
        """How many MoE layers from now until `layer` runs again, in the forward order (the current one last)."""
        return (layer - self.current_layer - 1) % self.num_layers
