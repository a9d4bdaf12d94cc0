"""The indexed victim choice (`EvictionPolicy.select` over a `RecencyIndex`) picks exactly what the full scan with
`choose` picks, for every built-in policy, on random cache states; and the cache makes the same decisions with it."""

from __future__ import annotations

import random

import pytest

from hf_moe_offload.memory.eviction import EvictionPolicy, RecencyIndex, make_eviction


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
