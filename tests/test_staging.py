"""Read-ahead guesses of an on-demand pass land in the staging room and never evict a resident expert; speculative
reads yield to demand reads, down to their chunks, until the forward needs them (promoted to demand reads)."""

from __future__ import annotations

import threading
import time

import torch


from hf_moe_offload.memory import copy_engine
from hf_moe_offload.memory.cache import ExpertCache
from hf_moe_offload.memory.eviction import make_eviction
from hf_moe_offload.stats import OffloadStats
from hf_moe_offload.storage import read_priority, store as store_module
from hf_moe_offload.storage.read_priority import (DemandGate, Promotion, PriorityReaders, reading_speculatively,
                                                  speculative)
from test_streaming import NUMEL, LayeredStore


def _cache(slots: int, layers: int = 3, experts: int = 8):
    store = LayeredStore(layers, experts)
    stats = OffloadStats(layers, 0)
    return ExpertCache(store, torch.device("cpu"), slots * NUMEL * 4, make_eviction("layer", layers), stats), store


def _pass(cache: ExpertCache, routes: dict[int, list[int]], guesses: dict[int, list[int]]) -> None:
    """One on-demand pass that reads the next layer's guesses ahead while each layer computes."""
    cache.begin_pass(None, ahead_room=2)
    for layer in sorted(routes):
        if layer + 1 in guesses:
            cache.read_ahead(layer + 1, guesses[layer + 1])
        for e, slab in cache.fetch(layer, routes[layer]):
            assert torch.all(slab == 100 * layer + e)


def test_wrong_guesses_never_evict_a_resident_expert():
    cache, store = _cache(slots=8, experts=12)
    routes = {0: [0, 1], 1: [0, 1], 2: [0, 1]}
    cache.begin_pass(None)                              # no read-ahead: the pass fills the cache on demand
    for layer, experts in routes.items():
        list(cache.fetch(layer, experts))
    residents = set(cache.resident)
    assert len(residents) == 6
    for i in range(6):                                  # every guess wrong, and new at every pass
        wrong = [6 + 2 * (i % 3), 7 + 2 * (i % 3)]
        _pass(cache, routes, {1: wrong, 2: wrong})
        assert residents <= set(cache.resident)         # the routed experts stayed
    reads = [r for r in store.reads if r[1] < 6]
    assert len(reads) == 6                              # each routed expert read once, at the first pass
    snap = cache.stats.snapshot()
    assert snap["readahead_issued"] > 0 and snap["prefetch_hits"] == 0
    assert len(cache.resident) <= cache.num_slots


def test_right_guesses_are_read_ahead_and_demand_loads_leave_the_room_free():
    cache, store = _cache(slots=8, experts=16)
    for step in range(6):                               # every pass routes new experts: each one is a miss
        routes = {layer: [2 * step, 2 * step + 1] for layer in range(3)}
        _pass(cache, routes, {1: routes[1], 2: routes[2]})
        assert len(cache.resident) <= cache.num_slots
    snap = cache.stats.snapshot()
    # Every guess read ahead is used (a guess still in flight when the next one needs room waits its turn, so how
    # many are read ahead depends on the readers' timing); at most layers 1 and 2 of every pass.
    assert 0 < snap["readahead_issued"] == snap["prefetch_hits"] <= 6 * 4
    assert snap["prefetch_wasted"] == 0
    assert snap["misses"] == 6 * 6 - snap["prefetch_hits"]


def test_a_guess_waits_for_a_demand_read_between_jobs_and_chunks():
    readers = PriorityReaders(1)
    gate, order = threading.Event(), []
    readers.submit(gate.wait, demand=True)              # holds the only worker
    later = [readers.submit(lambda: order.append(("guess", reading_speculatively())), demand=False),
             readers.submit(lambda: order.append(("demand", reading_speculatively())), demand=True)]
    gate.set()
    for future in later:
        future.result()
    assert order == [("demand", False), ("guess", True)]
    readers.close()


def _chunked_disk():
    disk = store_module.DiskStore.__new__(store_module.DiskStore)     # only the chunk reader is exercised
    disk._chunk_pool, disk._fds_lock, disk._demand = None, threading.Lock(), DemandGate()
    return disk


def _timed_reads(seconds: float):
    """A chunk read that takes `seconds`, and the (range, start, end) of every call to it."""
    spans, lock = [], threading.Lock()

    def fake_read(rng, buffer):
        start = time.perf_counter()
        time.sleep(seconds)
        with lock:
            spans.append((rng, start, time.perf_counter()))
    return fake_read, spans


def test_a_speculative_read_starts_no_chunk_while_a_demand_read_is_under_way():
    fake_read, spans = _timed_reads(0.004)
    disk = _chunked_disk()
    guess = [(fake_read, ("guess", i), None) for i in range(24)]

    def read_guess():
        with speculative():
            disk._read_chunks(guess)

    with disk._demand.demand():                          # a demand read under way
        reader = threading.Thread(target=read_guess)
        reader.start()
        time.sleep(0.03)
        assert not spans                                 # no guess chunk started meanwhile
        ended = time.perf_counter()
    reader.join(timeout=5)
    assert not reader.is_alive()
    assert sorted(rng for rng, _, _ in spans) == sorted(rng for _, rng, _ in guess)     # every chunk, once
    assert min(start for _, start, _ in spans) > ended                                  # all after the demand read


def test_a_demand_read_that_comes_waits_only_for_the_guess_chunks_in_flight():
    fake_read, spans = _timed_reads(0.004)
    disk = _chunked_disk()
    guess = [(fake_read, ("guess", i), None) for i in range(24)]
    demand = [(fake_read, ("demand", i), None) for i in range(6)]

    def read_guess():
        with speculative():
            disk._read_chunks(guess)

    reader = threading.Thread(target=read_guess)
    reader.start()
    time.sleep(0.006)                                   # the guess is under way, a few chunks at a time
    began = time.perf_counter()
    disk._read_chunks(demand)
    ended = time.perf_counter()
    reader.join()
    guess_starts = [start for (kind, _), start, _ in spans if kind == "guess"]
    assert len(guess_starts) == len(guess)
    # Only chunks the guess had handed to the chunk readers before the demand read came may start during it.
    assert len([t for t in guess_starts if began < t < ended]) <= store_module.CHUNK_READERS
    assert any(t > ended for t in guess_starts)                  # and the guess went on after it


def test_a_promoted_guess_runs_next_as_a_demand_job():
    readers = PriorityReaders(1)
    gate, order = threading.Event(), []
    readers.submit(gate.wait, demand=True)              # holds the only worker
    guesses = [readers.submit(lambda i=i: order.append((i, reading_speculatively())), demand=False)
               for i in range(3)]
    assert guesses[2].promote()                         # the forward now waits for the last guess
    assert not guesses[2].promote()                     # twice: promoted once, run once
    gate.set()
    for future in guesses:
        future.result()
    assert order == [(2, False), (0, True), (1, True)]
    readers.close()


def test_a_guess_promoted_mid_read_reads_the_rest_at_once_beside_a_demand_read():
    fake_read, spans = _timed_reads(0.01)
    disk, promotion = _chunked_disk(), Promotion()
    guess = [(fake_read, ("guess", i), None) for i in range(12)]

    def read_guess():
        with speculative(promotion):
            disk._read_chunks(guess)

    with disk._demand.demand():                          # a demand read under way: the guess waits
        reader = threading.Thread(target=read_guess)
        reader.start()
        time.sleep(0.03)
        assert not spans                                 # no chunk started behind the demand read
        promotion.promote()                              # the forward needs the guess now
        reader.join(timeout=5)
    assert not reader.is_alive()
    assert sorted(rng for rng, _, _ in spans) == sorted(rng for _, rng, _ in guess)     # every chunk, once
    # Read several at once, not one by one: some reads were in flight together (counted from the spans, not
    # timed: on a busy machine the chunk readers' threads may start later than one read takes).
    most_at_once = max(sum(start < end_other and start_other < end for _, start_other, end_other in spans)
                       for _, start, end in spans)
    assert most_at_once >= 2


def test_a_speculative_read_uses_smaller_chunks_and_several_at_once(monkeypatch):
    in_flight, most, lock = [0], [0], threading.Lock()

    def fake_read(rng, buffer):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.02)
        with lock:
            in_flight[0] -= 1

    disk = _chunked_disk()
    with speculative():
        disk._read_chunks([(fake_read, i, None) for i in range(8)])
    assert most[0] == store_module.CHUNK_READERS
    assert store_module.SPECULATIVE_CHUNK_BYTES < store_module.READ_CHUNK_BYTES


class SlowStore(LayeredStore):
    """Reads take a while."""

    def read_into(self, layer, expert, dst):
        time.sleep(0.02)
        super().read_into(layer, expert, dst)


def test_a_guess_still_being_read_when_its_layer_needs_it_is_promoted_to_a_demand_read(monkeypatch):
    promoted, promote = [], read_priority.ReadFuture.promote

    def recording(future):
        did = promote(future)
        promoted.append(did)
        return did
    monkeypatch.setattr(read_priority.ReadFuture, "promote", recording)
    monkeypatch.setattr(copy_engine, "DISK_READERS", 1)        # one read at a time: the guesses come last
    store = SlowStore(3, 8)
    cache = ExpertCache(store, torch.device("cpu"), 8 * NUMEL * 4, make_eviction("layer", 3), OffloadStats(3, 0))
    cache.begin_pass(None, ahead_room=2)
    cache.read_ahead(1, [6, 7])                             # layer 0 computes: layer 1's guesses are read meanwhile
    list(cache.fetch(0, [0, 1]))
    out = {e: float(slab[0]) for e, slab in cache.fetch(1, [6, 7])}
    assert out == {6: 106.0, 7: 107.0}
    assert any(promoted)                                    # a guess still on its way was promoted
    snap = cache.stats.snapshot()
    assert snap["prefetch_hits"] == 2 and snap["misses"] == 2
    assert snap["prefetch_promoted"] == sum(promoted) >= 1  # and counted
