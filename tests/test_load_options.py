"""`from_pretrained` keywords that say which checkpoint to load (`subfolder`, `variant`) and in which dtype
(the config's `dtype`, as transformers' "auto" chooses it) apply to the offloaded experts as they apply to the rest
of the model: the offloaded model computes what transformers' own load of the same arguments computes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralForCausalLM

import hf_moe_offload
from hf_moe_offload.runtime.engine import get_engine
from conftest import build_tiny, token_inputs

POLICY = {"device": "cpu", "store": "disk", "expert_cache": "100%"}


def _logits(model) -> torch.Tensor:
    ids, mask = token_inputs(batch=2, length=8)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _assert_offloaded_as_transformers_loads(root, **where) -> None:
    """`where` (subfolder=, variant=) picks other weights than the root's default, and the offloaded load of `root`
    with it computes what transformers' own load with it computes."""
    want = _logits(AutoModelForCausalLM.from_pretrained(root, **where).eval())
    assert not torch.allclose(want, _logits(AutoModelForCausalLM.from_pretrained(root).eval()), atol=1e-3)
    model = AutoModelForCausalLM.from_pretrained(root, **where, offload_policy=POLICY).eval()
    assert get_engine(model) is not None
    torch.testing.assert_close(_logits(model), want, rtol=1e-4, atol=1e-5)


def test_a_subfolder_loads_the_experts_of_that_subfolder(tmp_path):
    """A repository holding one checkpoint at its root and another in `sub/`: `subfolder="sub"` gives the
    subfolder's model, experts included."""
    root = tmp_path / "two_checkpoints"
    build_tiny("mixtral", root, seed=0)
    build_tiny("mixtral", root / "sub", seed=1)
    _assert_offloaded_as_transformers_loads(root, subfolder="sub")


def test_a_variant_loads_the_experts_of_that_variant(tmp_path):
    """`model.safetensors` and `model.v2.safetensors` side by side: `variant="v2"` gives the v2 weights."""
    root = tmp_path / "variants"
    build_tiny("mixtral", root, seed=0)
    build_tiny("mixtral", root, seed=1, variant="v2")
    assert {"model.safetensors", "model.v2.safetensors"} <= set(os.listdir(root))
    _assert_offloaded_as_transformers_loads(root, variant="v2")


def test_use_safetensors_false_is_refused_where_a_bin_would_be_read_beside_the_experts(tmp_path):
    """A folder with both formats: transformers would load the .bin while the experts come from the safetensors
    files, two different sets of weights. Refused before anything loads."""
    root = build_tiny("mixtral", tmp_path / "both")
    model = AutoModelForCausalLM.from_pretrained(root)
    torch.save({k: v * 3 for k, v in model.state_dict().items()}, os.path.join(root, "pytorch_model.bin"))
    with pytest.raises(hf_moe_offload.PolicyError, match="use_safetensors=False cannot be combined"):
        AutoModelForCausalLM.from_pretrained(root, use_safetensors=False, offload_policy=POLICY)


def test_the_package_loader_finds_a_checkpoint_in_a_subfolder(tmp_path):
    """`hf_moe_offload.from_pretrained(root, policy, subfolder=...)` reads the config from the subfolder too."""
    root = tmp_path / "only_in_sub"
    build_tiny("mixtral", root / "sub", seed=1)
    model = hf_moe_offload.from_pretrained(root, {"device": "cpu", "store": "disk", "expert_cache": "50%"},
                                           subfolder="sub").eval()
    assert get_engine(model) is not None
    want = _logits(AutoModelForCausalLM.from_pretrained(root, subfolder="sub").eval())
    torch.testing.assert_close(_logits(model), want, rtol=1e-4, atol=1e-5)


def test_the_configs_dtype_sizes_the_cache_when_the_tensors_are_stored_in_another(tmp_path):
    """bfloat16 tensors under a config saying float32: transformers loads float32, so does the offloaded model,
    and expert_cache="50%" is half the experts at float32 (what the slots hold), not at bfloat16."""
    path = tmp_path / "bf16_tensors_fp32_config"
    build_tiny("mixtral", path, dtype=torch.bfloat16)
    config = json.loads((path / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config))

    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    assert reference.dtype == torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, offload_policy={"device": "cpu", "store": "disk",
                                                                       "expert_cache": "50%"}).eval()
    assert model.dtype == torch.float32
    experts = config["num_hidden_layers"] * config["num_local_experts"]
    slab_fp32 = 3 * config["hidden_size"] * config["intermediate_size"] * 4     # w1, w2, w3 in float32
    engine = get_engine(model)
    assert engine.cache.num_slots == experts // 2
    assert hf_moe_offload.stats(model)["cache_capacity_bytes"] == experts // 2 * slab_fp32
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_class", [None, MixtralForCausalLM], ids=["auto_class", "concrete_class"])
def test_a_policy_of_none_offloads_whatever_the_model_class(tiny_models, model_class):
    """`hf_moe_offload.from_pretrained(path, None)` is the default policy, with the Auto class or a concrete one."""
    model = hf_moe_offload.from_pretrained(tiny_models["mixtral"], None, model_class=model_class)
    assert isinstance(model, MixtralForCausalLM)
    assert get_engine(model) is not None
