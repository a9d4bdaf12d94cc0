"""Fine-grained FP8 checkpoints (DeepSeek-V3 / Qwen3-*-FP8 layout: float8_e4m3fn weights, one float32
`weight_scale_inv` per block): experts are read per expert and dequantized by the store, the rest by transformers,
so the offloaded model equals transformers' own dequantized load. Bad scales and other methods are refused."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_moe_offload
from conftest import build_tiny, token_inputs
from hf_moe_offload.arch import get_arch
from hf_moe_offload.storage.checkpoint import CheckpointError, CheckpointIndex, dequantize_blocks
from hf_moe_offload.runtime.engine import read_layer_experts
from hf_moe_offload.policy.offload_policy import PolicyError
from hf_moe_offload.storage.store import DiskStore
from transformers import AutoConfig, AutoModelForCausalLM

FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 as the FP8 checkpoints ship it: fp8 weight and its scale per block (max |w| / 448);
    blocks at the right and bottom edges may be partial (ceil grid)."""
    n, k = w.shape
    sr, sc = -(-n // block[0]), -(-k // block[1])
    padded = torch.zeros(sr * block[0], sc * block[1])
    padded[:n, :k] = w.float()
    blocks = padded.view(sr, block[0], sc, block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(sr * block[0], sc * block[1])[:n, :k].contiguous(), scale.contiguous()


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The definition, spelled out: every element times the scale of its block."""
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:q.shape[0], :q.shape[1]]
    return q.float() * full


def _quantized_key(key: str, tensor: torch.Tensor) -> bool:
    """The weights transformers' FP8 quantizer makes FP8: every nn.Linear's (attention projections) and the
    experts'; not the embeddings, norms, router or lm_head."""
    return key.endswith(".weight") and tensor.dim() == 2 and (".self_attn." in key or ".experts." in key)


def convert_to_fp8(path: str, block: tuple[int, int], **config_extra) -> str:
    """Rewrite the checkpoint at `path` (in place) into the fine-grained FP8 layout, config included."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else None
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors, out = load_file(file), {}
        for key, tensor in tensors.items():
            if _quantized_key(key, tensor):
                out[key], out[key + "_scale_inv"] = quantize_fp8(tensor, block)
                if index is not None:
                    index["weight_map"][key + "_scale_inv"] = os.path.basename(file)
            else:
                out[key] = tensor
        save_file(out, file, metadata={"format": "pt"})
    if index is not None:
        json.dump(index, open(index_path, "w"))
    _edit_config(path, quantization_config={"quant_method": "fp8", "weight_block_size": list(block), "fmt": "e4m3",
                                            "activation_scheme": "dynamic", **config_extra})
    return path


def _edit_config(path: str, **fields) -> None:
    config_path = os.path.join(path, "config.json")
    config = json.load(open(config_path))
    config.update(fields)
    json.dump(config, open(config_path, "w"))


def _edit_tensors(path: str, edit) -> None:
    """Apply `edit(tensors)` to every shard (it mutates the dict)."""
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        tensors = load_file(file)
        edit(tensors)
        save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    """(family, block, dtype) -> an FP8 checkpoint (sharded, so scales and weights span files), built once."""
    built = {}

    def get(family: str, block: tuple[int, int], dtype: torch.dtype = torch.float32) -> str:
        key = (family, block, dtype)
        if key not in built:
            path = tmp_path_factory.mktemp(f"fp8_{family}_{block[0]}")
            built[key] = convert_to_fp8(build_tiny(family, path, dtype=dtype, max_shard_size="100KB"), block)
        return built[key]

    return get


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _assert_same_experts(model, ref):
    """The offloaded model's dense experts are transformers' dequantized experts, bit for bit."""
    engine = hf_moe_offload.get_engine(model)
    for ref_layer, layer in zip(get_arch(ref.config).find_layers(ref), engine.layers):
        stacked = read_layer_experts(engine.store, layer, torch.device("cpu"))
        assert torch.equal(stacked["gate_up"], ref_layer.module.gate_up_proj.data)
        assert torch.equal(stacked["down"], ref_layer.module.down_proj.data)


def _offloaded(path, **policy):
    return AutoModelForCausalLM.from_pretrained(path, offload_policy={"device": "cpu", **policy}).eval()


POLICIES = {"disk-third": {"store": "disk", "expert_cache": "34%"}, "cpu": {"store": "cpu"}}


# qwen3_moe's experts are [40, 32]/[32, 40]: 8x8 blocks tile them (transformers' own dequantization derives the block
# from the scale grid, so it needs dims that the blocks divide); mixtral's [48, 32] take 16x16; 128x128 is one block.
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family,block", [("qwen3_moe", (8, 8)), ("qwen3_moe", (128, 128)), ("mixtral", (16, 16))])
def test_offloaded_fp8_checkpoint_equals_transformers_dequantized_load(fp8_models, family, block, policy):
    path = fp8_models(family, block)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()     # no GPU: transformers dequantizes it itself
    model = _offloaded(path, **POLICIES[policy])
    _assert_same_experts(model, ref)
    ids, mask = token_inputs(2, 10)
    torch.testing.assert_close(_logits(model, ids, mask), _logits(ref, ids, mask), rtol=1e-4, atol=1e-5)
    ids, mask = token_inputs(3, 8, seed=2, left_pad=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    if policy == "disk-third":
        assert hf_moe_offload.stats(model)["misses"] > 0        # experts really came through the cache


def test_bfloat16_fp8_checkpoint_gives_the_same_tokens(fp8_models):
    path = fp8_models("mixtral", (16, 16), torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    model = _offloaded(path, store="disk", expert_cache="34%")
    assert next(p for p in ref.parameters()).dtype == torch.bfloat16
    _assert_same_experts(model, ref)
    ids, mask = token_inputs(3, 8, seed=2, left_pad=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    torch.testing.assert_close(_logits(model, ids, mask), _logits(ref, ids, mask), rtol=1.6e-2, atol=1e-2)


def test_partial_edge_blocks_are_dequantized_by_the_scale_of_their_block(tmp_path):
    """Dims the block does not divide (40 rows, 16x16 blocks: a grid of 3, the last block 8 rows), as real FP8
    checkpoints allow: each element gets its own block's scale (checked against the definition)."""
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 4, 40)[:, None]
    q, scale = quantize_fp8(w, (16, 16))
    assert scale.shape == (3, 2)
    out = torch.empty(40, 24)
    dequantize_blocks(q, scale, (16, 16), out)
    assert torch.equal(out, reference_dequantize(q, scale, (16, 16)))
    assert (out - w).abs().max() < 0.07 * w.abs().max()          # and it is the weight, to FP8 precision

    path = convert_to_fp8(build_tiny("qwen3_moe", tmp_path / "m"), (16, 16))   # experts [40, 32] and [32, 40]
    # transformers' own loader derives the block from the scale grid, so it refuses these dims: read the store
    # directly (the path every offloaded load takes for its experts).
    config = AutoConfig.from_pretrained(path)
    arch = get_arch(config)
    with torch.device("meta"):
        layers = arch.find_layers(AutoModelForCausalLM.from_config(config))
    index = CheckpointIndex.open(path, block_size=(16, 16))
    pieces = [[arch.locate_expert(index, lay.name, e, lay.layout) for e in range(lay.num_experts)] for lay in layers]
    store = DiskStore(layers, pieces, torch.float32)
    slab = torch.empty(layers[1].layout.numel)
    store.read_into(1, 3, slab)
    views = layers[1].layout.views(slab)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    prefix = f"{layers[1].name}.3"
    for part, rows, name in (("gate_up", slice(0, 40), "gate_proj"), ("gate_up", slice(40, 80), "up_proj"),
                             ("down", slice(None), "down_proj")):
        expected = reference_dequantize(tensors[f"{prefix}.{name}.weight"],
                                        tensors[f"{prefix}.{name}.weight_scale_inv"], (16, 16))
        assert torch.equal(views[part][rows], expected), name
    store.close()


SCALE = "model.layers.1.block_sparse_moe.experts.4.w3.weight_scale_inv"


@pytest.mark.parametrize("damage,message", [
    (lambda t: t.pop(SCALE, None), f"no {SCALE}.*block scales.*float32 tensor of shape \\[1, 1\\]"),
    (lambda t: t.__setitem__(SCALE, t[SCALE][:, :1].repeat(2, 1).contiguous()) if SCALE in t else None,
     f"{SCALE} in .* is torch.float32 \\[2, 1\\].*needs one scale per block.*\\[1, 1\\]"),
])
def test_missing_or_misshapen_scale_is_named_before_loading(tmp_path, damage, message):
    path = convert_to_fp8(build_tiny("mixtral", tmp_path / "m", max_shard_size="100KB"), (128, 128))
    _edit_tensors(path, damage)
    with pytest.raises(CheckpointError, match=message):
        _offloaded(path, store="disk", expert_cache="34%")


def test_non_finite_scale_is_named_when_read(tmp_path):
    path = convert_to_fp8(build_tiny("mixtral", tmp_path / "m"), (16, 16))
    key = "model.layers.0.block_sparse_moe.experts.2.w2.weight_scale_inv"
    _edit_tensors(path, lambda t: t[key].__setitem__((0, 0), float("nan")))
    with pytest.raises(CheckpointError, match=f"{key} in .*non-finite block scales"):
        _offloaded(path, store="cpu")                          # the CPU store reads every expert at load


@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "quant_method='awq' with version='gemv'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "quant_method='fp8' with fmt='e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({"quant_method": "fp8"}, "quant_method='fp8' without weight_block_size"),
])
def test_other_quantization_methods_are_refused_naming_them(tmp_path, qc, named):
    path = build_tiny("mixtral", tmp_path / "m")
    _edit_config(path, quantization_config=qc)
    with pytest.raises(PolicyError, match=f"{named}.*float32, float16, bfloat16.*fp8.*weight_block_size"):
        _offloaded(path, store="disk", expert_cache="50%")


def test_enable_accepts_a_model_transformers_dequantized(fp8_models):
    """transformers' CPU load of an FP8 checkpoint holds float weights (dequantize=True): enable() offloads it."""
    path = fp8_models("mixtral", (16, 16))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = token_inputs(2, 10)
    expected = _logits(model, ids, mask)
    hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
    torch.testing.assert_close(_logits(model, ids, mask), expected, rtol=1e-4, atol=1e-5)


def test_int8_experts_from_an_fp8_checkpoint(fp8_models):
    """quantize="int8" reads the dequantized experts from the store and quantizes them: the model computes with
    those int8 experts and everything else as transformers loads it."""
    path = fp8_models("mixtral", (16, 16))
    model = _offloaded(path, store="cpu", quantize="int8")
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    engine = hf_moe_offload.get_engine(model)
    arch = get_arch(ref.config)
    for ref_layer, layer in zip(arch.find_layers(ref), engine.layers):
        stacked = read_layer_experts(engine.store, layer, torch.device("cpu"))
        dense = ref_layer.module.gate_up_proj.data
        assert (stacked["gate_up"] - dense).abs().max() <= dense.abs().max() / 127   # int8 of the FP8 experts
        ref_layer.module.load_state_dict(arch.expert_state(ref_layer, stacked), strict=False)
    ids, mask = token_inputs(2, 10)
    torch.testing.assert_close(_logits(model, ids, mask), _logits(ref, ids, mask), rtol=1e-4, atol=1e-5)
