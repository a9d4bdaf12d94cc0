"""Look-ahead eviction, prefetch="auto" and the Belady simulator: exact tokens, the budget
with prefetches in flight, in-use experts never evicted, the optimum on known traces, and the auto rule's decisions."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import hf_moe_offload
from hf_moe_offload.analysis import RoutingRecorder, simulate
from hf_moe_offload.memory.cache import ExpertCache
from hf_moe_offload.memory.eviction import LookAhead, make_eviction
from hf_moe_offload.runtime.lookahead_gate import LookaheadGate, PayoffTrial, RouterLookahead
from hf_moe_offload.runtime.pass_scheduler import PassScheduler
from hf_moe_offload.stats import OffloadStats
from conftest import offloaded, reference, token_inputs
from test_streaming import NUMEL, LayeredStore

THIRD = "34%"   # 4 of the tiny models' 12 experts
GENERATE = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)


class BudgetWatch(hf_moe_offload.LayerHook):
    """Resident bytes (loads in flight count: a slot is taken when its load is issued) at every layer."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    def on_pinned(self, layer):
        self.seen.append(self.engine.cache.resident_bytes())

    def on_layer_done(self, layer):
        self.seen.append(self.engine.cache.resident_bytes())


def lookahead_of(model) -> RouterLookahead:
    return next(h for h in hf_moe_offload.get_engine(model).hooks if isinstance(h, PassScheduler)).lookahead


@pytest.mark.parametrize("prefetch", ["auto", "lookahead"])
@pytest.mark.parametrize("eviction", ["lookahead", "layer"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_lookahead_eviction_and_prefetch_give_the_unpatched_tokens_within_budget(tiny_models, family, eviction,
                                                                                   prefetch):
    ids, _ = token_inputs(1, 6, seed=11)
    expected = reference(family, tiny_models[family]).generate(ids, **GENERATE)
    model = offloaded(family, tiny_models[family], device="cpu", store="disk", expert_cache=THIRD,
                      eviction=eviction, prefetch=prefetch)
    engine = hf_moe_offload.get_engine(model)
    assert engine.cache.num_slots == 4
    watch = BudgetWatch(engine)
    engine.add_hook(watch)
    assert torch.equal(model.generate(ids, **GENERATE), expected)
    snap = hf_moe_offload.stats(model)
    capacity = snap["cache_capacity_bytes"]
    assert max(watch.seen) <= capacity and snap["peak_cache_bytes"] <= capacity
    assert snap["bytes_to_device"] == (snap["misses"] + snap["prefetch_issued"]) * engine.store.slab_bytes(0)
    assert snap["lookahead_guesses"] >= snap["lookahead_used"]
    if prefetch == "lookahead":
        assert snap["readahead_issued"] > 0 and snap["lookahead_on"] is True


def test_default_prefetch_is_auto_and_scores_guesses_without_reading_them_while_off(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache=THIRD,
                      schedule="on_demand")
    assert hf_moe_offload.get_engine(model).policy.prefetch == "auto"
    lookahead_of(model).gate = LookaheadGate(min_guesses=10**6)    # never decides: stays off
    model.generate(token_inputs(1, 6, seed=3)[0], **GENERATE)
    snap = hf_moe_offload.stats(model)
    assert snap["lookahead_guesses"] > 0 and snap["lookahead_on"] is False
    assert snap["readahead_issued"] == snap["prefetch_issued"] == 0


def _recorded_routes(family, path, ids) -> list[tuple[int, tuple[int, ...]]]:
    model = offloaded(family, path, device="cpu", store="disk", expert_cache=THIRD, prefetch="none")
    recorder = RoutingRecorder()
    hf_moe_offload.get_engine(model).add_hook(recorder)
    model.generate(ids, **GENERATE)
    return recorder.routes()


@pytest.mark.parametrize("right", [True, False])
def test_auto_reads_ahead_while_guesses_are_right_and_stops_when_they_are_wrong(tiny_models, right):
    """The look-ahead's guesses replaced by the routing recorded in an earlier run (right) or its complement (wrong)."""
    family, path = "mixtral", tiny_models["mixtral"]
    ids, _ = token_inputs(1, 6, seed=12)
    expected = reference(family, path).generate(ids, **GENERATE)
    routes = _recorded_routes(family, path, ids)
    per_layer = {layer: [experts for l, experts in routes if l == layer] for layer in (0, 1)}
    model = offloaded(family, path, device="cpu", store="disk", expert_cache=THIRD, schedule="on_demand")
    lookahead = lookahead_of(model)
    lookahead.gate = LookaheadGate(window=16, min_guesses=4)
    lookahead.gate.on = not right                 # starts the other way: the rule must turn it
    calls = Counter()

    def guesses(layer, hidden_states):
        chosen = per_layer[layer][calls[layer]]
        calls[layer] += 1
        return list(chosen) if right else [e for e in range(6) if e not in chosen]

    lookahead.likely_experts = guesses
    out = model.generate(ids, **GENERATE)
    assert torch.equal(out, expected)             # exact whatever the guesses
    snap = hf_moe_offload.stats(model)
    assert snap["lookahead_guesses"] >= 4
    if right:
        assert snap["lookahead_precision"] == 1.0 and snap["lookahead_on"] is True
        assert snap["prefetch_hits"] > 0 and snap["prefetch_wasted"] == 0
    else:
        assert snap["lookahead_precision"] == 0.0 and snap["lookahead_on"] is False
        assert snap["readahead_issued"] <= 2 * 4      # top-k reads per step until 4 guesses were scored


def test_gate_break_even_and_recovery():
    gate = LookaheadGate(window=20, min_guesses=10)
    for _ in range(10):
        gate.record(guessed=2, used=0, routed_resident=1, routed_other=1)
    assert gate.on is False and gate.precision == 0.0
    assert gate.break_even == pytest.approx(1.5 / 2.5)       # h = 0.5: (1 + h) / (1 + h + 1)
    for _ in range(10):                                       # guesses turn right: scored while off, it comes back
        gate.record(guessed=2, used=2, routed_resident=1, routed_other=1)
    assert gate.on is True
    for _ in range(3):                                        # a little worse, within the hysteresis: stays on
        gate.record(guessed=2, used=1, routed_resident=1, routed_other=1)
    assert gate.precision == pytest.approx(17 / 20) and gate.on is True
    with pytest.raises(ValueError, match="hit_saves"):
        LookaheadGate(hit_saves=0)


def test_wasted_prefetches_never_evict_an_expert_in_use():
    store = LayeredStore(num_layers=2, num_experts=4)
    stats = OffloadStats(2, 0)
    cache = ExpertCache(store, torch.device("cpu"), 3 * NUMEL * 4, make_eviction("lookahead", 2), stats)
    cache.begin_pass(None, ahead_room=2)
    fetch = cache.fetch(0, [0, 1])
    held = [next(fetch)]                                      # (0, e) in use, its slab handed out
    assert cache.prefetch(1, [0, 1, 2, 3]) <= 1               # one free slot; the in-use experts are pinned
    for e, slab in fetch:
        held.append((e, slab))
    for e, slab in held:
        assert torch.all(slab == e)                           # nothing overwrote them while in use
    in_use = cache.fetch(1, [3])
    e, slab = next(in_use)
    cache.prefetch(0, [2, 3])                                 # guesses while (1, 3) computes
    assert (1, 3) in cache.resident and torch.all(slab == 103)
    list(in_use)
    list(cache.fetch(0, [2, 3]))                              # demand evicts unused guesses first: wasted
    snap = stats.snapshot()
    assert snap["prefetch_issued"] >= 1 and snap["prefetch_hits"] + snap["prefetch_wasted"] <= snap["prefetch_issued"]
    assert cache.resident_bytes() <= cache.num_slots * cache.slot_bytes


def test_lookahead_policy_evicts_the_furthest_predicted_use():
    policy = LookAhead(num_layers=4)
    policy.observe(1, [2])
    policy.observe(3, [4])
    # while layer 0 computes: (1, 2) is used next pass-step at distance 0, (3, 4) at 2, (3, 5) not predicted: 6
    assert policy.choose([(1, 2), (3, 5), (3, 4)], layer=0) == (3, 5)
    policy.predict(3, [5])                                    # this pass's router guess overrides the last step
    assert policy.choose([(1, 2), (3, 5), (3, 4)], layer=0) == (3, 4)
    assert policy.choose([(2, 0), (2, 1)], layer=0) == (2, 0)  # equal distance: the least recent (first) leaves


def test_belady_gives_the_known_optimum_on_a_textbook_trace():
    trace = [(0, (page,)) for page in (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)]
    assert simulate(trace, slots=3, policy="belady").misses == 7      # OPT, 3 frames
    assert simulate(trace, slots=3, policy="lru").misses == 10        # LRU, 3 frames
    assert simulate(trace, slots=4, policy="belady").misses == 6
    with pytest.raises(ValueError, match="slots"):
        simulate([(0, (1, 2, 3))], slots=2)
    with pytest.raises(ValueError, match="allowed"):
        simulate(trace, slots=3, policy="fifo")


def test_belady_never_misses_more_than_the_online_policies_on_random_traces():
    rng = random.Random(0)
    for _ in range(150):
        layers, experts, k = rng.randint(1, 4), rng.randint(2, 8), rng.randint(1, 2)
        trace = [(layer, tuple(rng.sample(range(experts), k))) for _ in range(25) for layer in range(layers)]
        slots = rng.randint(k, layers * experts)
        best = simulate(trace, slots, "belady").misses
        for policy in ("lru", "layer", "lookahead", "lfu"):
            assert best <= simulate(trace, slots, policy).misses, (trace, slots, policy)


def test_simulated_policies_match_the_engine_on_a_recorded_trace(tiny_models):
    """Without prefetch, the simulator's misses equal the engine's own on the routing it recorded (a one-token
    prompt: no layer needs more experts than the cache has slots)."""
    ids, _ = token_inputs(1, 1, seed=13)
    for eviction in ("lru", "layer", "lookahead"):
        model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache=THIRD,
                          eviction=eviction, prefetch="none", schedule="on_demand")
        engine = hf_moe_offload.get_engine(model)
        recorder = RoutingRecorder(predictions=eviction == "lookahead").bind(engine)
        engine.add_hook(recorder)
        model.generate(ids, **GENERATE)
        sim = simulate(recorder.trace, slots=engine.cache.num_slots, policy=eviction, num_layers=2)
        assert sim.misses == hf_moe_offload.stats(model)["misses"], eviction
        assert simulate(recorder.trace, engine.cache.num_slots, "belady").misses <= sim.misses


def test_a_recorder_of_predictions_not_bound_to_the_engine_says_so(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache=THIRD)
    hf_moe_offload.get_engine(model).add_hook(RoutingRecorder(predictions=True))
    with pytest.raises(RuntimeError, match=r"bind it to the engine first"):
        model.generate(token_inputs(1, 3, seed=13)[0], **GENERATE)


def test_payoff_trial_keeps_reading_only_when_it_lowers_the_stall():

    def run(trial, stall_off, stall_on, passes):
        reads, reading = [], trial.next_pass(None)
        for _ in range(passes):
            reads.append(reading)
            reading = trial.next_pass(stall_on if reading else stall_off)
        return reads

    helps = PayoffTrial(block=2, rounds=2, hold=5)
    reads = run(helps, stall_off=0.2, stall_on=0.1, passes=8)
    assert reads == [False, False, True, True, False, False, True, True]     # alternating blocks
    assert helps.verdict == "on" and run(helps, 0.2, 0.1, 4) == [True] * 4

    hurts = PayoffTrial(block=2, rounds=2, hold=5)
    run(hurts, stall_off=0.1, stall_on=0.3, passes=8)
    assert hurts.verdict == "off" and run(hurts, 0.1, 0.3, 4) == [False] * 4
    run(hurts, 0.1, 0.3, 2)                                   # the hold ends: the trial runs again
    assert hurts.verdict == "trial"

    even = PayoffTrial(block=1, rounds=1, hold=5, margin=0.05)
    run(even, stall_off=0.1, stall_on=0.098, passes=2)        # within the margin: not worth the bytes
    assert even.verdict == "off"


def test_a_streamed_pass_over_resident_experts_guesses_nothing(tiny_models):
    """With every expert of the next layer in the cache, the streamed read-ahead has nothing to read: it makes no
    guess (ranking one brings the router's choice to the host, a host sync per layer on CUDA). Same tokens."""
    ids, mask = token_inputs(batch=2, length=6, seed=4)
    want = reference("mixtral", tiny_models["mixtral"]).generate(ids, attention_mask=mask, **GENERATE)
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="100%",
                      schedule="stream")
    lookahead = lookahead_of(model)
    guesses, likely = [], lookahead.likely_experts

    def counting(layer, hidden_states):
        guesses.append(layer)
        return likely(layer, hidden_states)
    lookahead.likely_experts = counting
    assert torch.equal(model.generate(ids, attention_mask=mask, **GENERATE), want)   # every expert read once
    assert guesses                                       # the first passes guessed what to read
    guesses.clear()
    assert torch.equal(model.generate(ids, attention_mask=mask, **GENERATE), want)
    assert guesses == []                                 # all resident now: nothing guessed


def test_auto_makes_no_guess_for_a_next_layer_the_cache_holds_whole_but_still_scores_its_routing(tiny_models):
    """Every expert resident: the router's look-ahead product would only name resident experts, so none is run."""
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="100%",
                      schedule="on_demand")
    lookahead = lookahead_of(model)
    lookahead.gate = LookaheadGate(min_guesses=10**6)
    made = Counter()
    real = lookahead.likely_experts

    def counted(layer, hidden_states):
        made[layer] += 1
        return real(layer, hidden_states)

    lookahead.likely_experts = counted
    model.generate(token_inputs(1, 6, seed=3)[0], **GENERATE)                  # the prompt fills the cache
    made.clear()
    routed_before = len(lookahead.gate.routed)
    model.generate(token_inputs(1, 6, seed=3)[0], **GENERATE)
    assert sum(made.values()) == 0
    assert len(lookahead.gate.routed) > routed_before                        # routing still scored
    assert hf_moe_offload.stats(model)["prefetch_issued"] == 0


def test_rank_experts_orders_by_count_then_expert_id():
    from hf_moe_offload.runtime.lookahead_gate import rank_experts

    gen = torch.Generator().manual_seed(0)
    for experts, k, tokens in ((8, 2, 1), (128, 8, 1), (128, 8, 16), (64, 6, 4)):
        indices = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
        counts = Counter(indices.reshape(-1).tolist())
        assert rank_experts(indices, experts) == sorted(counts, key=lambda e: (-counts[e], e))
