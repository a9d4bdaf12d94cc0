"""Micro-batches inside the forward (`micro_batches` > 1): the unpatched model's tokens and logits, every expert read
once per pass and kept until the layer's last micro-batch has used it, the budget held, clear refusals, and the
whole batch run at once where slicing would change what the caller gets."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, MixtralConfig

import hf_moe_offload
from hf_moe_offload.attention.cpu import move_cache_to_host
from hf_moe_offload.planning.footprint import Footprint
from hf_moe_offload.planning.resolve import resolve_micro_batches
from hf_moe_offload.policy.offload_policy import OffloadPolicy, PolicyError
from hf_moe_offload.runtime import microbatch, slice_streams
from hf_moe_offload.runtime.microbatch import MicroBatchCacheView, bounds
from conftest import CAUSAL_FAMILIES, COMMON, offloaded, reference, token_inputs

# 6 experts per layer, 2 layers: a layer's experts are half of all of them; 60% leaves room for the read-ahead.
HOLDS_A_LAYER = "60%"
POLICY = {"device": "cpu", "store": "disk", "expert_cache": HOLDS_A_LAYER}


def _generate(model, ids, mask, new_tokens=4):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, output_scores=True, return_dict_in_generate=True)


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
@pytest.mark.parametrize("count", [2, 3])
def test_micro_batches_give_the_unpatched_tokens_and_logits(tiny_models, family, count):
    ids, mask = token_inputs(batch=5, length=9, left_pad=True)        # 5 rows: slices of unequal size
    ref = _generate(reference(family, tiny_models[family]), ids, mask)
    model = offloaded(family, tiny_models[family], **POLICY, micro_batches=count)
    out = _generate(model, ids, mask)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.scores, ref.scores):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    snap = hf_moe_offload.stats(model)
    layers = len(model.model.layers)
    assert snap["micro_batches"] == {"split": layers * 4, "whole": 0}    # every MoE layer of every pass
    assert snap["repeat_reads"] == 0
    assert snap["peak_cache_bytes"] <= snap["cache_capacity_bytes"]


@pytest.mark.parametrize("extra", [{"schedule": "on_demand"}, {"schedule": "stream"}, {"attention": "cpu"},
                                   {"eviction": "lookahead"}, {"prefetch": "lookahead"},
                                   {"expert_compute": "auto"}])
def test_micro_batches_are_exact_with_every_schedule_and_option(tiny_models, extra):
    ids, mask = token_inputs(batch=4, length=7, seed=3, left_pad=True)
    ref = _generate(reference("mixtral", tiny_models["mixtral"]), ids, mask)
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICY, micro_batches=2, **extra)
    out = _generate(model, ids, mask)
    assert torch.equal(out.sequences, ref.sequences)
    snap = hf_moe_offload.stats(model)
    assert snap["repeat_reads"] == 0 and snap["micro_batches"]["split"] > 0


def test_a_micro_batched_pass_reads_each_expert_once_and_counts_as_one_pass(tiny_models):
    """Against the same policy without micro-batches: one pass per step (not one per slice), no expert read twice
    within a pass, and the layer's streamed experts are pinned until its last slice (never evicted meanwhile)."""
    ids, mask = token_inputs(batch=6, length=8, seed=5)
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICY, micro_batches=3)
    cache = hf_moe_offload.get_engine(model).cache
    evicted_while_held = []
    forget = cache._forget

    def watching_forget(slot):
        if cache.held_pins.protects(slot.key[0]):
            evicted_while_held.append(slot.key)
        return forget(slot)

    cache._forget = watching_forget
    _generate(model, ids, mask, new_tokens=5)
    snap = hf_moe_offload.stats(model)
    assert sum(snap["passes"].values()) == 5
    assert snap["forward_calls"] == 5
    assert snap["repeat_reads"] == 0
    assert evicted_while_held == []
    assert cache.held == 0                        # every pin given back once the layer's last slice is done


def test_the_slot_of_an_expert_is_not_reused_while_a_later_micro_batch_may_need_it(tiny_models):
    """The cache itself: after a held fetch, another layer's demand cannot take the held experts' slots, and the
    layer's other experts stay too; `release_held` gives them back."""
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache=HOLDS_A_LAYER)
    cache = hf_moe_offload.get_engine(model).cache
    slabs = {e: slab.clone() for e, slab in cache.fetch(0, [0, 1, 2], hold=True)}
    held_slots = {cache.resident[(0, e)].index for e in slabs}
    assert cache.held == 3
    for _ in cache.fetch(1, list(range(6))):     # a whole other layer through the remaining slots
        pass
    for e, slab in cache.fetch(0, [0, 1, 2]):   # the layer's last slice: still resident, same bytes, no read
        assert torch.equal(slab, slabs[e])
    assert {cache.resident[(0, e)].index for e in slabs} == held_slots
    cache.release_held()
    assert cache.held == 0 and all(cache.resident[(0, e)].pins == 0 for e in slabs)


def test_sliding_window_caches_split_exactly(tmp_path):
    config = MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
                           sliding_window=5)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path)
    ids, mask = token_inputs(batch=4, length=9, left_pad=True)
    ref = _generate(AutoModelForCausalLM.from_pretrained(tmp_path).eval(), ids, mask, new_tokens=5)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, offload_policy={**POLICY, "micro_batches": 2})
    out = _generate(model, ids, mask, new_tokens=5)
    assert torch.equal(out.sequences, ref.sequences)
    assert hf_moe_offload.stats(model)["micro_batches"]["split"] > 0


@pytest.mark.parametrize("host", [False, True], ids=["device_cache", "host_cache"])
def test_cache_view_returns_what_the_real_update_returns(host):
    """Slice by slice, the keys/values each micro-batch attends to equal the rows of one whole-batch update, and
    the cache ends up as after that update. A host cache (CPU attention) hands the earlier slices views of its
    buffer, so the cached rows are not copied per slice, and its length moves only with the last slice."""
    whole, split = DynamicCache(), DynamicCache()
    if host:
        move_cache_to_host(split)
    g = torch.Generator().manual_seed(0)
    for step, length in enumerate([4, 1, 1, 70]):        # 70: past the host buffer's first capacity, so it grows
        k, v = (torch.randn(5, 2, length, 3, generator=g) for _ in range(2))
        want_k, want_v = whole.update(k, v, 0)
        before = split.get_seq_length()
        pending: dict = {}
        rows = bounds(5, 2)
        for i, (a, b) in enumerate(rows):
            got_k, got_v = MicroBatchCacheView(split, (a, b), i, len(rows), pending).update(k[a:b], v[a:b], 0)
            assert torch.equal(got_k, want_k[a:b]) and torch.equal(got_v, want_v[a:b]), step
            if host and i == 0 and before:
                assert split.get_seq_length() == before
                buffer = split.layers[0]._buffers_kv[0]
                assert got_k.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert torch.equal(split.layers[0].keys, whole.layers[0].keys)
        assert split.get_seq_length() == whole.get_seq_length()
        assert pending == {}


def test_whole_batch_where_slicing_would_change_the_outputs(tiny_models):
    """Router logits and attentions are recorded per module call, a training forward keeps its graph whole, and
    one sequence has nothing to split: those run the whole batch, with the unpatched outputs."""
    path = tiny_models["mixtral"]
    ids, mask = token_inputs(batch=4, length=6)
    ref = reference("mixtral", path)
    model = offloaded("mixtral", path, **POLICY, micro_batches=2)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_router_logits=True)
        got = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits)
    for a, b in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    snap = hf_moe_offload.stats(model)
    assert snap["micro_batches"] == {"split": 0, "whole": 2}
    logits = model(input_ids=ids, attention_mask=mask).logits          # gradients on: whole batch
    torch.testing.assert_close(logits, ref(input_ids=ids, attention_mask=mask).logits, rtol=1e-4, atol=1e-4)
    assert hf_moe_offload.stats(model)["micro_batches"]["split"] == 0


def test_disable_puts_the_decoder_layers_back(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICY, micro_batches=2)
    assert all("forward" in vars(layer) for layer in model.model.layers)
    hf_moe_offload.disable(model)
    assert all("forward" not in vars(layer) for layer in model.model.layers)
    ids, mask = token_inputs(batch=3, length=5)
    ref = reference("mixtral", tiny_models["mixtral"])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   ref(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", [0, -1, "two", 1.5, True])
def test_bad_micro_batch_counts_are_refused(value):
    with pytest.raises(PolicyError, match="micro_batches=.*allowed: a whole number >= 1, or 'auto'"):
        OffloadPolicy(micro_batches=value).validate()


def test_a_cache_too_small_for_a_layer_is_refused_before_loading(tiny_models):
    with pytest.raises(PolicyError, match=r"micro_batches=2 keeps each layer's experts.*use at least "
                                          r"expert_cache=\d+, or micro_batches=1"):
        offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="25%",
                  micro_batches=2)


@pytest.mark.parametrize("policy, match", [
    ({"routing": "predicted", "predictor": "somewhere"}, "the predictor names experts for the whole batch"),
    ({"prefetch": "hash", "predictor": "somewhere"}, "the predictor names experts for the whole batch"),
])
def test_micro_batches_refuse_predicted_routing(policy, match):
    with pytest.raises(PolicyError, match=match):
        OffloadPolicy(micro_batches=2, **policy).validate()


def test_cpu_compute_from_disk_is_refused_with_micro_batches(tiny_models):
    with pytest.raises(PolicyError, match="would read every expert once per micro-batch"):
        offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache=HOLDS_A_LAYER,
                  expert_compute="cpu", micro_batches=2)


def test_auto_leaves_micro_batches_off_and_explicit_counts_are_checked_per_budget():
    fp = Footprint(expert_bytes=64 << 10, slab_bytes=1 << 10, resident_bytes=0, top_k=2, layer_experts=(8,) * 8)
    assert resolve_micro_batches(OffloadPolicy(), fp, "cpu", 16 << 10, False) == 1
    assert resolve_micro_batches(OffloadPolicy(micro_batches=3), fp, "disk", 8 << 10, False) == 3
    with pytest.raises(PolicyError, match="holds 7 experts, a layer has up to 8.*expert_cache=8192"):
        resolve_micro_batches(OffloadPolicy(micro_batches=3), fp, "disk", 7 << 10, False)
    with pytest.raises(PolicyError, match="beside the resident layers.*expert_cache=16384"):
        resolve_micro_batches(OffloadPolicy(micro_batches=2, resident_layers=1), fp, "disk", 12 << 10, False)
    assert resolve_micro_batches(OffloadPolicy(micro_batches=2), fp, "cpu", 0, True) == 2


def test_the_default_policy_does_not_micro_batch_on_the_cpu(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache=HOLDS_A_LAYER)
    assert hf_moe_offload.get_engine(model).policy.micro_batches == 1
    assert all("forward" not in vars(layer) for layer in model.model.layers)


def test_two_threads_generating_with_micro_batches_get_their_own_tokens(tiny_models):
    """Held pins belong to the thread that holds them: two callers slicing their batches on one model at once get
    what each gets alone, and every pin is given back."""
    import threading

    model = offloaded("mixtral", tiny_models["mixtral"], **POLICY, micro_batches=2)
    prompts = [token_inputs(batch=3 + i, length=6, seed=10 + i, left_pad=True) for i in range(2)]
    expected = [_generate(model, ids, mask).sequences for ids, mask in prompts]
    results, errors = {}, []

    def run(i):
        try:
            for _ in range(2):
                results[i] = _generate(model, *prompts[i]).sequences
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(torch.equal(results[i], expected[i]) for i in range(2))
    assert hf_moe_offload.get_engine(model).cache.held == 0
    assert hf_moe_offload.stats(model)["repeat_reads"] == 0


def test_encoder_decoder_layers_run_whole_and_exact(tiny_models, caplog):
    """Switch Transformers' blocks take encoder states and an encoder-decoder cache this schedule does not split:
    every call runs whole, with the unpatched tokens."""
    path = tiny_models["switch_transformers"]
    ids, mask = token_inputs(batch=4, length=7, left_pad=True)
    want = reference("switch_transformers", path).generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                                            do_sample=False)
    model = offloaded("switch_transformers", path, device="cpu", store="disk", expert_cache="60%", micro_batches=2)
    with caplog.at_level(logging.WARNING, logger="hf_moe_offload"):
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False),
                           want)
    snap = hf_moe_offload.stats(model)
    assert snap["micro_batches"]["split"] == 0 and snap["micro_batches"]["whole"] > 0
    assert "runs its whole batch at once instead of 2 micro-batches" in caplog.text     # said once, not hidden


def test_a_base_model_call_recording_router_logits_runs_whole(tiny_models):
    path = tiny_models["mixtral"]
    ids, mask = token_inputs(batch=4, length=6)
    model = offloaded("mixtral", path, **POLICY, micro_batches=2)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)                       # an outer call that splits
        got = model.model(input_ids=ids, attention_mask=mask, output_router_logits=True)
        want = reference("mixtral", path).model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits)
    for a, b in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class RecordingStreams:
    """Stands in for `slice_streams.SliceStreams` on the CPU: records which slice ran inside its stream, and when
    the caller's stream joined them."""

    def __init__(self, events: list):
        self.events = events

    @contextlib.contextmanager
    def running(self, index):
        self.events.append(("enter", index, microbatch.current().index))
        yield
        self.events.append(("leave", index))

    def join(self):
        self.events.append(("join",))


def test_each_slice_runs_on_its_own_stream_and_the_layer_joins_them_before_releasing_the_experts(tiny_models,
                                                                                                 monkeypatch):
    """With CPU attention on CUDA each slice runs on a stream of its own (`slice_streams`); here the streams are
    stand-ins that record the order: every slice inside its own stream, the join after the last slice and before
    the held experts are released."""
    events: list = []
    calls = []

    def for_layer_call(model, hidden, count):
        calls.append(count)
        return RecordingStreams(events)
    monkeypatch.setattr(slice_streams, "for_layer_call", for_layer_call)
    ids, mask = token_inputs(batch=4, length=7, seed=3, left_pad=True)
    ref = _generate(reference("mixtral", tiny_models["mixtral"]), ids, mask)
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICY, micro_batches=2, attention="cpu")
    engine = hf_moe_offload.get_engine(model)
    release = engine.micro_batched.on_end
    engine.micro_batched.on_end = lambda: (events.append(("release",)), release())
    out = _generate(model, ids, mask)
    assert torch.equal(out.sequences, ref.sequences)
    assert calls and set(calls) == {2}
    one_call = [("enter", 0, 0), ("leave", 0), ("enter", 1, 1), ("leave", 1), ("join",), ("release",)]
    assert events == one_call * len(calls)
    assert engine.cache.held == 0


def test_slices_share_the_layer_stream_off_cuda_and_without_cpu_attention(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICY, micro_batches=2, attention="cpu")
    assert slice_streams.for_layer_call(model, torch.zeros(2, 3, 4), 2) is None        # a CPU batch
    k = torch.ones(2, 3)
    assert slice_streams.ready_marker(k) is None and slice_streams.consume(k) is k
