"""The expert cache keeps its byte budget, evicts by LRU/LFU, never evicts an expert in use, and its stats add up."""

from __future__ import annotations

import pytest
import torch

import hf_moe_offload
from hf_moe_offload.arch import SlabLayout
from hf_moe_offload.memory.cache import ExpertCache
from hf_moe_offload.stats import OffloadStats
from hf_moe_offload.storage.store import CpuStore, ExpertStore
from conftest import VOCAB, offloaded, reference


class CountingStore(ExpertStore):
    """A host store whose slab e is filled with the value e, that records every read (the copy source)."""

    def __init__(self, num_experts=6, numel=16, num_layers=1):
        super().__init__([SlabLayout((("w", (numel,)),))] * num_layers, [num_experts] * num_layers, torch.float32)
        self.reads: list[int] = []

    def read_into(self, layer, expert, dst):
        self.reads.append(expert)
        dst[:16].fill_(float(expert))


def _cache(slots: int, eviction: str = "lru", num_layers: int = 1) -> tuple[ExpertCache, CountingStore]:
    store = CountingStore(num_layers=num_layers)
    stats = OffloadStats(num_layers, slots * 64)
    return ExpertCache(store, torch.device("cpu"), slots * 64, eviction, stats), store


def _run(cache: ExpertCache, experts: list[int]) -> list[int]:
    seen = []
    for e, slab in cache.fetch(0, experts):
        assert torch.all(slab == e)          # the right bytes arrived before they are used
        seen.append(e)
    return seen


def test_resident_experts_come_first_and_hits_are_counted():
    cache, store = _cache(slots=3)
    assert sorted(_run(cache, [0, 1])) == [0, 1]  # both missing: served as their loads land
    assert _run(cache, [4, 1]) == [1, 4]     # 1 is resident: computed while 4 loads
    snap = cache.stats.snapshot()
    assert (snap["hits"], snap["misses"]) == (1, 3)
    assert snap["bytes_to_device"] == 3 * 64 == len(store.reads) * 64


def test_lru_evicts_least_recently_used():
    cache, store = _cache(slots=2)
    for experts in ([0], [1], [0], [2]):     # 1 is the least recently used when 2 arrives
        _run(cache, experts)
    assert set(k[1] for k in cache.resident) == {0, 2}


def test_lfu_evicts_least_frequently_used():
    cache, store = _cache(slots=2, eviction="lfu")
    for experts in ([0], [0], [1], [2]):     # 1 was used once, 0 twice
        _run(cache, experts)
    assert set(k[1] for k in cache.resident) == {0, 2}


def test_layer_eviction_keeps_what_the_next_layers_need():
    """Decode cycles 0,1,2,0,1,2,...: evict from the layer that comes up last, not the least recent expert."""
    results = {}
    for policy in ("layer", "lru"):
        cache, _ = _cache(slots=3, eviction=policy, num_layers=3)
        for layer in (0, 1, 2):
            list(cache.fetch(layer, [0]))
        list(cache.fetch(0, [0, 1]))           # (0, 0) is in use; one of layer 1's or layer 2's must go
        results[policy] = set(cache.resident)
    assert results["layer"] == {(0, 0), (0, 1), (1, 0)}   # layer 2 comes up last: its expert leaves
    assert results["lru"] == {(0, 0), (0, 1), (2, 0)}     # LRU evicts layer 1's, needed right next


def test_more_experts_than_slots_runs_in_waves_without_evicting_pinned():
    cache, store = _cache(slots=2)
    assert sorted(_run(cache, [0, 1, 2, 3, 4, 5])) == [0, 1, 2, 3, 4, 5]
    assert cache.resident_bytes() <= 2 * 64
    assert cache.stats.snapshot()["peak_cache_bytes"] <= 2 * 64


def test_an_expert_in_use_is_never_evicted():
    cache, store = _cache(slots=2)
    gen = cache.fetch(0, [0, 1, 2])
    first, slab = next(gen)                    # expert 0 or 1, whichever landed first, is being computed now
    assert (0, first) in cache.resident and cache.resident[(0, first)].pins == 1
    assert torch.all(slab == first)
    rest = [e for e, _ in gen]
    assert sorted([first, *rest]) == [0, 1, 2]


def test_stats_reset():
    cache, _ = _cache(slots=2)
    _run(cache, [0, 1])
    snap = cache.stats.snapshot()
    snap.reset()
    after = cache.stats.snapshot()
    assert after["misses"] == 0 and after["bytes_to_device"] == 0


def test_budget_held_at_every_forward_and_bytes_add_up(tiny_models):
    path = tiny_models["mixtral"]
    model = offloaded("mixtral", path, device="cpu", store="disk", expert_cache="34%", eviction="lru")
    engine = hf_moe_offload.get_engine(model)
    budget = engine.policy.expert_cache
    observed = []
    for layer in engine.layers:
        layer.module.register_forward_hook(lambda *_: observed.append(engine.cache.resident_bytes()))
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert observed and max(observed) <= budget
    snap = hf_moe_offload.stats(model)
    assert snap["peak_cache_bytes"] <= budget
    slab_bytes = engine.store.slab_bytes(0)
    assert snap["bytes_to_device"] == (snap["misses"] + snap["prefetch_issued"]) * slab_bytes
    assert snap["prefetch_issued"] == snap["readahead_issued"]          # no prefetcher: only the stream's read-ahead
    assert snap["hits"] + snap["misses"] == snap["experts_used"]
    assert sum(layer["misses"] for layer in snap["per_layer"]) == snap["misses"]
    assert snap["evictions"] >= snap["misses"] + snap["prefetch_issued"] - engine.cache.num_slots


def test_cpu_store_on_cpu_device_moves_nothing(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="cpu")
    model(torch.randint(3, VOCAB, (1, 6)))
    snap = hf_moe_offload.stats(model)
    assert snap["misses"] == 0 and snap["bytes_to_device"] == 0 and snap["hits"] > 0


def test_cpu_store_holds_each_expert_in_one_contiguous_slab(tiny_models):
    model = offloaded("olmoe", tiny_models["olmoe"], device="cpu", store="cpu")
    store = hf_moe_offload.get_engine(model).store
    assert isinstance(store, CpuStore)
    for slabs in store.slabs:
        assert slabs.is_contiguous() and slabs.dim() == 2
    ref = reference("olmoe", tiny_models["olmoe"])
    expected = torch.cat([ref.model.layers[1].mlp.experts.gate_up_proj[3].reshape(-1),
                          ref.model.layers[1].mlp.experts.down_proj[3].reshape(-1)])
    assert torch.equal(store.host_slab(1, 3), expected)


def test_prefetch_fills_free_slots_and_turns_misses_into_hits():
    cache, store = _cache(slots=3)
    assert cache.prefetch(0, [2, 4]) == 2
    assert sorted(_run(cache, [4, 1])) == [1, 4]   # 4 arrived by prefetch, 1 on demand
    snap = cache.stats.snapshot()
    assert (snap["hits"], snap["misses"], snap["prefetch_issued"], snap["prefetch_hits"]) == (1, 1, 2, 1)
    assert snap["bytes_to_device"] == (snap["misses"] + snap["prefetch_issued"]) * 64
    assert cache.resident_bytes() <= 3 * 64


def test_prefetch_never_evicts_an_expert_in_use_nor_breaks_the_budget():
    cache, store = _cache(slots=2)
    gen = cache.fetch(0, [0, 1])
    next(gen)                                 # 0 and 1 are pinned now (0 computing, 1 loading)
    assert cache.prefetch(0, [5]) == 0        # no slot can be taken
    assert {k[1] for k in cache.resident} == {0, 1}
    list(gen)
    assert cache.prefetch(0, [5]) == 1        # now an unpinned slot can go
    assert cache.resident_bytes() <= 2 * 64


def test_prefetch_does_not_evict_other_unused_prefetches_and_counts_waste():
    cache, store = _cache(slots=2)
    assert cache.prefetch(0, [3, 4, 5]) == 2  # the third would evict an unused prefetch: refused
    _run(cache, [0, 1])                       # demand loads may evict them: counted as wasted
    snap = cache.stats.snapshot()
    assert snap["prefetch_wasted"] == 2 and snap["prefetch_hits"] == 0


def test_on_pinned_runs_after_this_layers_experts_are_safe():
    cache, store = _cache(slots=3)
    _run(cache, [0, 1])
    seen = []

    def prefetch_next_layer():
        seen.append(cache.prefetch(0, [4, 5]))   # may only take the one slot not pinned by [0, 1]

    assert _run_with(cache, [0, 1], prefetch_next_layer) == [0, 1]
    assert seen == [1]


def _run_with(cache, experts, on_pinned):
    return [e for e, _ in cache.fetch(0, experts, on_pinned=on_pinned)]


# -- CPU compute of missing experts and resident layers (expert_compute, resident_layers) ---------------------------

def _host_store(num_layers: int = 1) -> CpuStore:
    """A real CpuStore on the CPU whose slab (l, e) holds 10 l + e."""
    store = CpuStore.allocate([SlabLayout((("w", (16,)),))] * num_layers, [6] * num_layers, torch.float32)
    for layer, slabs in enumerate(store.slabs):
        for e in range(6):
            slabs[e].fill_(10.0 * layer + e)
    return store


def test_forced_slots_on_a_cpu_store_cpu_compute_yields_the_host_copy_and_device_copies():
    """zero_copy=False: the CPU-only stand-in for a GPU. 'cpu' hands out the store's own slab; 'device' a slot."""
    for compute in ("cpu", "device"):
        store = _host_store()
        cache = ExpertCache(store, torch.device("cpu"), 3 * 64, "lru", OffloadStats(1, 3 * 64),
                            expert_compute=compute, zero_copy=False)
        assert not cache.zero_copy and cache.num_slots == 3
        got = {e: slab for e, slab in cache.fetch(0, [4, 1], tokens=[1, 2])}
        assert all(torch.all(got[e] == e) for e in (1, 4))
        in_store = all(got[e].data_ptr() == store.host_slab(0, e).data_ptr() for e in (1, 4))
        snap = cache.stats.snapshot()
        if compute == "cpu":
            assert in_store and not cache.resident
            assert (snap["cpu_computed"], snap["misses"], snap["bytes_to_device"]) == (2, 0, 0)
            assert snap["cpu_bytes_read"] == 0            # computed in place: nothing read
        else:
            assert not in_store and {k[1] for k in cache.resident} == {1, 4}
            assert (snap["cpu_computed"], snap["misses"], snap["bytes_to_device"]) == (0, 2, 2 * 64)


def test_cpu_compute_from_disk_reads_into_reused_host_buffers_and_resident_experts_still_come_first():
    cache, store = _cache(slots=2)
    _run(cache, [3])                                   # 3 becomes resident (expert_compute="device")
    cache.expert_compute = "cpu"
    assert _run(cache, [0, 3, 1, 2, 5]) == [3, 0, 1, 2, 5]   # resident first, then the CPU ones in order
    assert sorted(store.reads) == [0, 1, 2, 3, 5]     # each read once, into a host buffer, not a slot
    assert {k[1] for k in cache.resident} == {3} and len(cache.cpu.host_buffers) == 2
    snap = cache.stats.snapshot()
    assert (snap["hits"], snap["cpu_computed"], snap["cpu_bytes_read"]) == (1, 4, 4 * 64)
    assert snap["bytes_to_device"] == 64               # only the first copy of 3


def test_a_failed_cpu_read_raises_and_the_next_fetch_reads_again():
    class FailingOnce(CountingStore):
        failed = False

        def read_into(self, layer, expert, dst):
            if expert == 1 and not self.failed:
                self.failed = True
                raise OSError("disk hiccup")
            super().read_into(layer, expert, dst)

    store = FailingOnce()
    cache = ExpertCache(store, torch.device("cpu"), 2 * 64, "lru", OffloadStats(1, 128), expert_compute="cpu")
    with pytest.raises(OSError, match="disk hiccup"):
        _run(cache, [0, 1, 2])
    assert _run(cache, [1]) == [1]                    # read again, right bytes
    gen = cache.fetch(0, [4, 5, 0])                   # stopped early with reads in flight: nothing breaks
    next(gen)
    gen.close()
    assert sorted(_run(cache, [5, 0])) == [0, 5]


def test_resident_layers_stay_for_good_under_pressure_and_a_too_small_cache_is_refused():
    store = _host_store(num_layers=3)
    stats = OffloadStats(3, 8 * 64)
    cache = ExpertCache(store, torch.device("cpu"), 8 * 64, "lru", stats, resident_layers=1, zero_copy=False)
    assert {k for k in cache.resident} == {(0, e) for e in range(6)}
    for layer in (1, 2, 0, 1, 2):                     # layers 1 and 2 churn through the 2 other slots
        seen = [e for e, slab in cache.fetch(layer, [0, 3, 5]) if torch.all(slab == 10 * layer + e)]
        assert sorted(seen) == [0, 3, 5]
    assert {k for k in cache.resident if k[0] == 0} == {(0, e) for e in range(6)}
    snap = stats.snapshot()
    assert snap["per_layer"][0]["misses"] == snap["per_layer"][0]["evictions"] == 0
    assert snap["per_layer"][0]["hits"] == 3 and snap["peak_cache_bytes"] <= 8 * 64
    with pytest.raises(hf_moe_offload.PolicyError, match="use at least 448 bytes"):
        ExpertCache(_host_store(2), torch.device("cpu"), 6 * 64, "lru", OffloadStats(2), resident_layers=1,
                    zero_copy=False)
