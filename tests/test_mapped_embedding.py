"""The input embedding table mapped from the checkpoint's file (policy `embedding`): the same logits as with the
table in memory and the unpatched model's tokens, its memory given to the expert cache under "auto", the table back
in memory after `disable()`, and a clear refusal wherever it cannot be mapped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CONFIGS, file_backed, forward_logits, model_class, offloaded, reference, token_inputs

import hf_moe_offload
from hf_moe_offload import PolicyError
from hf_moe_offload.planning import footprint as footprint_module
from hf_moe_offload.planning import resolve as resolve_module
from hf_moe_offload.planning.footprint import Footprint
from hf_moe_offload.planning.planner import ModelShape

DISK = dict(device="cpu", store="disk")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_mapped_table_gives_the_unpatched_tokens_and_logits(tiny_models, family):
    path = tiny_models[family]
    ref = reference(family, path)
    model = offloaded(family, path, **DISK, expert_cache="50%", embedding="mapped")
    assert file_backed(model.get_input_embeddings().weight)
    assert hf_moe_offload.stats(model)["embedding"] == "mapped"
    in_memory = offloaded(family, path, **DISK, expert_cache="50%", embedding="memory")
    ids, mask = token_inputs(2, 7)
    logits = forward_logits(model, family, ids, mask)
    assert torch.equal(logits, forward_logits(in_memory, family, ids, mask))      # the same bytes: the same bits
    torch.testing.assert_close(logits, forward_logits(ref, family, ids, mask), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        expected = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


def test_auto_maps_on_the_cpu_and_gives_the_table_to_the_cache(tiny_models, monkeypatch):
    """With host memory scarce, "auto" sizes the cache from what is left: a mapped table leaves more of it."""
    path = tiny_models["mixtral"]
    scarce = 800 * 1024                 # bytes the host has left: the cache gets some experts, not all
    for module in (footprint_module, resolve_module):
        monkeypatch.setattr(module, "available_host_bytes", lambda: scarce)
    in_memory = offloaded("mixtral", path, **DISK, embedding="memory")
    mapped = offloaded("mixtral", path, **DISK)                              # embedding="auto"
    assert hf_moe_offload.stats(in_memory)["embedding"] == "memory"
    assert hf_moe_offload.stats(mapped)["embedding"] == "mapped"
    table = mapped.get_input_embeddings().weight
    table_bytes = table.numel() * table.element_size()
    cache = {name: hf_moe_offload.get_engine(m).policy.expert_cache for name, m in (("memory", in_memory),
                                                                                   ("mapped", mapped))}
    assert cache["mapped"] - cache["memory"] == table_bytes, (cache, table_bytes)


def test_disable_reads_the_table_into_memory(tiny_models):
    path = tiny_models["mixtral"]
    model = offloaded("mixtral", path, **DISK, embedding="mapped")
    mapped = model.get_input_embeddings().weight.detach().clone()
    hf_moe_offload.disable(model)
    weight = model.get_input_embeddings().weight
    assert not file_backed(weight) and torch.equal(weight, mapped)
    assert torch.equal(weight, reference("mixtral", path).get_input_embeddings().weight)


def test_disable_under_inference_mode_gives_back_a_trainable_table(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], **DISK, embedding="mapped")
    with torch.inference_mode():
        hf_moe_offload.disable(model)
    weight = model.get_input_embeddings().weight
    assert not weight.is_inference()
    with torch.no_grad():
        weight.mul_(1.0)                     # an in-place update, as an optimizer makes


def test_mapped_is_refused_where_the_table_cannot_be_mapped(tiny_models, tmp_path):
    path = tiny_models["mixtral"]
    with pytest.raises(PolicyError, match=r"embedding='mapped' is not possible here: the checkpoint stores it as "
                                          r"torch.float32 .* the model needs torch.bfloat16"):
        model_class("mixtral").from_pretrained(path, dtype=torch.bfloat16,
                                               offload_policy={**DISK, "embedding": "mapped"})
    with pytest.raises(PolicyError, match=r"a device_map places the model's modules"):
        model_class("mixtral").from_pretrained(path, device_map={"": "cpu"},
                                               offload_policy={**DISK, "embedding": "mapped"})
    # A table tied to the output layer is read whole every token: "auto" keeps it in memory, "mapped" says why.
    config = CONFIGS["mixtral"]()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model_class("mixtral").from_config(config).save_pretrained(tmp_path / "tied")
    tied = str(tmp_path / "tied")
    with pytest.raises(PolicyError, match=r"the table is shared: model.embed_tokens.weight, lm_head.weight"):
        offloaded("mixtral", tied, **DISK, embedding="mapped")
    assert hf_moe_offload.stats(offloaded("mixtral", tied, **DISK))["embedding"] == "memory"
    loaded = reference("mixtral", path)
    with pytest.raises(PolicyError, match=r"enable\(\) works on a model already loaded"):
        hf_moe_offload.enable(loaded, {**DISK, "embedding": "mapped"})


def test_the_planner_still_counts_a_mapped_table_as_weights_a_step_computes_with():
    """Memory holds less once the table is mapped; the planner's compute per layer is unchanged."""
    config = CONFIGS["mixtral"]()
    table = config.vocab_size * config.hidden_size * 4
    loaded = Footprint(expert_bytes=1 << 20, slab_bytes=18432, resident_bytes=200_000, top_k=2, layer_experts=(6, 6))
    mapped = dataclasses.replace(loaded, resident_bytes=loaded.resident_bytes - table, mapped_bytes=table)
    shapes = [ModelShape.from_footprint(fp, config, torch.float32) for fp in (loaded, mapped)]
    assert shapes[0].dense_params_per_layer == shapes[1].dense_params_per_layer > 0
    assert shapes[1].resident_bytes == shapes[0].resident_bytes - table
