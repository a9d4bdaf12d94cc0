"""The streaming schedule: chosen per pass from its shape, exact, within the budget, no expert read twice in a pass,
and fewer bytes per pass than the on-demand schedule when every expert is used once per pass."""

from __future__ import annotations

import pytest
import torch

import hf_moe_offload
from hf_moe_offload.arch import SlabLayout
from hf_moe_offload.memory.cache import ExpertCache
from hf_moe_offload.policy.offload_policy import DEFAULT_STREAM_WINDOW, WIDE_STREAM_WINDOW
from hf_moe_offload.runtime.pass_scheduler import PassScheduler
from hf_moe_offload.stats import OffloadStats
from hf_moe_offload.storage.store import ExpertStore
from conftest import FAMILIES, model_class, offloaded, reference, token_inputs

NUMEL = 16


class LayeredStore(ExpertStore):
    """Slab (layer, e) holds the value 100 * layer + e; every read is recorded."""

    def __init__(self, num_layers: int, num_experts: int):
        super().__init__([SlabLayout((("w", (NUMEL,)),))] * num_layers, [num_experts] * num_layers, torch.float32)
        self.reads: list[tuple[int, int]] = []

    def read_into(self, layer, expert, dst):
        self.reads.append((layer, expert))
        dst[:NUMEL].fill_(100.0 * layer + expert)


def _cyclic_passes(window: int | None, passes: int = 6, layers: int = 4, experts: int = 4, slots: int = 6,
                   eviction: str = "layer"):
    """Passes in which every layer uses every expert (a large batch): reads per pass after the first."""
    store = LayeredStore(layers, experts)
    stats = OffloadStats(layers, slots * NUMEL * 4)
    cache = ExpertCache(store, torch.device("cpu"), slots * NUMEL * 4, eviction, stats)
    reads = []
    for _ in range(passes):
        before = len(store.reads)
        cache.begin_pass(window)
        for layer in range(layers):
            if window is not None and layer + 1 < layers:
                cache.read_ahead(layer + 1, range(experts))
            for e, slab in cache.fetch(layer, list(range(experts))):
                assert torch.all(slab == 100 * layer + e)
                assert cache.resident_bytes() <= cache.num_slots * cache.slot_bytes
        reads.append(len(store.reads) - before)
    return reads[1:], stats.snapshot()


@pytest.mark.parametrize("eviction", ["layer", "lru", "lfu"])
def test_streaming_reads_each_non_resident_expert_once_per_pass_and_fewer_than_on_demand(eviction):
    """Residency in a streamed pass is decided by the forward order, whatever policy serves on-demand passes."""
    streamed, snap = _cyclic_passes(window=1, eviction=eviction)
    on_demand, _ = _cyclic_passes(window=None, eviction=eviction)
    total, slots = 16, 6
    assert snap["repeat_reads"] == 0
    # the floor is (experts - slots) reads per pass; the window costs at most its size plus the computing slot
    assert all(total - slots <= r <= total - slots + 2 for r in streamed), streamed
    assert sum(streamed) < sum(on_demand), (streamed, on_demand)


def _skewed_passes(stream_eviction, passes=60, layers=4, experts=8, slots=10, window=2, hot=2, share=0.5):
    """Streamed passes in which each layer routes to its `hot` experts every time and to each other expert with
    probability `share` (a batch too small to touch every expert, and skewed routing, as in trained MoEs). Mean
    reads per pass after a warm-up, and the best fixed resident set's reads (its `slots` most used experts)."""
    import random
    from collections import Counter

    rng = random.Random(0)
    routes = [[[e for e in range(experts) if e < hot or rng.random() < share] for _ in range(layers)]
              for _ in range(passes)]
    store = LayeredStore(layers, experts)
    cache = ExpertCache(store, torch.device("cpu"), slots * NUMEL * 4, "layer", OffloadStats(layers, 0))
    cache.stream_eviction = stream_eviction(layers)
    reads = []
    for route in routes:
        before = len(store.reads)
        cache.begin_pass(window)
        for layer in range(layers):
            if layer + 1 < layers:
                cache.read_ahead(layer + 1, route[layer + 1])
            for e, slab in cache.fetch(layer, route[layer]):
                assert torch.all(slab == 100 * layer + e)
        reads.append(len(store.reads) - before)
    uses = Counter((layer, e) for route in routes[10:] for layer, used in enumerate(route) for e in used)
    kept = {key for key, _ in uses.most_common(slots)}
    floor = sum(n for key, n in uses.items() if key not in kept) / len(routes[10:])
    return sum(reads[10:]) / len(reads[10:]), floor


def test_streamed_passes_keep_the_hot_experts_resident():
    """Which experts stay across passes is decided by heat (Klotski's hot experts), not by recency: the layer's least
    recent expert is one it computed first, a resident one, so recency rotated the resident set every pass."""
    from hf_moe_offload.memory.eviction import HotFirst, LayerAware

    hot, floor = _skewed_passes(HotFirst)
    recent, _ = _skewed_passes(LayerAware)
    assert hot < 0.95 * recent, (hot, recent)
    # Above the best fixed set: the window's 2 slots and the computing one (loads land in a varying order: +0.5).
    assert hot <= floor + 2 + 1 + 0.5, (hot, floor)


def test_read_ahead_never_evicts_what_the_next_layer_needs():
    store = LayeredStore(num_layers=2, num_experts=4)
    cache = ExpertCache(store, torch.device("cpu"), 6 * NUMEL * 4, "layer", OffloadStats(2, 0))
    cache.begin_pass(None)
    for layer in (0, 1):
        list(cache.fetch(layer, [0, 1, 2]))                 # resident: (0, 0..2), (1, 0..2)
    cache.begin_pass(2)
    cache.read_ahead(1, [3])
    for _ in cache.fetch(0, [0, 1, 2]):
        pass
    assert all((1, e) in cache.resident for e in range(4))  # (1, 3) came in without evicting (1, 0..2)


@pytest.mark.parametrize("window", [1, 2])
def test_the_window_admits_the_next_read_as_an_expert_starts_computing(window):
    """An expert leaves the stream window when it is handed to compute, not when its compute ends: while the
    consumer holds expert i, the loads of the next `window` experts are already issued (a read that waited for
    the compute left the disk idle for part of every expert's compute)."""
    store = LayeredStore(num_layers=1, num_experts=6)
    cache = ExpertCache(store, torch.device("cpu"), 6 * NUMEL * 4, "layer", OffloadStats(1, 0))
    cache.begin_pass(window)
    served = []
    for e, slab in cache.fetch(0, list(range(6))):
        served.append(e)
        issued = {key[1] for key in cache.resident}
        assert len(issued - set(served)) == min(window, 6 - len(served)), (served, issued)
        assert torch.all(slab == e)
    assert sorted(served) == list(range(6)) and len(store.reads) == 6


@pytest.mark.parametrize("window", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_batches_give_the_unpatched_tokens_within_budget(tiny_models, family, window):
    ids, mask = token_inputs(8, 10, seed=5, left_pad=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = reference(family, tiny_models[family]).generate(ids, **kwargs)
    model = offloaded(family, tiny_models[family], device="cpu", store="disk", expert_cache="50%")
    engine = hf_moe_offload.get_engine(model)
    planner = next(h for h in engine.hooks if isinstance(h, PassScheduler))
    planner.window = window
    observed = []

    class Budget(hf_moe_offload.LayerHook):
        def on_pinned(self, layer):
            observed.append(engine.cache.resident_bytes())

        def on_layer_done(self, layer):
            observed.append(engine.cache.resident_bytes())

    engine.add_hook(Budget())
    assert torch.equal(model.generate(ids, **kwargs), expected)
    snap = hf_moe_offload.stats(model)
    assert snap["passes"].get("stream", 0) > 0 and snap["last_schedule"] == "stream"
    assert max(observed) <= engine.policy.expert_cache
    assert snap["repeat_reads"] == 0
    assert snap["bytes_to_device"] == (snap["misses"] + snap["prefetch_issued"]) * engine.store.slab_bytes(0)


def test_batch_one_decode_stays_on_demand_after_a_streamed_prefill(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="34%")
    ids, _ = token_inputs(1, 12, seed=6)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, model_class("mixtral").from_pretrained(tiny_models["mixtral"]).generate(
        ids, max_new_tokens=5, do_sample=False, pad_token_id=0))
    passes = hf_moe_offload.stats(model)["passes"]
    assert passes == {"stream": 1, "on_demand": 4}           # the 12-token prompt, then 4 one-token steps


def test_a_disk_store_reads_one_expert_in_parallel_chunks_byte_exact(tmp_path, monkeypatch):
    """Large experts are read by several threads in chunks; every byte lands where the slab layout says."""
    from safetensors.torch import save_file

    import hf_moe_offload.storage.store as store_module
    from hf_moe_offload.storage.checkpoint import CheckpointIndex, read_header
    from hf_moe_offload.layout import ExpertPiece, MoELayer

    up, down = torch.randn(3, 40, 24), torch.randn(3, 24, 20)      # 3 experts, two parts of different sizes
    save_file({"up": up, "down": down}, str(tmp_path / "experts.safetensors"))
    index = CheckpointIndex(str(tmp_path), read_header(str(tmp_path / "experts.safetensors")))
    layout = SlabLayout((("up", (40, 24)), ("down", (24, 20))))
    layer = MoELayer(index=0, name="experts", module=torch.nn.Module(), num_experts=3, top_k=1, layout=layout)
    pieces = [[[ExpertPiece("up", 0, index.locate("up", row=e)), ExpertPiece("down", 0, index.locate("down", row=e))]
               for e in range(3)]]
    monkeypatch.setattr(store_module, "READ_CHUNK_BYTES", 1000)    # 3840 + 1920 bytes: 6 chunks per expert
    store = store_module.DiskStore([layer], pieces, torch.float32)
    slab = torch.empty(layout.numel)
    for e in range(3):
        store.read_into(0, e, slab)
        views = layout.views(slab)
        assert torch.equal(views["up"], up[e]) and torch.equal(views["down"], down[e])
    store.close()


@pytest.mark.parametrize("family", ["mixtral", "switch_transformers"])
def test_lookahead_prefetch_in_on_demand_passes_is_exact_and_counted(tiny_models, family):
    ids, _ = token_inputs(1, 6, seed=7)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = reference(family, tiny_models[family]).generate(ids, **kwargs)
    model = offloaded(family, tiny_models[family], device="cpu", store="disk", expert_cache="50%",
                      schedule="on_demand", prefetch="lookahead")
    assert torch.equal(model.generate(ids, **kwargs), expected)
    snap = hf_moe_offload.stats(model)
    assert set(snap["passes"]) == {"on_demand"} and snap["readahead_issued"] > 0
    assert snap["prefetch_hits"] + snap["prefetch_wasted"] <= snap["prefetch_issued"] == snap["readahead_issued"]
    assert snap["peak_cache_bytes"] <= hf_moe_offload.get_engine(model).policy.expert_cache


def test_stats_time_every_pass_per_schedule_and_reset_clears_them(tmp_path):
    """The measured side of a plan: per schedule, every pass timed from its first MoE layer to its last."""
    from conftest import build_tiny, offloaded, token_inputs

    model = offloaded("mixtral", build_tiny("mixtral", tmp_path / "m"), device="cpu", store="disk",
                      expert_cache="34%", schedule="on_demand")
    ids, mask = token_inputs(1, 6)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    snap = hf_moe_offload.stats(model)
    measured = snap["measured"]["on_demand"]
    assert measured["passes_timed"] == snap["passes"]["on_demand"] == 4
    assert measured["seconds_per_pass"] > 0 and measured["tokens_per_s"] > 0
    snap.reset()
    assert hf_moe_offload.stats(model)["measured"] == {}


def test_a_prefill_with_many_rows_per_expert_streams_exactly_within_its_window(tiny_models):
    """A prefill whose experts get 128 rows each streams with `stream_window` like a decode pass (the window once
    doubled there, when a read waited for an expert's compute to end; docs/benchmarks.md), exact, within budget."""
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%")
    engine = hf_moe_offload.get_engine(model)
    planner = next(h for h in engine.hooks if isinstance(h, PassScheduler))
    windows = []
    begin = engine.cache.begin_pass
    engine.cache.begin_pass = lambda window, ahead_room=None: (windows.append(window), begin(window, ahead_room))[1]
    ids, mask = token_inputs(8, 48, seed=7, left_pad=True)       # 384 tokens: 128 rows per expert in the prefill
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    expected = reference("mixtral", tiny_models["mixtral"]).generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    # "auto" on the CPU: the prefill (128 rows per expert) streams with the wide window, the decode passes (2 rows
    # per expert) with the policy's
    assert set(windows) == {WIDE_STREAM_WINDOW, DEFAULT_STREAM_WINDOW} and planner.window == DEFAULT_STREAM_WINDOW
    assert hf_moe_offload.stats(model)["repeat_reads"] == 0
    assert hf_moe_offload.stats(model)["peak_cache_bytes"] <= engine.policy.expert_cache


def test_auto_stream_window_widens_only_passes_with_many_rows_per_expert(tiny_models):
    """stream_window="auto" (no machine profile) on the CPU: a pass with at least WIDE_WINDOW_ROWS rows per expert
    streams with WIDE_STREAM_WINDOW slots, a pass with fewer with the default window, and the tokens stay exact; a
    given window is kept for every pass."""
    ids, mask = token_inputs(8, 48, seed=7, left_pad=True)       # prefill 128 rows per expert, decode 2
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    expected = reference("mixtral", tiny_models["mixtral"]).generate(ids, **kwargs)
    for given, prefill, decode in (("auto", WIDE_STREAM_WINDOW, DEFAULT_STREAM_WINDOW), (3, 3, 3)):
        model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%",
                          schedule="stream", stream_window=given)
        engine = hf_moe_offload.get_engine(model)
        windows = []
        begin = engine.cache.begin_pass
        engine.cache.begin_pass = lambda window, ahead_room=None: (windows.append(window), begin(window, ahead_room))[1]
        seen = []
        engine.stats.record_pass = lambda schedule, window=None, record=engine.stats.record_pass: (
            seen.append(window), record(schedule, window))[1]
        assert torch.equal(model.generate(ids, **kwargs), expected)
        assert seen == [prefill, decode, decode], given       # one prefill pass, two decode passes
        assert set(windows) == {prefill, decode}
        assert hf_moe_offload.stats(model)["last_stream_window"] == decode
        assert hf_moe_offload.stats(model)["peak_cache_bytes"] <= engine.policy.expert_cache


def test_a_streamed_pass_reads_the_next_passs_first_layer_before_it_ends(tiny_models):
    """Nothing else reads the first MoE layer ahead (look-ahead reads the next layer of the same pass): its
    prefetch hits come from the read issued as a streamed pass ends, while the head and sampling run."""
    ids, mask = token_inputs(8, 10, seed=5, left_pad=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = reference("mixtral", tiny_models["mixtral"]).generate(ids, **kwargs)
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%",
                      schedule="stream")
    assert torch.equal(model.generate(ids, **kwargs), expected)
    snap = hf_moe_offload.stats(model)
    first = snap["per_layer"][0]
    assert first["prefetch_issued"] > 0 and first["prefetch_hits"] > 0
    assert snap["repeat_reads"] == 0
    slab = hf_moe_offload.get_engine(model).store.slab_bytes(0)
    assert snap["bytes_to_device"] == (snap["misses"] + snap["prefetch_issued"]) * slab


def test_an_encoder_decoders_streamed_encoder_reads_nothing_ahead_and_each_step_counts_once(tiny_models):
    """Switch Transformers: after the encoder's pass comes the decoder's, so the encoder reads no experts ahead for
    a "next pass" of its own (they were all wasted); `forward_calls` counts the model's forward, once a step."""
    ids, mask = token_inputs(3, 12, seed=0)
    model = offloaded("switch_transformers", tiny_models["switch_transformers"], device="cpu", store="disk",
                      expert_cache="50%", schedule="stream", prefetch="none")
    for _ in range(2):
        model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                       pad_token_id=0)
    snap = hf_moe_offload.stats(model)
    first = next(layer.index for layer in hf_moe_offload.get_engine(model).layers if layer.name.startswith("encoder"))
    assert snap["per_layer"][first]["readahead_issued"] == 0      # only a next pass would read the first layer
    assert snap["forward_calls"] == 12
