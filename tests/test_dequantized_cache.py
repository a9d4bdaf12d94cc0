"""Checkpoint-quantized experts (GGUF blocks, GPTQ packing) on the CPU: the store keeps the quantized bytes and each
expert is dequantized once, as it enters a dense cache slot (`storage.dequantizing_store`).

What users rely on: the same tokens and logits as before (slots bit-identical to the compute-time dequantization,
which the CUDA cache still uses and `quantized_slots` forces here), slots of the model dtype, the quantized bytes
read per miss, no second dequantization on a hit, and a cache budget that counts the dense slabs it holds.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_moe_offload
import hf_moe_offload.loading.load as load_module
import hf_moe_offload.storage.dequantizing_store as dequantizing_store
from conftest import token_inputs
from gguf_checkpoints import Q4_K_M, write_gguf
from hf_moe_offload.storage.dequantizing_store import DequantizingStore
from hf_moe_offload.storage.gguf_layout import GGUFSlabLayout
from hf_moe_offload.storage.packed_layout import PackedSlabLayout
from hf_moe_offload.storage.store import CpuStore, DiskStore
from test_gptq_awq import _gptq_checkpoint, _offloaded

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 4], [3, 3, 250, 17, 8, 61, 90, 12]])
DISK = {"device": "cpu", "store": "disk", "expert_cache": "30%"}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gguf_dense")
    write_gguf(str(folder / "tiny-Q4_K_M.gguf"), experts=Q4_K_M)
    return str(folder)


def _quantized_slots(load):
    """`load()` with a cache that keeps the quantized bytes and dequantizes at every use (CUDA's default)."""
    with pytest.MonkeyPatch.context() as patch:
        for module in (dequantizing_store, load_module):
            patch.setattr(module, "dense_slots_on", lambda device: False)
        return load()


def _gguf(folder: str, policy: dict, dtype: torch.dtype | None = None):
    kwargs = {} if dtype is None else {"dtype": dtype}
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny-Q4_K_M.gguf", offload_policy=policy,
                                                **kwargs)


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _generate(model):
    return model.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0)


def _assert_slots_are_the_dequantized_experts(engine) -> None:
    """Every resident slot holds, bit for bit, what the quantized layout's own dequantization gives."""
    store = engine.store
    for (layer, expert), slot in engine.cache.resident.items():
        if slot.load is not None:        # a read ahead of need (the next pass's, a guess) may still be landing
            slot.load.wait()
        layout = store.quantized_layouts[layer]
        raw = torch.empty(layout.numel, dtype=torch.uint8)
        store.inner.read_into(layer, expert, raw)
        dense = store.layouts[layer].views(engine.cache.memory[slot.index][:store.layouts[layer].numel])
        for name, expected in layout.dequantize(raw).items():
            assert torch.equal(dense[name], expected), (layer, expert, name)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_gguf_dense_slots_give_the_quantized_slots_tokens(gguf_file, dtype):
    dense = _gguf(gguf_file, DISK, dtype)
    engine = hf_moe_offload.get_engine(dense)
    assert isinstance(engine.store, DequantizingStore) and isinstance(engine.store.inner, DiskStore)
    assert engine.cache.memory.dtype == dense.dtype                  # slots hold the model dtype ...
    assert engine.cache.slot_numel == max(lay.numel for lay in engine.store.layouts)    # ... dense slabs
    tokens, logits = _generate(dense), _logits(dense)
    _assert_slots_are_the_dequantized_experts(engine)
    assert hf_moe_offload.stats(dense)["misses"] > 0
    quantized = _quantized_slots(lambda: _gguf(gguf_file, DISK, dtype))
    assert hf_moe_offload.get_engine(quantized).cache.memory.dtype == torch.uint8
    assert torch.equal(tokens, _generate(quantized))
    torch.testing.assert_close(logits, _logits(quantized), rtol=1e-5, atol=1e-5)   # same weights; matmul last bit


def test_disk_bytes_per_miss_stay_quantized(gguf_file):
    q_store = hf_moe_offload.get_engine(_quantized_slots(lambda: _gguf(gguf_file, DISK))).store
    per_expert = [q_store.slab_bytes(i) for i in range(len(q_store.layouts))]
    dense = _gguf(gguf_file, DISK)
    engine = hf_moe_offload.get_engine(dense)
    assert [engine.store.slab_bytes(i) for i in range(len(per_expert))] == per_expert
    assert engine.store.total_bytes == q_store.total_bytes
    dense_slab = engine.cache.slot_bytes
    assert dense_slab > 3 * max(per_expert)                           # Q4_K_M against float32
    hf_moe_offload.stats(dense).reset()
    _logits(dense, IDS[:1])
    s = hf_moe_offload.stats(dense)
    assert s["misses"] > 0
    reads = [layer["misses"] + layer["prefetch_issued"] for layer in s["per_layer"]]
    assert s["bytes_to_device"] == sum(n * nbytes for n, nbytes in zip(reads, per_expert))   # quantized per read
    assert s["resident_bytes"] == len(engine.cache.resident) * dense_slab      # the cache counts dense slabs


def test_a_hit_does_not_dequantize_again(gguf_file, monkeypatch):
    calls, mine = [], []
    original = GGUFSlabLayout.dequantize_into

    def counted(self, slab, out):
        # This model's layouts only: another test's model may still finish a read in the background (a streamed
        # pass reads the next pass's first experts as it ends).
        if any(self is layout for layout in mine):
            calls.append(1)
        return original(self, slab, out)
    monkeypatch.setattr(GGUFSlabLayout, "dequantize_into", counted)
    # No speculative loads: every read is a demand miss, finished when the forward returns.
    model = _gguf(gguf_file, {"device": "cpu", "store": "disk", "expert_cache": "100%", "prefetch": "none",
                              "schedule": "on_demand"})
    mine.extend(hf_moe_offload.get_engine(model).store.quantized_layouts)
    _logits(model)
    s = hf_moe_offload.stats(model)
    assert len(calls) == s["misses"] > 0                              # one dequantization per expert read
    hf_moe_offload.stats(model).reset()
    before = len(calls)
    _logits(model)
    s = hf_moe_offload.stats(model)
    assert s["hits"] > 0 and s["misses"] == 0
    assert len(calls) == before                                       # every expert was a hit: none dequantized


def test_host_store_stays_quantized_behind_a_dense_cache(gguf_file):
    model = _gguf(gguf_file, {"device": "cpu", "store": "cpu", "expert_cache": "25%"})   # a budget is honoured
    engine = hf_moe_offload.get_engine(model)
    assert not engine.cache.zero_copy
    inner = engine.store.inner
    assert isinstance(inner, CpuStore) and inner.slabs[0].dtype == torch.uint8
    dense_total = sum(lay.numel * n for lay, n in zip(engine.store.layouts, engine.store.num_experts)) * 4
    assert engine.cache.num_slots == int(0.25 * dense_total) // engine.cache.slot_bytes   # "25%" of dense bytes
    assert sum(s.numel() for s in inner.slabs) < dense_total / 3      # the host holds the quantized bytes
    reference = _gguf(gguf_file, DISK)
    assert torch.equal(_generate(model), _generate(reference))
    _assert_slots_are_the_dequantized_experts(engine)


def test_auto_budget_plans_with_the_dense_slot(gguf_file):
    model = _gguf(gguf_file, {"device": "cpu", "store": "disk"})
    engine = hf_moe_offload.get_engine(model)
    dense_slab = max(lay.numel for lay in engine.store.layouts) * model.dtype.itemsize
    assert engine.cache.slot_bytes == dense_slab
    plan_cache = engine.cache.num_slots * engine.cache.slot_bytes
    dense_total = sum(lay.numel * n for lay, n in zip(engine.store.layouts, engine.store.num_experts)) * 4
    assert 0 < plan_cache <= dense_total                 # capped at every expert's dense bytes, not the quantized


def test_gptq_dense_slots_equal_the_dequantized_model(tmp_path, monkeypatch):
    packed, dense_path = _gptq_checkpoint(tmp_path, act_order=True)
    calls, mine = [], []
    original = PackedSlabLayout.dequantize_into

    def counted(self, slab, out):      # this model's layouts only (another model may finish a read meanwhile)
        if any(self is layout for layout in mine):
            calls.append(1)
        return original(self, slab, out)
    monkeypatch.setattr(PackedSlabLayout, "dequantize_into", counted)
    model = _offloaded(packed, store="disk", expert_cache="40%", prefetch="none", schedule="on_demand")
    engine = hf_moe_offload.get_engine(model)
    mine.extend(engine.store.quantized_layouts)
    assert isinstance(engine.store, DequantizingStore) and engine.cache.memory.dtype == model.dtype
    ref = AutoModelForCausalLM.from_pretrained(dense_path).eval()
    ids, mask = token_inputs(3, 8, seed=2, left_pad=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    s = hf_moe_offload.stats(model)
    assert len(calls) == s["misses"] > 0                              # one dequantization per expert read
    _assert_slots_are_the_dequantized_experts(engine)
