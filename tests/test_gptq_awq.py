"""GPTQ and AWQ checkpoints: experts read per expert and kept packed (the checkpoint's own bytes in the store and the
cache), dequantized where they compute; the rest of the model dequantized at load. The tests pack tiny MoE models by
the formats' documented rules and compare with the formats' reference dequantization (AutoGPTQ/GPTQModel's torch
kernel, AutoAWQ's `dequantize_gemm`), spelled out here: experts bit-identical, same logits and greedy tokens as the
unpatched model built from the dequantized weights."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig

import hf_moe_offload
from conftest import token_inputs
from hf_moe_offload.arch import get_arch
from hf_moe_offload.policy.offload_policy import PolicyError
from hf_moe_offload.runtime.engine import read_layer_experts
from hf_moe_offload.storage.checkpoint import CheckpointError
from hf_moe_offload.storage.packed_int import PackedFormat, dequantize
from packed_checkpoints import edit_config, pack_checkpoint, to_int32

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
SMALL = dict(vocab_size=96, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
CONFIGS = {
    "mixtral": lambda: MixtralConfig(**SMALL, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(**SMALL, intermediate_size=256, moe_intermediate_size=128,
                                        shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                                        decoder_sparse_step=1, norm_topk_prob=False),
}


# -- the formats, from their documented rules ------------------------------------------------------------------------

def _pack(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Pack unsigned `values` (< 2^bits) into int32 words along `dim`: value j of a word in bits [j*bits, ...);
    with `order`, value j of word c is element pack*c + order[j] (AWQ)."""
    pack = 32 // bits
    v = values.to(torch.int64) if dim == 1 else values.to(torch.int64).T
    v = v.reshape(v.shape[0], -1, pack)
    if order is not None:
        v = v[:, :, order]
    words = sum(v[:, :, j] << (bits * j) for j in range(pack))
    return to_int32(words if dim == 1 else words.T).contiguous()


def _quantize_groups(w: torch.Tensor, bits: int, group: int, sym: bool, perm: torch.Tensor):
    """GPTQ's min/max quantizer per group of inputs taken in `perm` order: codes [in, out], scales and zeros
    [G, out], the group of each input."""
    out_features, in_features = w.shape
    maxq = 2 ** bits - 1
    size = in_features if group == -1 else group
    groups = -(-in_features // size)
    q = torch.empty(in_features, out_features, dtype=torch.int64)
    scales, zeros = torch.empty(groups, out_features), torch.empty(groups, out_features, dtype=torch.int64)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    for g in range(groups):
        cols = perm[g * size:(g + 1) * size]
        x = w[:, cols]
        xmin, xmax = x.min(1).values.clamp(max=0), x.max(1).values.clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        scale = ((xmax - xmin) / maxq).clamp(min=1e-6).half()
        zero = torch.full_like(xmax, (maxq + 1) // 2, dtype=torch.int64) if sym else \
            torch.round(-xmin / scale.float()).to(torch.int64).clamp(0, maxq)
        q[cols] = (torch.round(x / scale.float()[:, None]).to(torch.int64) + zero[:, None]).clamp(0, maxq).T
        scales[g], zeros[g], g_idx[cols] = scale.float(), zero, g
    return q, scales.half(), zeros, g_idx


def gptq_pack(w: torch.Tensor, bits: int, group: int, sym: bool, act_order: bool, v2: bool = False) -> dict:
    """A GPTQ layer: qweight [in/pack, out] packed along in, qzeros [G, out/pack] (v1: zero - 1), scales, g_idx."""
    in_features = w.shape[1]
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(in_features)) if act_order \
        else torch.arange(in_features)
    q, scales, zeros, g_idx = _quantize_groups(w.float(), bits, group, sym, perm)
    stored = (zeros - (0 if v2 else 1)) & (2 ** bits - 1)
    return {"qweight": _pack(q, bits, dim=0), "qzeros": _pack(stored, bits, dim=1), "scales": scales,
            "g_idx": g_idx}


def gptq_reference(t: dict, bits: int, v2: bool = False) -> torch.Tensor:
    """AutoGPTQ/GPTQModel's torch kernel, spelled out: shifts, int8 (int16 for 8 bits) codes, zeros + 1 (v1),
    `scales[g_idx] * (weight - zeros[g_idx])` in the scales' dtype; transposed to [out, in]."""
    small = torch.int16 if bits == 8 else torch.int8
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(t["qzeros"].unsqueeze(2).expand(-1, -1, 32 // bits), wf[None, None]).to(small)
    zeros = torch.bitwise_and(zeros, 2 ** bits - 1) + (0 if v2 else 1)
    zeros = zeros.reshape(t["scales"].shape)
    weight = torch.bitwise_right_shift(t["qweight"].unsqueeze(1).expand(-1, 32 // bits, -1), wf[None, :, None])
    weight = torch.bitwise_and(weight.to(small), 2 ** bits - 1).reshape(-1, t["qweight"].shape[1])
    g = t["g_idx"].long()
    return (t["scales"][g] * (weight - zeros[g])).T


def awq_pack(w: torch.Tensor, group: int) -> dict:
    """An AWQ GEMM layer: per group of inputs, asymmetric min/max; qweight [in, out/8] and qzeros [G, out/8] packed
    along out in AWQ's order, scales [G, out]."""
    out_features, in_features = w.shape
    size = in_features if group == -1 else group
    x = w.float().reshape(out_features, -1, size)                                       # [out, G, g]
    wmax, wmin = x.amax(-1), x.amin(-1)
    scales = ((wmax - wmin).clamp(min=1e-5) / 15).half()
    zeros = (-torch.round(wmin / scales.float())).clamp(0, 15).to(torch.int64)
    q = (torch.round(x / scales.float()[..., None]).to(torch.int64) + zeros[..., None]).clamp(0, 15)
    q = q.reshape(out_features, in_features).T                                          # [in, out]
    return {"qweight": _pack(q, 4, dim=1, order=AWQ_ORDER), "qzeros": _pack(zeros.T, 4, dim=1, order=AWQ_ORDER),
            "scales": scales.T.contiguous()}


def awq_reference(t: dict, group: int) -> torch.Tensor:
    """AutoAWQ's `dequantize_gemm`, spelled out: unpack along out, undo AWQ's order, `(iweight - izeros) * scales`
    with scales and zeros repeated over each group; transposed to [out, in]."""
    shifts = torch.arange(0, 32, 4)
    iweight = torch.bitwise_right_shift(t["qweight"][:, :, None], shifts[None, None]).to(torch.int8)
    iweight = iweight.view(iweight.shape[0], -1)
    izeros = torch.bitwise_right_shift(t["qzeros"][:, :, None], shifts[None, None]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    order = torch.arange(iweight.shape[-1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].view(-1)
    iweight, izeros = torch.bitwise_and(iweight[:, order], 15), torch.bitwise_and(izeros[:, order], 15)
    size = iweight.shape[0] if group == -1 else group
    scales = t["scales"].repeat_interleave(size, dim=0)
    izeros = izeros.repeat_interleave(size, dim=0)
    return ((iweight - izeros) * scales).T


# -- unpacking, bit for bit ------------------------------------------------------------------------------------------

GPTQ_CASES = [(4, 32, True, False), (4, 64, False, False), (4, 128, False, True), (4, -1, True, False),
              (8, 32, False, False), (8, 128, True, True)]


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("bits,group,sym,act_order", GPTQ_CASES)
def test_gptq_dequantization_is_the_reference_bit_for_bit(bits, group, sym, act_order, v2):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(bits + group)) * 0.05
    t = gptq_pack(w, bits, group, sym, act_order, v2)
    fmt = PackedFormat("gptq", bits, group, zero_offset=0 if v2 else 1, act_order=True)
    out = dequantize(fmt, t, (96, 256))
    assert out.dtype == torch.float16
    assert torch.equal(out, gptq_reference(t, bits, v2))
    if not act_order:                                # trivial g_idx: the groups follow from group_size alone
        assert torch.equal(dequantize(PackedFormat("gptq", bits, group, zero_offset=0 if v2 else 1),
                                      {k: v for k, v in t.items() if k != "g_idx"}, (96, 256)), out)
    assert (out.float() - w).abs().max() < 0.05 * (2 if bits == 4 else 0.2)   # and it is the weight, to 4/8 bits


@pytest.mark.parametrize("bad", [8, -1])
def test_a_g_idx_outside_the_groups_is_named_as_damage(bad):
    """act-order's g_idx names each input's group; one outside the scales' groups (a damaged file) is refused, not
    an IndexError from a reader thread, nor a negative index wrapping around."""
    t = gptq_pack(torch.randn(96, 256, generator=torch.Generator().manual_seed(0)), 4, 32, False, True)
    t["g_idx"] = t["g_idx"].clone()
    t["g_idx"][5] = bad                                             # 256 inputs in groups of 32: 0..7
    with pytest.raises(CheckpointError, match="g_idx names group .*scales have 8 groups"):
        dequantize(PackedFormat("gptq", 4, 32, zero_offset=1, act_order=True), t, (96, 256))


@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_awq_dequantization_is_the_reference_bit_for_bit(group):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(group + 7)) * 0.05
    t = awq_pack(w, group)
    out = dequantize(PackedFormat("awq", 4, group), t, (64, 256))
    assert torch.equal(out, awq_reference(t, group))
    assert (out.float() - w).abs().max() < 0.1


def test_awq_word_order_is_not_the_plain_order():
    """AWQ's value j of a word is output column 8c + [0, 2, 4, 6, 1, 3, 5, 7][j]: the word of columns 0..7 holding
    their own index reads 0x75316420, and dequantizes back to 0..7 in column order."""
    word = _pack(torch.arange(8)[None], 4, dim=1, order=AWQ_ORDER)
    assert word.item() == 0x75316420
    t = {"qweight": word, "qzeros": torch.zeros(1, 1, dtype=torch.int32), "scales": torch.ones(1, 8).half()}
    assert dequantize(PackedFormat("awq", 4, -1), t, (8, 1)).flatten().tolist() == list(range(8))
    assert awq_reference(t, -1).flatten().tolist() == list(range(8))


# -- whole checkpoints -----------------------------------------------------------------------------------------------

def _build(family: str, path, dtype: torch.dtype = torch.float32) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]()).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.shape[0] <= 8:
                p.mul_(8.0)                          # decisive routing: no near-ties to make tokens fragile
    model.save_pretrained(path, max_shard_size="300KB")
    return str(path)


GPTQ_CONFIG = dict(quant_method="gptq", damp_percent=0.01, true_sequential=True, model_name_or_path=None)


def _gptq_checkpoint(tmp_path, family="mixtral", bits=4, group=32, sym=False, act_order=False):
    float_path = _build(family, tmp_path / "float")
    packer = lambda m, w: (t := gptq_pack(w, bits, group, sym, act_order), gptq_reference(t, bits))
    pack_checkpoint(float_path, str(tmp_path / "packed"), str(tmp_path / "dense"), packer,
                    {**GPTQ_CONFIG, "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order})
    return str(tmp_path / "packed"), str(tmp_path / "dense")


def _awq_checkpoint(tmp_path, family="mixtral", group=64):
    float_path = _build(family, tmp_path / "float")
    packer = lambda m, w: (t := awq_pack(w, group), awq_reference(t, group))
    pack_checkpoint(float_path, str(tmp_path / "packed"), str(tmp_path / "dense"), packer,
                    {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    return str(tmp_path / "packed"), str(tmp_path / "dense")


def _offloaded(path, **policy):
    return AutoModelForCausalLM.from_pretrained(path, offload_policy={"device": "cpu", **policy}).eval()


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def assert_equals_dense_reference(model, ref):
    """Experts bit-identical to the dequantized ones, every other weight too, same logits and greedy tokens."""
    engine = hf_moe_offload.get_engine(model)
    for ref_layer, layer in zip(get_arch(ref.config).find_layers(ref), engine.layers):
        stacked = read_layer_experts(engine.store, layer, torch.device("cpu"))
        assert torch.equal(stacked["gate_up"], ref_layer.module.gate_up_proj.data)
        assert torch.equal(stacked["down"], ref_layer.module.down_proj.data)
    resident = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if ".experts." not in name:
            assert torch.equal(resident[name], p), name
    ids, mask = token_inputs(2, 10)
    torch.testing.assert_close(_logits(model, ids, mask), _logits(ref, ids, mask), rtol=1e-5, atol=1e-5)
    ids, mask = token_inputs(3, 8, seed=2, left_pad=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def packed_bits_per_weight(model) -> float:
    """Bytes one expert's slab takes (what the cache holds and a miss reads), in bits per expert weight."""
    engine = hf_moe_offload.get_engine(model)
    layer = engine.layers[0]
    weights = sum(shape[0] * shape[1] for _, shape in layer.layout.parts)
    return engine.store.slab_bytes(0) * 8 / weights


@pytest.mark.parametrize("family,bits,group,sym,act_order,policy", [
    ("mixtral", 4, 32, False, False, {"store": "disk", "expert_cache": "40%"}),
    ("mixtral", 4, 64, True, True, {"store": "cpu"}),
    ("mixtral", 4, 128, False, True, {"store": "disk", "expert_cache": "40%"}),
    ("mixtral", 8, 128, True, False, {"store": "disk", "expert_cache": "40%"}),
    ("qwen2_moe", 4, -1, False, False, {"store": "disk", "expert_cache": "40%"}),
])
def test_offloaded_gptq_checkpoint_equals_the_dequantized_model(tmp_path, family, bits, group, sym, act_order,
                                                                policy):
    packed, dense = _gptq_checkpoint(tmp_path, family, bits, group, sym, act_order)
    model = _offloaded(packed, **policy)
    assert_equals_dense_reference(model, AutoModelForCausalLM.from_pretrained(dense).eval())
    stats = hf_moe_offload.stats(model)
    if policy["store"] == "disk":
        assert stats["misses"] > 0                            # experts really came through the cache
    bound = {(4, 32): 5.0, (4, 64): 4.9, (4, 128): 4.8, (8, 128): 8.8, (4, -1): 4.7}[(bits, group)]
    assert packed_bits_per_weight(model) < bound              # the checkpoint's bytes, not float32's 32 bits


@pytest.mark.parametrize("group,policy", [(64, {"store": "disk", "expert_cache": "40%"}), (128, {"store": "cpu"})])
def test_offloaded_awq_checkpoint_equals_the_dequantized_model(tmp_path, group, policy):
    packed, dense = _awq_checkpoint(tmp_path, group=group)
    model = _offloaded(packed, **policy)
    assert_equals_dense_reference(model, AutoModelForCausalLM.from_pretrained(dense).eval())
    assert packed_bits_per_weight(model) < 4.9


def test_bytes_to_device_count_packed_slabs(tmp_path):
    packed, _ = _gptq_checkpoint(tmp_path)
    model = _offloaded(packed, store="disk", expert_cache="40%")
    ids, mask = token_inputs(2, 10)
    _logits(model, ids, mask)
    stats = hf_moe_offload.stats(model)
    slab = hf_moe_offload.get_engine(model).store.slab_bytes(0)
    assert stats["bytes_to_device"] == (stats["misses"] + stats["prefetch_issued"]) * slab


def test_save_pretrained_and_disable_give_the_dequantized_model(tmp_path):
    packed, dense = _gptq_checkpoint(tmp_path, act_order=True)
    model = _offloaded(packed, store="disk", expert_cache="40%")
    ref = AutoModelForCausalLM.from_pretrained(dense).eval()
    ids, mask = token_inputs(2, 10)
    model.save_pretrained(tmp_path / "saved")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert getattr(saved.config, "quantization_config", None) is None
    torch.testing.assert_close(_logits(saved, ids, mask), _logits(ref, ids, mask), rtol=0, atol=0)
    hf_moe_offload.disable(model)
    torch.testing.assert_close(_logits(model, ids, mask), _logits(ref, ids, mask), rtol=0, atol=0)


# -- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "quant_method='gptq' with bits=3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {r"+:.*layers\.1\..*\.w2": {"bits": 8}}},
     r"dynamic=.*one bits and group_size for every layer"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "quant_method='awq' with version='gemv'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits=8"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    ({"quant_method": "hqq"}, "quant_method='hqq'"),
    ({"quant_method": "eetq"}, "quant_method='eetq'"),
    ({"quant_method": "aqlm"}, "quant_method='aqlm'"),
])
def test_formats_not_read_are_refused_naming_them_and_listing_what_is(tmp_path, qc, named):
    path = _build("mixtral", tmp_path / "m")
    edit_config(path, quantization_config=qc)
    with pytest.raises(PolicyError, match=f"{named}.*GPTQ 4/8-bit.*AWQ 4-bit GEMM.*compressed-tensors pack-quantized"):
        _offloaded(path, store="disk", expert_cache="50%")


def test_a_mapped_embedding_is_refused_naming_the_packed_checkpoint(tmp_path):
    packed, _ = _gptq_checkpoint(tmp_path)
    with pytest.raises(PolicyError, match="embedding='mapped' is not possible here: .*GPTQ, AWQ or compressed-t"):
        _offloaded(packed, store="disk", expert_cache="50%", embedding="mapped")


def test_requantizing_packed_experts_is_refused(tmp_path):
    packed, _ = _gptq_checkpoint(tmp_path)
    with pytest.raises(PolicyError, match="quantize='int4' cannot be combined.*already stored as packed integers"):
        _offloaded(packed, store="disk", quantize="int4")


def test_a_float_checkpoint_that_says_gptq_is_named(tmp_path):
    path = _build("mixtral", tmp_path / "m")
    edit_config(path, quantization_config={**GPTQ_CONFIG, "bits": 4, "group_size": 32})
    with pytest.raises(CheckpointError, match="no gptq packed weights.*qweight"):
        _offloaded(path, store="disk")


@pytest.mark.parametrize("damage,message", [
    (lambda t, k: t.pop(f"{k}.qzeros"), r"has no .*experts\.1\.w2\.qzeros"),
    (lambda t, k: t.__setitem__(f"{k}.scales", t[f"{k}.scales"][:1].contiguous()),
     r"experts\.1\.w2\.scales in .* is torch.float16 \[1, 128\].*needs torch.float32 or torch.bfloat16 or "
     r"torch.float16 \[8, 128\]"),
    (lambda t, k: t.__setitem__(f"{k}.qweight", t[f"{k}.qweight"][:8].contiguous()),
     r"experts\.1\.w2\.\w+ in .*the size qweight \[8, 128\] gives.*one of the two is damaged"),
])
def test_missing_or_misshapen_tensors_are_named_before_loading(tmp_path, damage, message):
    packed, _ = _gptq_checkpoint(tmp_path)
    key = "model.layers.1.block_sparse_moe.experts.1.w2"
    for file in os.listdir(packed):
        if file.endswith(".safetensors"):
            tensors = load_file(os.path.join(packed, file))
            if f"{key}.qweight" in tensors:
                damage(tensors, key)
                save_file(tensors, os.path.join(packed, file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        _offloaded(packed, store="disk")


def test_enable_refuses_a_packed_config(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(_build("mixtral", tmp_path / "m")).eval()
    model.config.quantization_config = {**GPTQ_CONFIG, "bits": 4, "group_size": 32}
    with pytest.raises(PolicyError, match="from_pretrained"):
        hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
