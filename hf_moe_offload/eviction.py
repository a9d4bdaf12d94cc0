"""Eviction policies: which resident, idle expert leaves when the cache needs a slot.

Each policy sees the candidates (unpinned, landed experts) in least-recently-used order and the layer that needs
the slot; it may also track uses. `make_eviction(name, num_layers)` builds one from the policy's `eviction` field.

Example:
    >>> policy = make_eviction("layer", num_layers=4)
    >>> policy.choose([(0, 1), (2, 5), (3, 0)], layer=2)   # layer 2 comes up again last: evict from it
    (2, 5)
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

Key = tuple[int, int]   # (layer, expert)


class EvictionPolicy:
    """Least recently used: the first candidate."""

    name = "lru"

    def on_use(self, key: Key) -> None:
        """`key` was pinned for compute or prefetch."""

    def choose(self, candidates: Sequence[Key], layer: int) -> Key:
        """The victim among `candidates` (non-empty, least recently used first) to make room for `layer`."""
        return candidates[0]


class LeastFrequentlyUsed(EvictionPolicy):
    """The expert used least often so far; the least recent among equals."""

    name = "lfu"

    def __init__(self) -> None:
        self.uses: Counter[Key] = Counter()

    def on_use(self, key: Key) -> None:
        self.uses[key] += 1

    def choose(self, candidates: Sequence[Key], layer: int) -> Key:
        return min(candidates, key=lambda k: self.uses[k])


class LayerAware(EvictionPolicy):
    """Decode visits the layers in a cycle, which defeats a global LRU: the expert needed furthest in the future
    belongs to the layer that comes up last, which is the layer being served (its next use is the next token),
    then the one before it, and so on. LRU among equals."""

    name = "layer"

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    def choose(self, candidates: Sequence[Key], layer: int) -> Key:
        return max(candidates, key=lambda k: (k[0] - layer - 1) % self.num_layers)


def make_eviction(name: str, num_layers: int) -> EvictionPolicy:
    """The policy called `name` ("lru", "lfu" or "layer")."""
    if name == "lru":
        return EvictionPolicy()
    if name == "lfu":
        return LeastFrequentlyUsed()
    if name == "layer":
        return LayerAware(num_layers)
    raise ValueError(f"eviction={name!r} is not allowed; allowed: ['lru', 'lfu', 'layer']")
