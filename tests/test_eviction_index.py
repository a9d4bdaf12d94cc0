"""The indexed victim choice (`EvictionPolicy.select` over a `RecencyIndex`) picks exactly what the full scan with
`choose` picks, for every built-in policy, on random cache states; and the cache makes the same decisions with it.
The layer order spares its router's recent choices over a window that follows the cache's size."""

from __future__ import annotations

import random

import pytest
from conftest import offloaded

import hf_moe_offload
from hf_moe_offload.analysis import simulate
from hf_moe_offload.memory.eviction import EvictionPolicy, LayerAware, RecencyIndex, make_eviction


def _full_scan(policy, index, layer, evictable):
    candidates = [k for k in index if evictable(k)]
    return policy.choose(candidates, layer) if candidates else None


@pytest.mark.parametrize("name", ["lru", "lfu", "layer", "lookahead"])
def test_select_equals_the_full_scan(name):
    rng = random.Random(0)
    layers, experts = 6, 10
    for trial in range(200):
        policy = make_eviction(name, num_layers=layers)
        index = RecencyIndex()
        keys = [(rng.randrange(layers), rng.randrange(experts)) for _ in range(rng.randrange(1, 40))]
        for key in keys:
            index.touch(key)
            policy.on_use(key)
            if rng.random() < 0.5:          # the layer's router chose it (the layer order spares recent choices)
                policy.on_route(key[0], [key[1]])
        if name == "lookahead":
            for j in range(layers):
                if rng.random() < 0.5:
                    policy.observe(j, rng.sample(range(experts), 3))
                if rng.random() < 0.5:
                    policy.predict(j, rng.sample(range(experts), 2))
        pinned = {k for k in index if rng.random() < 0.3}
        evictable = lambda k: k not in pinned  # noqa: E731
        layer = rng.randrange(layers)
        assert policy.select(index, layer, evictable) == _full_scan(policy, index, layer, evictable), trial


def test_a_custom_policy_that_overrides_choose_gets_the_full_scan():
    class MostRecent(EvictionPolicy):
        def choose(self, candidates, layer):
            return candidates[-1]

    index = RecencyIndex()
    for key in [(0, 1), (1, 2), (0, 3)]:
        index.touch(key)
    assert MostRecent().select(index, 0, lambda k: k != (0, 3)) == (1, 2)


def test_recency_index_keeps_per_layer_order():
    index = RecencyIndex()
    for key in [(0, 1), (1, 1), (0, 2), (0, 1)]:
        index.touch(key)
    assert list(index) == [(1, 1), (0, 2), (0, 1)]
    assert list(index.of_layer(0)) == [(0, 2), (0, 1)]
    index.remove((0, 2))
    assert list(index.of_layer(0)) == [(0, 1)] and (0, 2) not in index and len(index) == 2


def test_layer_order_passes_over_an_expert_routed_to_in_the_last_two_passes():
    policy = LayerAware(num_layers=3)           # no cache has reported its slots: two passes count as recent
    for layer, experts in [(0, [1, 2]), (1, [3, 4]), (2, [5, 6])]:
        policy.on_route(layer, experts)
    candidates = [(1, 3), (2, 5), (0, 7)]         # (0, 7): resident, but no router chose it lately
    assert policy.choose(candidates, layer=1) == (0, 7)
    for layer, experts in [(0, [1, 2]), (1, [3, 4]), (2, [0, 1])] * 2:     # two more passes without expert 5
        policy.on_route(layer, experts)
    assert policy.choose([(1, 3), (2, 5)], layer=1) == (2, 5)       # idle for two passes: the layer order again
    assert policy.choose([(1, 3), (2, 0)], layer=1) == (1, 3)       # every candidate recent: plain layer order


def test_layer_order_with_recent_choices_spared_misses_no_more_on_prompt_then_decode_routing(monkeypatch):
    """A prompt's pass routes to every expert, then decode tokens mostly repeat their layer's last choice; replayed
    through the cache's rules at 25-50% of the experts, sparing recent choices never misses more here than the
    plain layer order, and misses fewer somewhere."""
    rng = random.Random(0)
    layers, experts = 8, 8
    hot = {j: rng.sample(range(experts), 4) for j in range(layers)}    # a few experts each layer keeps choosing
    trace = []
    for _ in range(4):
        trace += [(j, tuple(range(experts))) for j in range(layers)]
        for _ in range(32):
            trace += [(j, tuple(rng.sample(hot[j], 2))) for j in range(layers)]
    spared = [simulate(trace, slots, "layer").misses for slots in (16, 24, 32)]
    monkeypatch.setattr(LayerAware, "RECENT_PASSES", 0)
    plain = [simulate(trace, slots, "layer").misses for slots in (16, 24, 32)]
    assert all(s <= p for s, p in zip(spared, plain)) and spared != plain, (spared, plain)


def test_recent_window_follows_the_cache_size():
    """A cache holding one pass of router choices spares only the last pass; a larger one spares more; until the
    caches report their slots, two passes."""
    def routed(slots: int | None) -> LayerAware:
        policy = LayerAware(num_layers=4)
        if slots is not None:
            policy.add_slots(slots)
        policy.on_route(3, [5, 6])                          # layer 3 chose 5, then a whole pass without it
        for layer in range(4):
            policy.on_route(layer, [0, 1])
        return policy

    one_pass, two_passes, unknown = routed(8), routed(16), routed(None)   # 4 layers x 2 experts per call
    assert (one_pass.recent_passes(), two_passes.recent_passes(), unknown.recent_passes()) == (1, 3, 2)
    # (2, 0): chosen this pass. (3, 5): chosen a pass ago, recent only where the window spans more than one pass.
    assert one_pass.choose([(2, 0), (3, 5)], layer=2) == (3, 5)
    assert two_passes.choose([(2, 0), (3, 5)], layer=2) == (2, 0)     # both recent: the plain layer order
    tiny = LayerAware(num_layers=4)
    tiny.add_slots(2)
    tiny.on_route(0, [0, 1])
    assert tiny.recent_passes() == 1                                   # at least one pass, however small the cache


def test_the_cache_reports_its_turn_taking_slots_to_its_eviction_order(tiny_models):
    """The engine's cache tells its policy how many slots take turns (the resident layers' stay), which sets the
    window of router choices the layer order spares."""
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%")
    cache = hf_moe_offload.get_engine(model).cache
    assert cache.eviction.slots == cache.num_slots > 0
    pinned = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", resident_layers=1,
                       expert_cache="100%")
    cache = hf_moe_offload.get_engine(pinned).cache
    first_layer = cache.store.num_experts[0]
    assert cache.eviction.slots == cache.num_slots - first_layer > 0
