"""Offloaded models give the same logits (to dtype tolerance) and the same greedy tokens as the unpatched model."""

from __future__ import annotations

import pytest
import torch

import hf_moe_offload
from conftest import CAUSAL_FAMILIES, FAMILIES, forward_logits, offloaded, reference, token_inputs

POLICIES = {
    "cpu-store": {"device": "cpu", "store": "cpu"},
    "disk-store-small-cache": {"device": "cpu", "store": "disk", "expert_cache": "34%"},
    "disk-store-lfu": {"device": "cpu", "store": "disk", "expert_cache": "34%", "eviction": "lfu"},
}


_inputs = token_inputs


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_unpatched(tiny_models, family, policy):
    ids, mask = _inputs(2, 10)
    ref = forward_logits(reference(family, tiny_models[family]), family, ids, mask)
    out = forward_logits(offloaded(family, tiny_models[family], **POLICIES[policy]), family, ids, mask)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch,left_pad", [(1, False), (3, True)])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_identical(tiny_models, family, batch, left_pad):
    ids, mask = _inputs(batch, 8, seed=2, left_pad=left_pad)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = reference(family, tiny_models[family]).generate(ids, **kwargs)
    model = offloaded(family, tiny_models[family], **POLICIES["disk-store-small-cache"])
    assert torch.equal(model.generate(ids, **kwargs), expected)
    assert hf_moe_offload.stats(model)["misses"] > 0   # the experts really came through the cache


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_greedy_tokens_identical_with_kv_cache_kinds(tiny_models, family, cache_implementation):
    ids, mask = _inputs(3, 8, seed=3, left_pad=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                  cache_implementation=cache_implementation)
    expected = reference(family, tiny_models[family]).generate(ids, **kwargs)
    model = offloaded(family, tiny_models[family], **POLICIES["cpu-store"])
    assert torch.equal(model.generate(ids, **kwargs), expected)


def test_bfloat16_checkpoint_matches_to_dtype_tolerance(tmp_path):
    from conftest import build_tiny

    path = build_tiny("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    ids, mask = _inputs(2, 10)
    ref = forward_logits(reference("mixtral", path), "mixtral", ids, mask)
    model = offloaded("mixtral", path, device="cpu", store="disk", expert_cache="34%")
    assert next(model.parameters()).dtype == torch.bfloat16
    out = forward_logits(model, "mixtral", ids, mask)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_fused_checkpoint_layout_is_read_per_expert(tmp_path):
    """Checkpoints saved with fused keys (save_original_format=False) are sliced per expert with no full read."""
    from conftest import build_tiny

    path = build_tiny("qwen3_moe", tmp_path / "fused", save_original_format=False)
    ids, mask = _inputs(2, 10)
    ref = forward_logits(reference("qwen3_moe", path), "qwen3_moe", ids, mask)
    model = offloaded("qwen3_moe", path, device="cpu", store="disk", expert_cache="34%")
    out = forward_logits(model, "qwen3_moe", ids, mask)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_module_level_from_pretrained(tiny_models):
    ids, mask = _inputs(1, 8)
    for family in ("mixtral", "switch_transformers"):
        model = hf_moe_offload.from_pretrained(tiny_models[family], {"device": "cpu", "store": "disk",
                                                                      "expert_cache": "50%"})
        ref = reference(family, tiny_models[family])
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_switch_in_train_mode_drops_out_inside_its_experts_as_the_unpatched_model(tiny_models):
    """`model.train()` under no_grad (Monte-Carlo dropout): each expert's own dropout runs between its two
    projections, drawing what the unpatched model draws from the same seed (a host store computes the experts in
    expert order, as the unpatched loop does)."""
    path = tiny_models["switch_transformers"]
    ids, _ = token_inputs(batch=2, length=9)
    outputs = []
    for model in (reference("switch_transformers", path), offloaded("switch_transformers", path, device="cpu",
                                                                     store="cpu")):
        model.train()
        torch.manual_seed(0)
        with torch.no_grad():
            outputs.append(model(ids, decoder_input_ids=ids[:, :4]).logits)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
