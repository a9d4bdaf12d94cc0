"""A layer whose routed experts have all landed in the cache runs as one grouped computation over the cache's slots
(transformers' grouped_mm with slot ids for expert ids). It is taken on CUDA in bfloat16; here the CPU stands in
(its grouped_mm runs the same math), so the path's exactness, fallback and pin accounting are checked everywhere."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_moe_offload
from conftest import token_inputs
from hf_moe_offload.arch import grouped


@pytest.fixture
def grouped_on_cpu(monkeypatch):
    """Let the CPU take the grouped path, and count the layers that took it."""
    monkeypatch.setattr(grouped, "GROUPED_DEVICE_TYPES", ("cuda", "cpu"))
    calls = []
    original = grouped.grouped_mm_experts_forward

    def counted(*args, **kwargs):
        calls.append(args[0].num_experts)
        return original(*args, **kwargs)
    monkeypatch.setattr(grouped, "grouped_mm_experts_forward", counted)
    return calls


def _generate(model, ids, mask, tokens=8):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, pad_token_id=0)


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


# 100%: every layer grouped once its experts landed; 50% at batch 1: grouped and per-expert layers mixed.
@pytest.mark.parametrize("cache, batch", [("100%", 3), ("50%", 1)])
def test_grouped_layers_give_the_resident_grouped_mm_tokens_and_logits(tiny_models, grouped_on_cpu, cache, batch):
    path = tiny_models["mixtral"]
    ids, mask = token_inputs(batch, 8, seed=4, left_pad=True)
    resident = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                    experts_implementation="grouped_mm").eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": cache}).eval()
    expected = _generate(resident, ids, mask, tokens=16)
    assert torch.equal(_generate(model, ids, mask, tokens=16), expected)     # cold first: loads through the per-expert loop
    assert grouped_on_cpu, "no layer took the grouped path"
    engine = hf_moe_offload.get_engine(model)
    assert set(grouped_on_cpu) == {engine.cache.num_slots}         # every slot seen as an expert
    torch.testing.assert_close(_logits(model, ids, mask), _logits(resident, ids, mask), rtol=0, atol=2e-2)
    assert not any(slot.pins for slot in engine.cache.table.slots if not slot.permanent)   # pins dropped
    snap = hf_moe_offload.stats(model)
    assert snap["hits"] > 0 and snap["peak_cache_bytes"] <= engine.cache.num_slots * engine.cache.slot_bytes


def test_a_layer_with_an_expert_to_load_takes_the_per_expert_loop(tiny_models, grouped_on_cpu):
    path = tiny_models["mixtral"]
    ids, mask = token_inputs(2, 6, seed=5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": "100%"}).eval()
    _logits(model, ids, mask)                                      # an empty cache: nothing has landed
    assert grouped_on_cpu == []
    before = hf_moe_offload.stats(model)
    _logits(model, ids, mask)                                      # the same routes, all landed now
    assert len(grouped_on_cpu) == 2                                # both MoE layers, grouped
    after = hf_moe_offload.stats(model)                            # counted once per layer, as by the loop
    assert after["forward_calls"] == before["forward_calls"] + 1
    assert after["hits"] - before["hits"] == before["experts_used"] and after["misses"] == before["misses"]


def test_float32_and_the_cpu_keep_the_per_expert_loop(tiny_models, monkeypatch):
    calls = []
    monkeypatch.setattr(grouped, "grouped_mm_experts_forward", lambda *a, **k: calls.append(a))
    path = tiny_models["mixtral"]
    ids, mask = token_inputs(2, 6, seed=5)
    model = AutoModelForCausalLM.from_pretrained(path, offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": "100%"}).eval()
    _logits(model, ids, mask)
    _logits(model, ids, mask)
    assert calls == []
