"""MXFP4 GPT-OSS checkpoints (openai/gpt-oss-20b, -120b layout: `experts.gate_up_proj_blocks`/`_scales`,
`down_proj_blocks`/`_scales`, dense biases, quantization_config quant_method "mxfp4"): each expert's codes and
exponents are read per expert and dequantized into the dense slab as transformers' `Mxfp4Config(dequantize=True)`
load does (same bits), the rest is loaded by transformers dequantized. A missing or misshapen exponent tensor is
named before loading; MXFP4 on other families and int8/int4 on GPT-OSS stay refused.

The reference is transformers' own dequantized MXFP4 load, which runs on a CPU-only machine."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import hf_moe_offload
from conftest import VOCAB, build_tiny, token_inputs
from hf_moe_offload.storage.checkpoint import CheckpointError, dequantize_mxfp4
from hf_moe_offload.policy.offload_policy import PolicyError
from hf_moe_offload.storage.store import dense_expert

GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
# The published checkpoints keep these dense (their config's modules_to_not_convert).
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
LAYER1 = "model.layers.1.mlp.experts"


def _config() -> GptOssConfig:
    # intermediate_size and hidden_size are multiples of 32: MXFP4 blocks run along the input dimension.
    return GptOssConfig(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=2,
                        max_position_embeddings=128, sliding_window=64, swiglu_limit=0.3,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def write_mxfp4_checkpoint(path, seed: int = 0) -> str:
    """A tiny random GPT-OSS in the Hub's MXFP4 layout, one shard per layer: random FP4 codes and exponents in
    127-7..127 (weights up to 6, down to 2^-7 x 0.5), random expert biases, decisive routers."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(8.0)                   # random near-ties would make greedy tokens fragile
            elif ".experts." in name and name.endswith("_bias"):
                p.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(seed + 1)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in model.state_dict().items():
        shard = "model-00002-of-00002.safetensors" if ".layers.1." in key else "model-00001-of-00002.safetensors"
        out = shards.setdefault(shard, {})
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, k, n = tensor.shape                       # [E, in, out]: stored [E, out, in/32, 16]
            out[key + "_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8, generator=g)
            out[key + "_scales"] = torch.randint(120, 128, (experts, n, k // 32), dtype=torch.uint8, generator=g)
        else:
            out[key] = tensor.contiguous()
    os.makedirs(path, exist_ok=True)
    model.config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    model.config.save_pretrained(path)
    for shard, tensors in shards.items():
        save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
    weight_map = {key: shard for shard, tensors in shards.items() for key in tensors}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(path)


def _outputs(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **GEN), model(ids, attention_mask=mask).logits


def _offloaded(path, **policy):
    return AutoModelForCausalLM.from_pretrained(path, offload_policy={"device": "cpu", **policy}).eval()


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(checkpoint path, transformers' Mxfp4Config(dequantize=True) load of it, its greedy tokens and logits)."""
    path = write_mxfp4_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    reference = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True)).eval()
    ids, mask = token_inputs(2, 6, left_pad=True)
    return path, reference, *_outputs(reference, ids, mask)


def _shard(path, key: str) -> str:
    weight_map = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    return os.path.join(path, weight_map[key])


def _edit(path, key: str, edit) -> None:
    """Rewrite the shard holding `key` with `edit(tensors)` applied."""
    file = _shard(path, key)
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_the_reference_is_transformers_dequantization(mxfp4):
    path, reference, *_ = mxfp4
    tensors = load_file(_shard(path, f"{LAYER1}.down_proj_blocks"))
    want = convert_moe_packed_tensors(tensors[f"{LAYER1}.down_proj_blocks"], tensors[f"{LAYER1}.down_proj_scales"],
                                      dtype=torch.float32)
    assert torch.equal(reference.model.layers[1].mlp.experts.down_proj, want)
    assert 0.5 <= want.abs().max() <= 6.0                # exponents in a plausible range, not all zeros


@pytest.mark.parametrize("store", ["disk", "cpu"])
def test_every_expert_slab_is_bit_identical_to_transformers_dequantized_load(mxfp4, store):
    path, reference, *_ = mxfp4
    model = _offloaded(path, store=store, expert_cache="34%" if store == "disk" else "100%")
    engine = hf_moe_offload.get_engine(model)
    for layer in engine.layers:
        experts = reference.get_submodule(layer.name)
        for e in range(layer.num_experts):
            slab = dense_expert(engine.store, layer.index, e)
            for part, param in (("gate_up", "gate_up_proj"), ("gate_up_bias", "gate_up_proj_bias"),
                                ("down", "down_proj"), ("down_bias", "down_proj_bias")):
                assert torch.equal(slab[part], getattr(experts, param)[e]), (layer.name, e, part)


def test_offloaded_to_disk_with_a_third_cached_gives_the_same_tokens(mxfp4):
    path, _, want, want_logits = mxfp4
    model = _offloaded(path, store="disk", expert_cache="34%")
    got, got_logits = _outputs(model, *token_inputs(2, 6, left_pad=True))
    assert torch.equal(got, want)
    # The offloaded forward sums each token's k experts in another order than grouped_mm (test_adapters.py).
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-5)
    stats = hf_moe_offload.stats(model)
    assert stats["misses"] > 0 and stats["evictions"] > 0


def test_in_host_memory_gives_the_same_tokens(mxfp4):
    path, _, want, want_logits = mxfp4
    got, got_logits = _outputs(_offloaded(path, store="cpu"), *token_inputs(2, 6, left_pad=True))
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-5)


def test_dequantize_mxfp4_is_transformers_arithmetic_in_bfloat16():
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (4, 40, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (4, 40, 3), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)      # [4, 96, 40]
    out = torch.empty(96, 40, dtype=torch.bfloat16)
    dequantize_mxfp4(blocks[2], scales[2], out)
    assert torch.equal(out, want[2])


@pytest.mark.parametrize("damage,message", [
    (lambda t: t.pop(f"{LAYER1}.down_proj_scales"),
     f"no {LAYER1}.down_proj_scales: the MXFP4 codes {LAYER1}.down_proj_blocks .* uint8 tensor of shape \\[6, 32, 2\\]"),
    (lambda t: t.__setitem__(f"{LAYER1}.down_proj_scales", t[f"{LAYER1}.down_proj_scales"].float()),
     f"{LAYER1}.down_proj_scales in .* is torch.float32 \\[6, 32, 2\\].*one E8M0 exponent per block.*uint8"),
    (lambda t: t.__setitem__(f"{LAYER1}.gate_up_proj_scales", t[f"{LAYER1}.gate_up_proj_scales"][:, :64].clone()),
     f"{LAYER1}.gate_up_proj_scales in .* is torch.uint8 \\[6, 64, 1\\].*codes {LAYER1}.gate_up_proj_blocks "
     f"\\[6, 128, 1, 16\\].*uint8 \\[6, 128, 1\\]"),
])
def test_missing_or_misshapen_exponents_are_named_before_loading(tmp_path, damage, message):
    path = write_mxfp4_checkpoint(tmp_path / "m")
    _edit(path, f"{LAYER1}.down_proj_blocks", damage)
    with pytest.raises(CheckpointError, match=message):
        _offloaded(path, store="disk", expert_cache="34%")


def test_nan_exponent_is_named_when_read(tmp_path):
    path = write_mxfp4_checkpoint(tmp_path / "m")
    _edit(path, f"{LAYER1}.down_proj_blocks",
          lambda t: t[f"{LAYER1}.down_proj_scales"].__setitem__((4, 0, 0), 255))
    with pytest.raises(CheckpointError, match=f"{LAYER1}.down_proj_scales in .*exponent 255"):
        _offloaded(path, store="cpu")                          # the CPU store reads every expert at load


def test_int8_experts_stay_refused_for_gpt_oss(mxfp4, tmp_path):
    with pytest.raises(PolicyError, match="quantize='int8'/'int4' is not available for GPT-OSS"):
        AutoModelForCausalLM.from_pretrained(mxfp4[0], offload_folder=str(tmp_path / "q"),
                                             offload_policy={"device": "cpu", "store": "disk", "quantize": "int8"})
    assert not (tmp_path / "q").exists()


def test_mxfp4_on_another_family_stays_refused(tmp_path):
    path = build_tiny("mixtral", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(PolicyError, match="quant_method='mxfp4' on model type 'mixtral'.*GPT-OSS only"):
        _offloaded(path, store="disk", expert_cache="50%")


def test_bfloat16_load_gives_transformers_bfloat16_experts(mxfp4):
    """The published checkpoints load in bfloat16: the table lookup and ldexp run in the model dtype."""
    path = mxfp4[0]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     quantization_config=Mxfp4Config(dequantize=True))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 offload_policy={"device": "cpu", "store": "disk"})
    engine = hf_moe_offload.get_engine(model)
    layer = engine.layers[1]
    slab = dense_expert(engine.store, layer.index, 5)
    assert slab["gate_up"].dtype == torch.bfloat16
    assert torch.equal(slab["gate_up"], reference.get_submodule(layer.name).gate_up_proj[5])
    assert torch.equal(slab["down"], reference.get_submodule(layer.name).down_proj[5])


def test_saved_offloaded_model_is_a_dense_checkpoint_with_the_same_tokens(mxfp4, tmp_path):
    path, _, want, _ = mxfp4
    _offloaded(path, store="disk", expert_cache="34%").save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "quantization_config" not in config            # dense experts under their dense names, not *_blocks
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert torch.equal(_outputs(reloaded, *token_inputs(2, 6, left_pad=True))[0], want)


def test_enable_accepts_the_model_transformers_dequantized(mxfp4):
    """transformers' CPU load of an MXFP4 checkpoint (dequantize=True) holds float experts: enable() offloads it."""
    model = AutoModelForCausalLM.from_pretrained(mxfp4[0], quantization_config=Mxfp4Config(dequantize=True)).eval()
    hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
    assert torch.equal(_outputs(model, *token_inputs(2, 6, left_pad=True))[0], mxfp4[2])
