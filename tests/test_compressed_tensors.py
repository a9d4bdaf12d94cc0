"""compressed-tensors "pack-quantized" checkpoints (llm-compressor's W4A16/W8A16): experts read per expert and kept
packed, dequantized where they compute. The checkpoints are packed by compressed-tensors' own compressor, and the
reference is its own decompression: experts bit-identical to it, and the same logits and greedy tokens as the dense
model built from it and as transformers' own compressed-tensors load (for a symmetric checkpoint: transformers 5.24
fails to gather the experts' zero points of an asymmetric one, so those compare with the decompression alone)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import token_inputs
from hf_moe_offload.policy.offload_policy import PolicyError
from hf_moe_offload.storage.packed_int import PackedFormat, dequantize
from packed_checkpoints import edit_config, pack_checkpoint
from test_gptq_awq import _build, _logits, _offloaded, assert_equals_dense_reference, packed_bits_per_weight

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402


def _scheme(bits: int, group: int, symmetric: bool) -> QuantizationScheme:
    strategy = "channel" if group == -1 else "group"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=None if group == -1 else group)
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_compress(w: torch.Tensor, scheme: QuantizationScheme) -> dict:
    """One linear compressed by compressed-tensors itself: min/max qparams per group (or channel), then its
    pack-quantized compressor."""
    args = scheme.weights
    size = w.shape[1] if args.group_size is None else args.group_size
    grouped = w.float().reshape(w.shape[0], -1, size)
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    state = {"weight": w, "weight_scale": scale.to(w.dtype)}
    if not args.symmetric:
        state["weight_zero_point"] = zero
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def ct_decompress(t: dict, scheme: QuantizationScheme) -> torch.Tensor:
    return PackedQuantizationCompressor.decompress(dict(t), scheme)["weight"]


def _fmt(bits, group, symmetric) -> PackedFormat:
    return PackedFormat("compressed-tensors", bits, group, symmetric=symmetric)


CASES = [(4, 32, True), (4, 64, False), (4, 128, True), (4, -1, False), (8, 128, False), (8, -1, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits,group,symmetric", CASES)
def test_unpacking_is_compressed_tensors_decompression_bit_for_bit(bits, group, symmetric, dtype):
    scheme = _scheme(bits, group, symmetric)
    w = (torch.randn(96, 256, generator=torch.Generator().manual_seed(bits * group)) * 0.05).to(dtype)
    t = ct_compress(w, scheme)
    shape = tuple(int(d) for d in t.pop("weight_shape"))
    out = dequantize(_fmt(bits, group, symmetric), t, shape)
    assert out.dtype == dtype
    assert torch.equal(out, ct_decompress({**t, "weight_shape": torch.tensor(shape)}, scheme))


def _quantization_config(scheme: QuantizationScheme) -> dict:
    return QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                              quantization_status="compressed", ignore=["lm_head"]).model_dump(mode="json")


def _ct_checkpoint(tmp_path, family="mixtral", bits=4, group=32, symmetric=True, dtype=torch.float32):
    scheme = _scheme(bits, group, symmetric)
    float_path = _build(family, tmp_path / "float", dtype)
    packer = lambda m, w: (t := ct_compress(w, scheme), ct_decompress(t, scheme))
    pack_checkpoint(float_path, str(tmp_path / "packed"), str(tmp_path / "dense"), packer,
                    _quantization_config(scheme))
    return str(tmp_path / "packed"), str(tmp_path / "dense")


@pytest.mark.parametrize("family,bits,group,symmetric,policy", [
    ("mixtral", 4, 32, True, {"store": "disk", "expert_cache": "40%"}),
    ("mixtral", 4, 128, False, {"store": "cpu"}),
    ("qwen2_moe", 4, -1, True, {"store": "disk", "expert_cache": "40%"}),
    ("mixtral", 8, 64, False, {"store": "disk", "expert_cache": "40%"}),
])
def test_offloaded_checkpoint_equals_the_decompressed_model(tmp_path, family, bits, group, symmetric, policy):
    packed, dense = _ct_checkpoint(tmp_path, family, bits, group, symmetric)
    model = _offloaded(packed, **policy)
    assert_equals_dense_reference(model, AutoModelForCausalLM.from_pretrained(dense).eval())
    assert packed_bits_per_weight(model) < (5.1 if bits == 4 else 9.1)


def test_bfloat16_checkpoint_gives_transformers_own_tokens(tmp_path):
    """transformers' compressed-tensors quantizer decompresses the checkpoint on a CPU: the offloaded model gives its
    greedy tokens."""
    packed, dense = _ct_checkpoint(tmp_path, "mixtral", 4, 64, True, dtype=torch.bfloat16)
    model = _offloaded(packed, store="disk", expert_cache="40%")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert_equals_dense_reference(model, AutoModelForCausalLM.from_pretrained(dense).eval())
    transformers_own = AutoModelForCausalLM.from_pretrained(packed).eval()
    ids, mask = token_inputs(3, 8, seed=2, left_pad=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), transformers_own.generate(ids, **kwargs))
    torch.testing.assert_close(_logits(model, ids, mask), _logits(transformers_own, ids, mask), rtol=0, atol=0)


@pytest.mark.parametrize("edit,named", [
    (lambda qc: qc.update(format="float-quantized"), "format='float-quantized'"),
    (lambda qc: qc["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
     "activation quantization"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder='group'"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=2), "int weights of 2 bits"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
])
def test_schemes_not_read_are_refused_naming_them(tmp_path, edit, named):
    qc = _quantization_config(_scheme(4, 32, True))
    edit(qc)
    path = _build("mixtral", tmp_path / "m")
    edit_config(path, quantization_config=qc)
    with pytest.raises(PolicyError, match=f"quant_method='compressed-tensors' with .*{named}.*compressed-tensors "
                                          f"pack-quantized int4/int8 weight-only"):
        _offloaded(path, store="disk")


def test_int8_zero_points_one_per_row_are_read_and_packed_shapes_refused(tmp_path):
    """An asymmetric layer may keep its zero points unpacked, one int8 per output row and group: the index accepts
    them and the weights subtract them; int8 zero points in the packed shape are refused when the index opens."""
    from hf_moe_offload.storage.checkpoint import CheckpointError
    from hf_moe_offload.storage.folders import write_safetensors
    from hf_moe_offload.storage.packed_checkpoint import PackedCheckpointIndex

    out_f, in_f, group = 16, 64, 32
    g = torch.Generator().manual_seed(0)
    zero_points = torch.randint(-8, 8, (out_f, in_f // group), dtype=torch.int8, generator=g)
    tensors = {"m.weight_packed": torch.randint(-2**31, 2**31 - 1, (out_f, in_f // 8), dtype=torch.int32, generator=g),
               "m.weight_scale": torch.rand(out_f, in_f // group, generator=g),
               "m.weight_zero_point": zero_points, "m.weight_shape": torch.tensor([out_f, in_f])}
    write_safetensors(str(tmp_path), "model.safetensors", tensors, 0)
    asymmetric = PackedFormat("compressed-tensors", 4, group, symmetric=False)
    assert "m" in PackedCheckpointIndex.open(tmp_path, asymmetric).packed
    parts = {k[2:]: v for k, v in tensors.items()}
    without = {k: v for k, v in parts.items() if k != "weight_zero_point"}
    shift = (zero_points.float() * parts["weight_scale"]).repeat_interleave(group, dim=1)
    torch.testing.assert_close(dequantize(asymmetric, parts, (out_f, in_f)),
                               dequantize(PackedFormat("compressed-tensors", 4, group, symmetric=True), without,
                                          (out_f, in_f)) - shift)

    tensors["m.weight_zero_point"] = zero_points[: out_f // 8]
    write_safetensors(str(tmp_path), "model.safetensors", tensors, 0)
    with pytest.raises(CheckpointError, match=r"m\.weight_zero_point .* torch\.int8 \[2, 2\].*\[16, 2\]"):
        PackedCheckpointIndex.open(tmp_path, asymmetric)
