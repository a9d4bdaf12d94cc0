"""What transformers' own test suites expect of any model, held by an offloaded one: its state_dict shows only the
weights that are really tied, the config the caller built it from is not changed (another model built from it
still works), and swapping the experts implementation while offloaded is refused clearly."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch
from transformers.modeling_utils import _get_tied_weight_keys
from transformers.pytorch_utils import id_tensor_storage

import hf_moe_offload
from conftest import CONFIGS, VOCAB, model_class

CPU = {"device": "cpu", "store": "cpu"}


def _build(family: str, config=None, seed: int = 0):
    """A tiny `family` model with decisive routing (as the saved tiny models have), from `config` if given."""
    torch.manual_seed(seed)
    model = model_class(family).from_config(config if config is not None else CONFIGS[family]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.classifier.weight")) and p.dim() == 2 and p.shape[0] <= 8:
                p.mul_(8.0)
    return model


def _generate(model, tokens: int = 6) -> torch.Tensor:
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    return model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)


def _storage_groups(model) -> list[list[str]]:
    """state_dict names that share storage, as transformers' `test_tied_weights_keys` finds them."""
    groups = defaultdict(list)
    for name, tensor in model.state_dict().items():
        groups[id_tensor_storage(tensor)].append(name)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)


def test_switch_offloaded_state_dict_ties_only_the_tied_weights():
    model = _build("switch_transformers")
    before = _storage_groups(model)
    hf_moe_offload.enable(model, CPU)
    assert _storage_groups(model) == before
    # transformers' check: once the declared tied keys are removed, no group of shared storage is left.
    untied = [[n for n in group if not any(re.search(key, n) for key in _get_tied_weight_keys(model))]
              for group in _storage_groups(model)]
    assert [group for group in untied if len(group) > 1] == []
    hf_moe_offload.disable(model)
    assert _storage_groups(model) == before


def test_enable_leaves_the_callers_config_alone_for_other_models_built_from_it():
    config = CONFIGS["mixtral"]()
    first, second = _build("mixtral", config, seed=0), _build("mixtral", config, seed=1)
    implementation = config._experts_implementation
    first_tokens, second_tokens = _generate(first), _generate(second)

    hf_moe_offload.enable(first, CPU)
    assert config._experts_implementation == implementation and first.config is config
    assert torch.equal(_generate(first), first_tokens)
    assert torch.equal(_generate(second), second_tokens)
    third = _build("mixtral", config, seed=2)                # built from the same config while `first` is offloaded
    assert hf_moe_offload.get_engine(third) is None and _generate(third).shape == first_tokens.shape

    hf_moe_offload.disable(first)
    assert config._experts_implementation == implementation
    assert not any(k.startswith("_hf_moe_offload") for m in first.modules() for k in vars(m))
    assert first.get_experts_implementation() == second.get_experts_implementation()
    assert torch.equal(_generate(first), first_tokens)


def test_from_pretrained_with_a_config_object_leaves_it_alone(tmp_path):
    _build("mixtral").save_pretrained(tmp_path)
    config = CONFIGS["mixtral"]()
    reference = model_class("mixtral").from_pretrained(tmp_path, config=config).eval()
    implementation = config._experts_implementation          # as transformers' own loading left it
    tokens = _generate(reference)
    model = model_class("mixtral").from_pretrained(tmp_path, config=config, offload_policy=CPU).eval()
    assert config._experts_implementation == implementation
    assert torch.equal(_generate(reference), tokens)
    assert torch.equal(_generate(model), tokens)


def test_swapping_the_experts_implementation_while_offloaded_is_refused_clearly():
    model = _build("mixtral")
    tokens = _generate(model)
    own = model.config._experts_implementation
    hf_moe_offload.enable(model, CPU)
    assert set(model.get_experts_implementation().values()) == {"hf_moe_offload"}
    for request in ("eager", {"": "batched_mm"}):
        with pytest.raises(hf_moe_offload.PolicyError, match=r"set_experts_implementation.*disable\(model\) first"):
            model.set_experts_implementation(request)
    model.set_experts_implementation(model.get_experts_implementation())     # a snapshot put back: a no-op
    assert model.config._experts_implementation == own
    assert torch.equal(_generate(model), tokens)                              # still offloaded, unchanged

    hf_moe_offload.disable(model)
    assert model.get_experts_implementation() == {"": own}
    model.set_experts_implementation("eager")
    assert torch.equal(_generate(model), tokens)
