"""Refusals that help: a supported family loaded as remote code is told to use transformers' class, an unsupported
model type gets the closest supported ones and where all are listed, not a list of every name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel

import hf_moe_offload
from hf_moe_offload import UnsupportedModelError
from hf_moe_offload.arch import get_arch
from conftest import CONFIGS, model_class

CPU = {"device": "cpu", "store": "cpu"}


class RemoteMixtralForCausalLM(PreTrainedModel):
    """What a Hub repository's own modeling file may hold for model type "mixtral": experts as a ModuleList."""

    config_class = type(CONFIGS["mixtral"]())

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.experts = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size, bias=False)
                                     for _ in range(config.num_local_experts))
        self.post_init()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.experts[0](self.embed_tokens(input_ids))


# As transformers imports a repository's code with trust_remote_code=True.
RemoteMixtralForCausalLM.__module__ = "transformers_modules.someone.remote_mixtral.modeling_mixtral"


def test_a_supported_family_as_remote_code_is_told_to_use_transformers_class():
    model = RemoteMixtralForCausalLM(CONFIGS["mixtral"]())
    with pytest.raises(UnsupportedModelError) as refused:
        hf_moe_offload.enable(model, CPU)
    message = str(refused.value)
    assert "remote code" in message and "without trust_remote_code=True" in message
    assert "'mixtral'" in message and "transformers_modules.someone" in message
    assert "closest supported" not in message             # the user's own type is supported: no list to pick from
    assert hf_moe_offload.get_engine(model) is None


def test_an_unsupported_model_type_names_the_closest_supported_ones_and_the_list():
    with pytest.raises(UnsupportedModelError) as refused:
        get_arch(AutoConfig.for_model("mistral"))
    message = str(refused.value)
    assert "closest supported model types: ['mixtral']" in message
    assert "docs/models.md" in message and "supported_model_types()" in message
    assert "'qwen2_moe'" not in message and len(message) < 400     # not every supported name
    with pytest.raises(UnsupportedModelError, match=r"no supported model type is close to 'gpt2'.*docs/models.md"):
        get_arch(AutoConfig.for_model("gpt2"))
    assert "mixtral" in hf_moe_offload.supported_model_types()


def test_a_built_model_without_moe_layers_is_refused_with_the_closest_types():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(UnsupportedModelError, match=r"'llama'.*closest supported model types: \['llama4"):
        hf_moe_offload.enable(model, CPU)


def test_a_supported_type_whose_experts_were_replaced_says_so():
    model = model_class("mixtral").from_config(CONFIGS["mixtral"]())
    for layer in model.model.layers:
        layer.mlp.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
    with pytest.raises(UnsupportedModelError, match=r"model type 'mixtral' is supported, but none of this model's"):
        hf_moe_offload.enable(model, CPU)
