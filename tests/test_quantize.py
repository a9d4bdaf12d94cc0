"""Quantized experts (quantize="int8" | "int4"): the rounding bound, fast CPU kernels equal to the generic path, an
offloaded quantized model equal to the unpatched model carrying the same dequantized experts, the quantized folder
reused and rebuilt, the budget in quantized bytes, refusals, and disable() giving back the dequantized weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

import hf_moe_offload
from conftest import build_tiny, forward_logits, model_class, reference, token_inputs
from hf_moe_offload.arch import get_arch
from hf_moe_offload.runtime.engine import read_layer_experts
from hf_moe_offload.layout import SlabLayout
from hf_moe_offload.policy.offload_policy import PolicyError
from hf_moe_offload.storage.quantize import (QuantizedSlabLayout, fast_kernels, from_cpu_int4, quantize_int4,
                                     quantize_int8, to_cpu_int4)
from hf_moe_offload.storage.spill import MANIFEST


# -- the arithmetic ------------------------------------------------------------------------------------------------

def test_int8_round_trip_within_half_a_scale_per_row():
    w = torch.randn(40, 56, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 40)[:, None]
    q, scale = quantize_int8(w, torch.float32)
    err = (q.float() * scale[:, None] - w).abs()
    assert torch.all(err <= scale[:, None] / 2 * (1 + 1e-5))
    assert err.max() > 0                           # approximate: the bound is what holds, not equality


@pytest.mark.parametrize("group,k", [(32, 64), (64, 128), (32, 48)])   # 48: the last group padded
def test_int4_round_trip_within_half_a_scale_per_group(group, k):
    w = torch.randn(32, k, generator=torch.Generator().manual_seed(1)) + torch.linspace(-2, 2, k)
    q, sz = quantize_int4(w, group, torch.float32)
    assert int(q.max()) <= 15
    padded = q.shape[1]
    scale = sz[..., 0].t().repeat_interleave(group, dim=1)[:, :k]        # [N, K]
    zero = sz[..., 1].t().repeat_interleave(group, dim=1)[:, :k]
    dq = (q[:, :k].float() - 8) * scale + zero
    assert padded % group == 0 and padded >= k
    assert torch.all((dq - w).abs() <= scale / 2 + 1e-5)


def test_layout_round_trip_and_sizes():
    dense = SlabLayout(parts=(("gate_up", (96, 64)), ("down", (64, 48))))
    parts = {"gate_up": torch.randn(96, 64), "down": torch.randn(64, 48)}
    for method, bound in (("int8", 0.05), ("int4", 0.5)):
        layout = QuantizedSlabLayout.build(dense, method, 32, torch.float32)
        assert layout.numel % 64 == 0 and layout.numel < dense.numel * 4 / (3.5 if method == "int8" else 4.5)
        slab = torch.empty(layout.numel, dtype=torch.uint8)
        layout.quantize_into(parts, slab)
        back = layout.dequantize(slab)
        for name, w in parts.items():
            assert back[name].shape == w.shape and (back[name] - w).abs().max() < bound


# -- fast CPU kernels against the generic path ---------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(96, 128), (48, 32), (80, 64)])
def test_cpu_int4_format_reads_back(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert torch.equal(from_cpu_int4(to_cpu_int4(q)), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_fast_kernels_equal_generic_path(method, dtype):
    dense = SlabLayout(parts=(("up", (96, 64)), ("down", (32, 48))))
    layout = QuantizedSlabLayout.build(dense, method, 32, dtype, packing="cpu")
    if method == "int4":
        assert {p.packing for p in layout.qparts} == {"cpu"}     # torch's CPU int4 kernel really runs
    slab = torch.empty(layout.numel, dtype=torch.uint8)
    g = torch.Generator().manual_seed(2)
    layout.quantize_into({"up": torch.randn(96, 64, generator=g), "down": torch.randn(32, 48, generator=g)}, slab)
    weights = layout.views(slab)
    for name, k in (("up", 64), ("down", 48)):
        x = torch.randn(5, k, generator=g).to(dtype)
        fast = weights[name].linear(x)
        with fast_kernels(False):
            generic = weights[name].linear(x)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert fast.dtype == generic.dtype == dtype
        torch.testing.assert_close(fast.float(), generic.float(), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [24, 36, 40, 100])
def test_int8_computes_right_for_any_input_width(k, dtype):
    """Widths torch's bfloat16 int8 kernel gets wrong (not a multiple of 16) still give the dequantized product."""
    layout = QuantizedSlabLayout.build(SlabLayout(parts=(("up", (48, k)),)), "int8", 32, dtype)
    slab = torch.empty(layout.numel, dtype=torch.uint8)
    g = torch.Generator().manual_seed(3)
    layout.quantize_into({"up": torch.randn(48, k, generator=g)}, slab)
    weight = layout.views(slab)["up"]
    x = torch.randn(3, k, generator=g).to(dtype)
    expected = x.float() @ weight.dequantize().float().T
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(weight.linear(x).float(), expected, rtol=tol, atol=tol * 10)


# -- offloaded quantized models ------------------------------------------------------------------------------------

def _dequantized_reference(family, path, model):
    """The unpatched model with every expert replaced by what the offloaded model computes with."""
    engine = hf_moe_offload.get_engine(model)
    ref = reference(family, path)
    arch = get_arch(ref.config)
    for ref_layer, layer in zip(arch.find_layers(ref), engine.layers):
        stacked = read_layer_experts(engine.store, layer, torch.device("cpu"))
        missing, unexpected = ref_layer.module.load_state_dict(arch.expert_state(ref_layer, stacked), strict=False)
        assert not unexpected and not any("weight" in k or "proj" in k for k in missing)
    return ref


def _load(family, path, folder=None, **policy):
    kwargs = {"offload_folder": str(folder)} if folder is not None else {}
    return model_class(family).from_pretrained(path, offload_policy={"device": "cpu", **policy}, **kwargs).eval()


@pytest.mark.parametrize("store", ["disk", "cpu"])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["mixtral", "switch_transformers"])
def test_quantized_model_matches_unpatched_model_with_dequantized_experts(tiny_models, tmp_path, family, method,
                                                                         store):
    policy = {"store": store, "quantize": method}
    if store == "disk":
        policy["expert_cache"] = "34%"        # a third of the experts (as stored, quantized)
    model = _load(family, tiny_models[family], tmp_path / "q" if store == "disk" else None, **policy)
    ref = _dequantized_reference(family, tiny_models[family], model)
    ids, mask = token_inputs(2, 10)
    torch.testing.assert_close(forward_logits(model, family, ids, mask), forward_logits(ref, family, ids, mask),
                               rtol=1e-4, atol=1e-4)
    ids, mask = token_inputs(1, 8, seed=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    # Approximate: the dequantized experts are not the checkpoint's.
    original = reference(family, tiny_models[family])
    assert not torch.equal(forward_logits(original, family, ids, mask), forward_logits(model, family, ids, mask))
    if store == "disk":
        stats = hf_moe_offload.stats(model)
        assert stats["misses"] > 0


def test_budget_counts_quantized_bytes(tiny_models, tmp_path):
    dense = _load("mixtral", tiny_models["mixtral"], store="disk", expert_cache="34%")
    model = _load("mixtral", tiny_models["mixtral"], tmp_path / "q", store="disk", expert_cache="34%",
                  quantize="int8")
    dense_cache, cache = hf_moe_offload.get_engine(dense).cache, hf_moe_offload.get_engine(model).cache
    assert cache.store.dtype == torch.uint8 and cache.slot_bytes < dense_cache.slot_bytes / 3
    assert cache.num_slots == dense_cache.num_slots == 4      # "34%" of 12 experts, as stored
    ids, mask = token_inputs(3, 8, left_pad=True)
    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    stats = hf_moe_offload.stats(model)
    total = sum(layout.numel * n for layout, n in zip(cache.store.layouts, cache.store.num_experts))
    assert stats["peak_cache_bytes"] <= total * 34 // 100
    assert stats["bytes_to_device"] == (stats["misses"] + stats["prefetch_issued"]) * cache.slot_bytes


def test_quantized_folder_is_reused_then_rebuilt_when_corrupt(tiny_models, tmp_path):
    folder = tmp_path / "q"
    first = _load("mixtral", tiny_models["mixtral"], folder, store="disk", expert_cache="50%", quantize="int4")
    ids, mask = token_inputs(1, 8)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = first.generate(ids, **kwargs)
    files = sorted(os.listdir(folder))
    assert MANIFEST in files and len(files) == 3          # two MoE layers + the manifest
    written = {name: os.stat(folder / name).st_mtime_ns for name in files}
    hf_moe_offload.disable(first)

    second = _load("mixtral", tiny_models["mixtral"], folder, store="disk", expert_cache="50%", quantize="int4")
    assert {name: os.stat(folder / name).st_mtime_ns for name in files} == written   # not re-quantized
    assert torch.equal(second.generate(ids, **kwargs), expected)
    hf_moe_offload.disable(second)

    layer_file = folder / files[0]
    with open(layer_file, "r+b") as f:                    # a partial file, e.g. an interrupted copy
        f.truncate(os.path.getsize(layer_file) // 2)
    third = _load("mixtral", tiny_models["mixtral"], folder, store="disk", expert_cache="50%", quantize="int4")
    assert os.stat(folder / MANIFEST).st_mtime_ns != written[MANIFEST]                  # rebuilt
    assert torch.equal(third.generate(ids, **kwargs), expected)
    hf_moe_offload.disable(third)

    # Other settings are another fingerprint: the folder is rebuilt, not served with the wrong group size.
    before = json.loads((folder / MANIFEST).read_text())["fingerprint"]
    _load("mixtral", tiny_models["mixtral"], folder, store="disk", expert_cache="50%", quantize="int4",
          quant_group_size=32)
    assert json.loads((folder / MANIFEST).read_text())["fingerprint"] != before


def test_quantized_folder_defaults_to_the_cache_dir(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    _load("switch_transformers", tiny_models["switch_transformers"], store="disk", expert_cache="50%",
          quantize="int8")
    (folder,) = os.listdir(tmp_path / "cache" / "quantized")
    assert MANIFEST in os.listdir(tmp_path / "cache" / "quantized" / folder)


def test_disable_gives_back_the_dequantized_experts(tiny_models, tmp_path):
    family = "mixtral"
    model = _load(family, tiny_models[family], tmp_path / "q", store="disk", expert_cache="50%", quantize="int4")
    engine = hf_moe_offload.get_engine(model)
    dequantized = [read_layer_experts(engine.store, layer, torch.device("cpu")) for layer in engine.layers]
    ids, mask = token_inputs(2, 10)
    offloaded_logits = forward_logits(model, family, ids, mask)
    state = model.state_dict()                          # save_pretrained writes these: dequantized too
    hf_moe_offload.disable(model)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    torch.testing.assert_close(model.model.layers[0].mlp.experts.gate_up_proj.data, dequantized[0]["gate_up"])
    torch.testing.assert_close(state["model.layers.1.mlp.experts.down_proj"], dequantized[1]["down"])
    torch.testing.assert_close(forward_logits(model, family, ids, mask), offloaded_logits, rtol=1e-4, atol=1e-4)


def test_enable_quantizes_a_built_model(tiny_models, tmp_path):
    model = reference("switch_transformers", tiny_models["switch_transformers"])
    hf_moe_offload.enable(model, {"device": "cpu", "store": "disk", "expert_cache": "50%", "quantize": "int8"},
                          offload_folder=tmp_path / "q")
    ref = _dequantized_reference("switch_transformers", tiny_models["switch_transformers"], model)
    ids, mask = token_inputs(2, 10)
    torch.testing.assert_close(forward_logits(model, "switch_transformers", ids, mask),
                               forward_logits(ref, "switch_transformers", ids, mask), rtol=1e-4, atol=1e-4)
    with pytest.raises(PolicyError, match="disable"):
        model.half()                                    # still guarded, in the compute dtype (not uint8)


# -- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["fp8", "mxfp4", "gptq"])
def test_checkpoint_with_quantized_weights_is_refused_naming_the_method(tmp_path, method):
    path = build_tiny("mixtral", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    # fp8 without weight_block_size (per-tensor scales) is not the fine-grained layout that is read: refused too,
    # and the message lists what is read.
    with pytest.raises(PolicyError, match=f"quant_method='{method}'.*float32, float16, bfloat16.*quant_method='fp8' "
                                          f"with weight_block_size"):
        _load("mixtral", path, store="disk", expert_cache="50%")


@pytest.mark.parametrize("policy,allowed", [({"quantize": "int3"}, r"\['none', 'int8', 'int4'\]"),
                                            ({"quantize": "int4", "quant_group_size": 48}, "32, 64, 128")])
def test_bad_quantize_values_are_refused(tiny_models, policy, allowed):
    with pytest.raises(PolicyError, match=allowed):
        _load("mixtral", tiny_models["mixtral"], store="disk", **policy)


@pytest.mark.skipif(not hf_moe_offload.storage.quantize.cpu_int4_available(), reason="torch's CPU int4 kernel is unavailable")
def test_a_cpu_folder_stores_the_kernel_format_and_is_told_apart_from_plain_files(tmp_path):
    """Files made for the CPU hold torch's CPU int4 format (no repack per read); their fingerprint names it, so a
    folder of plain slabs (for another device) is never read as one."""
    from hf_moe_offload.storage.quantize import packing_signature
    from hf_moe_offload.storage.spill import quantized_fingerprint, write_quantized

    dense = SlabLayout(parts=(("up", (32, 64)),))
    cpu = QuantizedSlabLayout.build(dense, "int4", 32, torch.float32, packing="cpu")
    plain = cpu.with_packing("plain")
    source = tmp_path / "source.bin"
    source.write_bytes(b"x")
    assert packing_signature([plain]) == "plain" and packing_signature([cpu]).startswith("cpu-int4")
    assert quantized_fingerprint([str(source)], [cpu]) != quantized_fingerprint([str(source)], [plain])
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    written = write_quantized(str(tmp_path / "q"), "fp", [cpu], [1], lambda layer, e: {"up": w})
    store = hf_moe_offload.storage.store.DiskStore([_FakeLayer(dense)], written.pieces, torch.float32, layouts=[cpu],
                                                   checksums=written.checksums)
    slab = torch.empty(cpu.numel, dtype=torch.uint8)
    store.read_into(0, 0, slab)
    expected = torch.empty(cpu.numel, dtype=torch.uint8)
    cpu.quantize_into({"up": w}, expected)
    assert torch.equal(slab, expected)
    store.close()


class _FakeLayer:
    def __init__(self, layout):
        self.layout, self.num_experts = layout, 1
