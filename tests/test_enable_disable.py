"""`enable` offloads a model that is already built; `disable` restores it bit-identically; without the keyword
transformers behaves as if the package were not imported."""

from __future__ import annotations

import pytest
import torch

import hf_moe_offload
from conftest import FAMILIES, VOCAB, model_class, reference


def _forward(model, family, ids):
    with torch.no_grad():
        if family == "switch_transformers":
            return model(input_ids=ids, decoder_input_ids=ids[:, :4]).logits
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_enable_then_disable_restores_bit_identical_outputs(tiny_models, family):
    model = reference(family, tiny_models[family])
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    before = _forward(model, family, ids)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}

    hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
    engine = hf_moe_offload.get_engine(model)
    assert not any(True for layer in engine.layers for _ in layer.module.parameters())   # no expert memory left
    torch.testing.assert_close(_forward(model, family, ids), before, rtol=1e-4, atol=1e-5)

    hf_moe_offload.disable(model)
    assert hf_moe_offload.get_engine(model) is None
    assert torch.equal(_forward(model, family, ids), before)
    state_after = model.state_dict()
    assert state_after.keys() == state_before.keys()
    assert all(torch.equal(state_after[k], v) for k, v in state_before.items())


@pytest.mark.parametrize("family", ["mixtral", "switch_transformers"])
def test_an_offloaded_model_can_be_moved_to_its_device_and_cast(tiny_models, family):
    """lm-eval and user scripts call model.to(device) / .float() on whatever model they get."""
    model = reference(family, tiny_models[family])
    ids = torch.randint(3, VOCAB, (1, 6))
    before = _forward(model, family, ids)
    hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
    assert model.to("cpu") is model and model.float() is model
    torch.testing.assert_close(_forward(model, family, ids), before, rtol=1e-4, atol=1e-5)


def test_enable_with_disk_store_reads_the_models_checkpoint(tiny_models):
    model = reference("mixtral", tiny_models["mixtral"])
    ids = torch.randint(3, VOCAB, (1, 7))
    before = _forward(model, "mixtral", ids)
    hf_moe_offload.enable(model, {"device": "cpu", "store": "disk", "expert_cache": "34%"})
    torch.testing.assert_close(_forward(model, "mixtral", ids), before, rtol=1e-4, atol=1e-5)
    assert hf_moe_offload.stats(model)["misses"] > 0
    hf_moe_offload.disable(model)
    assert torch.equal(_forward(model, "mixtral", ids), before)


def test_enable_twice_and_disable_without_enable_are_refused(tiny_models):
    model = reference("mixtral", tiny_models["mixtral"])
    with pytest.raises(hf_moe_offload.PolicyError, match="not offloaded"):
        hf_moe_offload.disable(model)
    hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
    with pytest.raises(hf_moe_offload.PolicyError, match="already offloaded"):
        hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})


def test_without_the_keyword_transformers_is_untouched(tiny_models):
    for family in FAMILIES:
        model = model_class(family).from_pretrained(tiny_models[family])
        assert hf_moe_offload.get_engine(model) is None
        assert model.config._experts_implementation != "hf_moe_offload"
        assert not any(p.device.type == "meta" for p in model.parameters())


def test_an_offloaded_model_still_lists_its_moe_layers(tiny_models):
    from hf_moe_offload.arch import get_arch

    model = reference("switch_transformers", tiny_models["switch_transformers"])
    names = [layer.name for layer in get_arch(model.config).find_layers(model)]
    hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
    assert [layer.name for layer in get_arch(model.config).find_layers(model)] == names


@pytest.mark.parametrize("family", FAMILIES)
def test_an_offloaded_model_counts_its_experts_among_its_parameters(tiny_models, family):
    """`num_parameters()` (what lm-eval reports) is the model's, though the experts are no module parameters."""
    ref = reference(family, tiny_models[family])
    model = model_class(family).from_pretrained(tiny_models[family], offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": "50%"})
    assert model.num_parameters() == ref.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == ref.num_parameters(exclude_embeddings=True)
    hf_moe_offload.disable(model)
    assert model.num_parameters() == ref.num_parameters() and "num_parameters" not in vars(model)
