"""Eviction policies: which resident, idle expert leaves when the cache needs a slot.

Each policy sees the candidates (unpinned, landed experts) in least-recently-used order and the layer that needs
the slot; it may also track uses. `make_eviction(name, num_layers)` builds one from the policy's `eviction` field.

The cache asks through `select(index, layer, evictable)`, where `index` (`RecencyIndex`) holds the resident keys in
LRU order overall and per layer. The built-in policies walk it and stop at the first evictable key in their order
(a fine-grained MoE's cache holds thousands of experts: building and scanning the full candidate list cost about
1 ms of host time per MoE layer at 1536 slots); a policy that only overrides `choose` gets the full scan and the
same answer.

`LookAhead` ("lookahead") also takes what is known of the future: `predict(layer, experts)` (the next routers
applied to the current hidden state: experts of a coming layer this very pass will use) and `observe(layer,
experts)` (what the router chose: likely again at the next step). `runtime.lookahead_gate.RouterLookahead` feeds both.

Example:
    >>> policy = make_eviction("layer", num_layers=4)
    >>> policy.choose([(0, 1), (2, 5), (3, 0)], layer=2)   # layer 2 comes up again last: evict from it
    (2, 5)
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Callable, Iterator, Sequence

Key = tuple[int, int]   # (layer, expert)


class RecencyIndex:
    """Resident keys, least recently used first, overall and per layer (so a policy that prefers some layers
    reaches their least recent key without scanning the others).

    Example:
        >>> index = RecencyIndex(); index.touch((0, 1)); index.touch((1, 2)); index.touch((0, 1))
        >>> list(index), list(index.of_layer(0))
        ([(1, 2), (0, 1)], [(0, 1)])
    """

    def __init__(self) -> None:
        self._all: OrderedDict[Key, None] = OrderedDict()
        self._by_layer: dict[int, OrderedDict[Key, None]] = {}

    def touch(self, key: Key) -> None:
        """`key` is resident and was just used: it becomes the most recent."""
        self._all[key] = None
        self._all.move_to_end(key)
        layer = self._by_layer.setdefault(key[0], OrderedDict())
        layer[key] = None
        layer.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._all.pop(key, None)
        layer = self._by_layer.get(key[0])
        if layer is not None:
            layer.pop(key, None)

    def clear(self) -> None:
        self._all.clear()
        self._by_layer.clear()

    def __iter__(self) -> Iterator[Key]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, key: object) -> bool:
        return key in self._all

    def of_layer(self, layer: int) -> Iterator[Key]:
        return iter(self._by_layer.get(layer, ()))


class EvictionPolicy:
    """Least recently used: the first candidate."""

    name = "lru"

    def on_use(self, key: Key) -> None:
        """`key` was pinned for compute or prefetch."""

    def add_slots(self, slots: int) -> None:
        """A cache this policy serves holds `slots` experts (each cache of a group adds its own)."""

    def on_route(self, layer: int, experts: Sequence[int]) -> None:
        """A call of `layer` routed tokens to `experts` (whether or not they were resident)."""

    def choose(self, candidates: Sequence[Key], layer: int) -> Key:
        """The victim among `candidates` (non-empty, least recently used first) to make room for `layer`."""
        return candidates[0]

    def select(self, index: RecencyIndex, layer: int, evictable: Callable[[Key], bool]) -> Key | None:
        """The victim among the keys of `index` that are `evictable`, or None: `choose` over all of them, or (LRU
        itself) the first evictable one in LRU order."""
        if type(self).choose is EvictionPolicy.choose:
            return next((key for key in index if evictable(key)), None)
        candidates = [key for key in index if evictable(key)]
        return self.choose(candidates, layer) if candidates else None


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
    then the one before it, and so on. LRU among equals.

    But consecutive tokens often route to the same experts, which the cycle alone does not see: a layer's least
    recently used expert that its router chose within the last few passes (counted in layer calls) is passed over
    while another layer's is idle longer. The layer order applies first among the layers whose least recently used
    expert is idle, then among all.

    How many passes count as recent follows the cache's size: `2P - 1` rounded up, at least 1, where P is how many
    passes of router choices the slots hold (slots / (layers x distinct experts per layer call, averaged over about
    two passes)). A cache that holds one pass spares only the last one; a larger one spares more. Replayed routing of
    random and trained models (`scripts/eviction_replay.py`) gave the fewest reads near that window at 15-70% of the
    experts. Before the caches report their slots (`add_slots`), two passes.

    Example:
        >>> policy = LayerAware(num_layers=2)
        >>> policy.choose([(0, 1), (1, 5)], layer=1)     # layer 1 comes up again last: evict from it
        (1, 5)
        >>> policy.on_route(1, [5])                      # its router just chose expert 5
        >>> policy.choose([(0, 1), (1, 5)], layer=1)     # likely chosen again next token: layer 0's leaves
        (0, 1)
    """

    name = "layer"
    RECENT_PASSES: int | None = None    # a fixed window, in passes, instead of the one from the cache's size
    DEFAULT_PASSES = 2                  # the window before any cache has reported its slots

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.layer_calls = 0                    # routed layer calls so far
        self.routed_at: dict[Key, int] = {}     # key -> the layer call that last routed to it
        self.slots = 0                          # of the caches served (add_slots)
        self.routed_per_call = 0.0              # distinct experts per layer call, a moving average
        self.recent_calls = self.recent_passes() * num_layers   # layer calls that count as recent

    def add_slots(self, slots: int) -> None:
        self.slots += slots
        self.recent_calls = self.recent_passes() * self.num_layers

    def on_route(self, layer: int, experts: Sequence[int]) -> None:
        self.layer_calls += 1
        chosen = {int(e) for e in experts}
        for e in chosen:
            self.routed_at[(layer, e)] = self.layer_calls
        weight = 1.0 if self.layer_calls == 1 else 1 / (2 * self.num_layers)
        self.routed_per_call += weight * (len(chosen) - self.routed_per_call)
        self.recent_calls = self.recent_passes() * self.num_layers

    def recent_passes(self) -> int:
        """How many passes of router choices count as recent now (the class docstring)."""
        if self.RECENT_PASSES is not None:
            return self.RECENT_PASSES
        if not self.slots or self.routed_per_call <= 0:
            return self.DEFAULT_PASSES
        passes_held = self.slots / (self.num_layers * self.routed_per_call)
        return max(1, math.ceil(2 * passes_held - 1))

    def recently_routed(self, key: Key) -> bool:
        """Whether `key`'s router chose it within the last `recent_passes()` passes."""
        then = self.routed_at.get(key)
        return then is not None and self.layer_calls - then < self.recent_calls

    def choose(self, candidates: Sequence[Key], layer: int) -> Key:
        oldest: dict[int, Key] = {}                       # layer -> its least recently used candidate
        for key in candidates:
            oldest.setdefault(key[0], key)
        idle = [k for k in oldest.values() if not self.recently_routed(k)]
        return max(idle or candidates, key=lambda k: (k[0] - layer - 1) % self.num_layers)

    def layers_furthest_first(self, layer: int) -> Iterator[int]:
        """The layers in decreasing `(j - layer - 1) % L`: `layer` itself, the one before it, ... the next one."""
        return ((layer - i) % self.num_layers for i in range(self.num_layers))

    def select(self, index: RecencyIndex, layer: int, evictable: Callable[[Key], bool]) -> Key | None:
        if type(self).choose is not LayerAware.choose:
            return super().select(index, layer, evictable)
        fallback = None                                   # same answer as `choose`: idle layers first, then all
        for j in self.layers_furthest_first(layer):
            key = next((k for k in index.of_layer(j) if evictable(k)), None)
            if key is None:
                continue
            if not self.recently_routed(key):
                return key
            fallback = fallback or key
        return fallback


class HotFirst(LayerAware):
    """The streamed passes' order (Klotski's hot experts): the layer whose next use is furthest, as `LayerAware`,
    and within it the coldest expert, so that the hottest experts stay resident across passes and the others stream
    through the window. Heat: how often the layer's recent calls routed to the expert, each call weighing
    `HEAT_DECAY` times the one after it (a routing drift moves the resident set within tens of passes).

    Only a layer's `HEAT_CANDIDATES` least recently used evictable experts are weighed, so that a layer of hundreds
    of experts costs no more per eviction than one of eight. LRU among equals (untouched experts lose heat and come
    first in LRU order).

    Example:
        >>> policy = HotFirst(num_layers=2)
        >>> for _ in range(3): policy.on_route(0, [0, 1])
        >>> policy.on_route(0, [1, 2])
        >>> policy.choose([(0, 0), (0, 1), (0, 2)], layer=0)   # expert 2 was routed to once: coldest
        (0, 2)
    """

    name = "hot"
    HEAT_DECAY = 0.9
    HEAT_CANDIDATES = 16

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.calls = [0] * num_layers                   # calls of each layer so far
        self.heat: dict[Key, tuple[float, int]] = {}    # key -> (heat at its last routing, the layer's call then)

    def on_route(self, layer: int, experts: Sequence[int]) -> None:
        self.calls[layer] += 1
        now = self.calls[layer]
        for e in experts:
            key = (layer, int(e))
            heat, then = self.heat.get(key, (0.0, now))
            self.heat[key] = (heat * self.HEAT_DECAY ** (now - then) + 1.0, now)

    def hotness(self, key: Key) -> float:
        heat, then = self.heat.get(key, (0.0, 0))
        return heat * self.HEAT_DECAY ** (self.calls[key[0]] - then)

    def choose(self, candidates: Sequence[Key], layer: int) -> Key:
        furthest = max((k[0] - layer - 1) % self.num_layers for k in candidates)
        same = [k for k in candidates if (k[0] - layer - 1) % self.num_layers == furthest]
        return min(same[:self.HEAT_CANDIDATES], key=self.hotness)   # min keeps the least recent of equals

    def select(self, index: RecencyIndex, layer: int, evictable: Callable[[Key], bool]) -> Key | None:
        for j in self.layers_furthest_first(layer):
            candidates = []
            for key in index.of_layer(j):
                if evictable(key):
                    candidates.append(key)
                    if len(candidates) == self.HEAT_CANDIDATES:
                        break
            if candidates:
                return min(candidates, key=self.hotness)
        return None


class LookAhead(LayerAware):
    """Evict the expert whose next use is predicted furthest away, in layer-steps from the layer computing now.

    The first chance expert (j, e) has to be used is j's next turn, `d0 = (j - layer - 1) % L` layers away (this
    pass for a later layer, the next step for this or an earlier one: the layer-aware distance). It is predicted to
    be used then if the next routers applied to the current hidden state named it (a later layer of this pass,
    `predict`), or, where no such guess exists, if the router chose it at layer j's last turn (`observe`): routing
    at one step is the best guess for the next. Otherwise its next use is at least a whole step later:
    `d0 + L`. The largest distance leaves; among equals the least recently used (candidates come LRU first).

    Example:
        >>> policy = LookAhead(num_layers=4)
        >>> policy.observe(2, [5]); policy.observe(3, [0])     # last step: layer 2 used 5, layer 3 used 0
        >>> policy.predict(3, [1])                             # this pass's layer 3 router guess (from layer 1)
        >>> policy.choose([(2, 5), (3, 0)], layer=1)           # (3, 0): not guessed, next use a step later
        (3, 0)
    """

    name = "lookahead"

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.guessed: dict[int, frozenset[int]] = {}   # layer -> experts the look-ahead guessed for its next turn
        self.recent: dict[int, frozenset[int]] = {}    # layer -> experts its router chose at its last turn

    def predict(self, layer: int, experts) -> None:
        """The look-ahead guesses `experts` for `layer`'s next turn (a later layer of the current pass)."""
        self.guessed[layer] = frozenset(int(e) for e in experts)

    def observe(self, layer: int, experts) -> None:
        """`layer`'s router chose `experts`: its guess is spent, and they are the guess for its next turn."""
        self.guessed.pop(layer, None)
        self.recent[layer] = frozenset(int(e) for e in experts)

    def distance(self, key: Key, layer: int) -> int:
        """Predicted layer-steps until `key` is next used, as seen while `layer` computes."""
        j, e = key
        first = (j - layer - 1) % self.num_layers
        guess = self.guessed.get(j)
        if guess is None:
            guess = self.recent.get(j, frozenset())
        return first if e in guess else first + self.num_layers

    def choose(self, candidates: Sequence[Key], layer: int) -> Key:
        return max(candidates, key=lambda k: self.distance(k, layer))   # max keeps the first (least recent) of ties

    def select(self, index: RecencyIndex, layer: int, evictable: Callable[[Key], bool]) -> Key | None:
        # Distances: unpredicted keys a whole step beyond every predicted one, then by layer, LRU within a layer.
        for predicted in (False, True):
            for j in self.layers_furthest_first(layer):
                guess = self.guessed.get(j)
                if guess is None:
                    guess = self.recent.get(j, frozenset())
                key = next((k for k in index.of_layer(j) if (k[1] in guess) == predicted and evictable(k)), None)
                if key is not None:
                    return key
        return None


def make_eviction(name: str, num_layers: int) -> EvictionPolicy:
    """The policy called `name` ("lru", "lfu", "layer" or "lookahead")."""
    if name == "lru":
        return EvictionPolicy()
    if name == "lfu":
        return LeastFrequentlyUsed()
    if name == "layer":
        return LayerAware(num_layers)
    if name == "lookahead":
        return LookAhead(num_layers)
    raise ValueError(f"eviction={name!r} is not allowed; allowed: ['lru', 'lfu', 'layer', 'lookahead']")
