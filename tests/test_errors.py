"""Bad input gets a clear error naming what is wrong and what is allowed, raised before anything is allocated or
changed."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
import transformers.modeling_utils as modeling_utils

import hf_moe_offload
from hf_moe_offload import CheckpointError, OffloadPolicy, PolicyError, UnsupportedModelError
from conftest import offloaded


@pytest.mark.parametrize("policy,match", [
    ({"devcie": "cpu"}, r"unknown offload_policy key\(s\) \['devcie'\]; allowed keys: \['device', 'store'"),
    ("fastest", r"unknown offload_policy preset 'fastest'; allowed presets: \['auto', 'low-ram'\]"),
    ({"store": "nvme"}, r"store='nvme' is not allowed; allowed: \['auto', 'cpu', 'disk'\]"),
    ({"eviction": "fifo"}, r"eviction='fifo' is not allowed; allowed: \['lru', 'lfu', 'layer', 'lookahead'\]"),
    ({"expert_cache": "lots"}, r"expert_cache='lots' is not a size; allowed: .*'512MiB'"),
    ({"device": "cuda:7"}, r"device='cuda:7' does not exist on this machine"),
    ({"device": "tpu"}, r"device='tpu' is not a device|not supported"),
    (42, r"offload_policy must be an OffloadPolicy, a dict or a preset name"),
])
def test_bad_policy_is_refused_with_allowed_values(tiny_models, policy, match):
    with pytest.raises(PolicyError, match=match):
        offloaded_any(tiny_models["mixtral"], policy)


def offloaded_any(path, policy):
    return AutoModelForCausalLM.from_pretrained(path, offload_policy=policy)


def test_sizes_are_parsed():
    from hf_moe_offload.policy.offload_policy import parse_size
    assert parse_size("512MiB", 0) == 512 * 2**20
    assert parse_size("1.5GB", 0) == 1_500_000_000
    assert parse_size("25%", 400) == 100
    assert parse_size(1234, 0) == 1234
    assert OffloadPolicy.from_any("low-ram").store == "disk"


def test_cache_smaller_than_topk_working_set_names_the_minimum(tiny_models):
    path = tiny_models["mixtral"]
    # one expert = (2*48*32 + 32*48) float32 = 18432 bytes; top-2 working set = 36864 bytes
    with pytest.raises(PolicyError, match=r"smaller than one layer's top-k working set: top_k=2 .*"
                                          r"use at least expert_cache=36864"):
        offloaded("mixtral", path, device="cpu", store="disk", expert_cache=30000)


def test_unsupported_architecture_names_the_closest_supported(tmp_path):
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "llama")
    with pytest.raises(UnsupportedModelError, match=r"model type 'llama' is not supported.*closest supported model "
                                                    r"types: \['llama4'.*docs/models.md"):
        offloaded_any(tmp_path / "llama", "auto")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    with pytest.raises(UnsupportedModelError, match="supported model types"):
        hf_moe_offload.enable(model, "auto")
    assert hf_moe_offload.get_engine(model) is None


def _copy(src, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _shards(path) -> list[str]:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def test_missing_shard_is_named(tiny_models, tmp_path):
    path = _copy(tiny_models["mixtral"], tmp_path / "m")
    victim = _shards(path)[-1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(CheckpointError, match=f"missing: {victim}"):
        offloaded_any(path, {"device": "cpu", "store": "disk", "expert_cache": "50%"})


def test_truncated_shard_is_named(tiny_models, tmp_path):
    path = _copy(tiny_models["mixtral"], tmp_path / "m")
    victim = os.path.join(path, _shards(path)[-1])
    os.truncate(victim, os.path.getsize(victim) - 100)
    with pytest.raises(CheckpointError, match=f"{victim} is truncated"):
        offloaded_any(path, {"device": "cpu", "store": "disk", "expert_cache": "50%"})


def test_offload_folder_conflicts_with_policy(tiny_models, tmp_path):
    # device_map= / max_memory= compose with the policy now (tests/test_device_map.py); a non-expert disk offload
    # folder does not.
    with pytest.raises(PolicyError, match="offload_folder= cannot be combined with offload_policy"):
        AutoModelForCausalLM.from_pretrained(tiny_models["mixtral"], offload_policy="auto", device_map="cpu",
                                             offload_folder=str(tmp_path))


def test_a_failed_load_leaves_nothing_patched(tiny_models, tmp_path):
    import transformers.core_model_loading as core_model_loading

    originals = (modeling_utils.accelerate_dispatch, core_model_loading._materialize_copy)
    path = _copy(tiny_models["mixtral"], tmp_path / "m")
    os.remove(os.path.join(path, _shards(path)[0]))
    with pytest.raises(CheckpointError):
        offloaded_any(path, "auto")
    assert (modeling_utils.accelerate_dispatch, core_model_loading._materialize_copy) == originals
    offloaded_any(tiny_models["mixtral"], {"device": "cpu", "store": "disk", "expert_cache": "50%"})
    assert (modeling_utils.accelerate_dispatch, core_model_loading._materialize_copy) == originals
    # and a plain load of a good checkpoint still works exactly as without the package
    model = AutoModelForCausalLM.from_pretrained(tiny_models["mixtral"])
    assert hf_moe_offload.get_engine(model) is None
    assert not any(p.device.type == "meta" for p in model.parameters())


def test_experts_tensor_missing_from_checkpoint_is_reported(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file
    path = _copy(tiny_models["mixtral"], tmp_path / "m")
    for shard in _shards(path):
        f = os.path.join(path, shard)
        tensors = load_file(f)
        kept = {k: v for k, v in tensors.items() if "experts.3." not in k}
        if len(kept) != len(tensors):
            save_file(kept, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="expert 3 of model.layers.0.mlp.experts"):
        offloaded_any(path, {"device": "cpu", "store": "disk", "expert_cache": "50%"})


def test_one_tensor_missing_of_an_expert_names_the_ones_there(tiny_models, tmp_path):
    """The error lists every key prefix it looked under and the expert's tensors that are there."""
    from safetensors.torch import load_file, save_file
    path = _copy(tiny_models["mixtral"], tmp_path / "m")
    for shard in _shards(path):
        f = os.path.join(path, shard)
        tensors = load_file(f)
        kept = {k: v for k, v in tensors.items() if not k.endswith("experts.3.w1.weight")}
        if len(kept) != len(tensors):
            save_file(kept, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"looked under .*block_sparse_moe\.experts.*it has only "
                                              r"\['model\.layers\.0\.block_sparse_moe\.experts\.3\.w2\.weight'"):
        offloaded_any(path, {"device": "cpu", "store": "disk", "expert_cache": "50%"})
