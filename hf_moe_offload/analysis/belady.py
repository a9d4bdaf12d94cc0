"""Offline eviction study: record a model's routing, then replay it through a simulated expert cache of N slots
under Belady's optimum (evict the expert whose next use is furthest in the future: the fewest misses any
demand-only cache can have) and under the library's own policies (`eviction.make_eviction`), on the same trace.

A trace is a list of events in forward order, as the engine sees them at each MoE layer:
`("predict", layer, experts)` — the look-ahead guessed `experts` for a later `layer` of this pass (recorded only when
asked; `eviction="lookahead"` uses them) — and `("route", layer, experts)` — the router chose `experts`, which
the layer then fetches. The simulation follows the cache's rules: a layer's experts are all pinned while it fetches
(none of them is a victim), missing ones load in order, candidates are offered least recently used first.

Example:
    >>> trace = [("route", 0, (e,)) for e in (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)]
    >>> simulate(trace, slots=3, policy="belady").misses, simulate(trace, slots=3, policy="lru").misses
    (7, 10)

Recording (a `LayerHook`):
    >>> engine = hf_moe_offload.get_engine(model)                          # doctest: +SKIP
    >>> recorder = RoutingRecorder(predictions=True).bind(engine)           # doctest: +SKIP
    >>> engine.add_hook(recorder)                                           # doctest: +SKIP
    >>> model.generate(**inputs, max_new_tokens=32)                         # doctest: +SKIP
    >>> simulate(recorder.trace, slots=8, policy="belady").hit_rate         # doctest: +SKIP
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..hooks import LayerHook
from ..memory.eviction import Key, LookAhead, make_eviction
from ..runtime.pass_scheduler import PassScheduler

Event = tuple[str, int, tuple[int, ...]]
POLICIES = ("belady", "lru", "lfu", "layer", "lookahead")


@dataclass
class SimResult:
    """Counts of one simulated run: `hits + misses` = experts routed; bytes = `misses` x expert bytes."""

    policy: str
    slots: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class RoutingRecorder(LayerHook):
    """Records every routing decision of an offloaded model as a trace for `simulate`; with `predictions`, also
    the engine's look-ahead guesses for the next layers (taken from its schedule planner, the same ones
    `eviction="lookahead"` is fed), so the simulated look-ahead policy sees what the real one would.

    Attach it after the engine exists: `engine.add_hook(RoutingRecorder(...).bind(engine))`, with `engine =
    hf_moe_offload.get_engine(model)`; `predictions` need the `bind`.
    """

    def __init__(self, predictions: bool = False, depth: int = 2):
        self.trace: list[Event] = []
        self.predictions, self.depth = predictions, depth
        self._planner = None

    def bind(self, engine) -> "RoutingRecorder":
        """Find the engine's schedule planner (for `predictions`); returns self."""
        self._planner = next((h for h in engine.hooks if isinstance(h, PassScheduler)), None)
        if self.predictions and self._planner is None:
            raise ValueError("RoutingRecorder(predictions=True) needs an engine with a schedule planner (an engine "
                             "whose cache is not zero-copy: store='disk', or a CUDA device)")
        return self

    def before_experts(self, layer: int, hidden_states: torch.Tensor) -> None:
        if not self.predictions:
            return
        if self._planner is None:
            raise RuntimeError("RoutingRecorder(predictions=True) records the engine's guesses: bind it to the "
                               "engine first, engine.add_hook(RoutingRecorder(predictions=True).bind(engine))")
        nxt = layer
        for _ in range(self.depth):
            nxt = self._planner.layers[nxt].next
            if nxt is None:
                return
            self.trace.append(("predict", nxt, tuple(self._planner.lookahead.likely_experts(nxt, hidden_states))))

    def on_route(self, layer: int, experts: Sequence[int]) -> None:
        self.trace.append(("route", layer, tuple(int(e) for e in experts)))

    def routes(self) -> list[tuple[int, tuple[int, ...]]]:
        """The (layer, experts) accesses alone, in order."""
        return [(layer, experts) for kind, layer, experts in self.trace if kind == "route"]


def _next_uses(trace: Sequence[Event]) -> dict[Key, list[int]]:
    """Per key, the ascending positions (indices into `trace`) of the route events that use it."""
    uses: dict[Key, list[int]] = defaultdict(list)
    for i, (kind, layer, experts) in enumerate(trace):
        if kind == "route":
            for e in experts:
                uses[(layer, e)].append(i)
    return uses


def simulate(trace: Iterable[Event | tuple[int, Sequence[int]]], slots: int, policy: str = "belady",
             num_layers: int | None = None) -> SimResult:
    """Replay `trace` through a cache of `slots` experts under `policy` ("belady", "lru", "lfu", "layer",
    "lookahead"); `(layer, experts)` pairs are read as route events. `num_layers` defaults to the largest layer
    seen + 1 (the layer-aware policies count distances in it)."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not allowed; allowed: {list(POLICIES)}")
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots={slots!r} is not allowed; allowed: a whole number >= 1")
    events: list[Event] = [e if isinstance(e[0], str) else ("route", e[0], tuple(e[1])) for e in trace]
    if num_layers is None:
        num_layers = 1 + max((layer for _, layer, _ in events), default=0)
    widest = max((len(set(x)) for kind, _, x in events if kind == "route"), default=0)
    if widest > slots:
        raise ValueError(f"a layer routes to {widest} experts but the cache has {slots} slots; allowed: slots >= "
                         f"the most experts one layer uses at once")
    uses = _next_uses(events) if policy == "belady" else {}
    evictor = None if policy == "belady" else make_eviction(policy, num_layers)
    if evictor is not None:
        evictor.add_slots(slots)
    resident: OrderedDict[Key, None] = OrderedDict()    # least recently used first
    result = SimResult(policy, slots)
    for i, (kind, layer, experts) in enumerate(events):
        if kind == "predict":
            if isinstance(evictor, LookAhead):
                evictor.predict(layer, experts)
            continue
        if isinstance(evictor, LookAhead):
            evictor.observe(layer, experts)
        if evictor is not None:
            evictor.on_route(layer, experts)
        keys = [(layer, e) for e in dict.fromkeys(experts)]
        hits = [k for k in keys if k in resident]
        result.hits += len(hits)
        result.misses += len(keys) - len(hits)
        for key in hits + [k for k in keys if k not in resident]:   # the cache pins residents first, then loads
            if evictor is not None:
                evictor.on_use(key)
            resident[key] = None
            resident.move_to_end(key)
            if len(resident) > slots:
                candidates = [k for k in resident if k not in keys]   # this layer's experts are pinned
                victim = (_belady_victim(candidates, uses, i) if evictor is None
                          else evictor.choose(candidates, layer))
                del resident[victim]
                result.evictions += 1
    return result


def _belady_victim(candidates: list[Key], uses: dict[Key, list[int]], now: int) -> Key:
    """The candidate used again furthest in the future (never again: infinitely far); the least recent of ties."""
    def next_use(key: Key) -> float:
        positions = uses.get(key, [])
        j = bisect.bisect_right(positions, now)
        return positions[j] if j < len(positions) else float("inf")

    return max(candidates, key=next_use)


def compare(trace: Sequence[Event], slots: int, policies: Sequence[str] = ("lru", "layer", "lookahead", "belady"),
            num_layers: int | None = None) -> dict[str, SimResult]:
    """`simulate` under each policy on the same trace."""
    return {p: simulate(trace, slots, p, num_layers) for p in policies}
