"""The parts of the GPU path's fixes that hold or fail on the CPU too: reference lifetimes at enable, host memory
at disable, the "auto" headroom for quantized experts, continuous batching's KV sizing and CUDA graphs, a failed
host-memory registration, and the device-side quantized matmul's arithmetic."""

from __future__ import annotations

import contextlib
import logging
import types
import weakref

import pytest
import torch
from transformers import ContinuousBatchingConfig

import hf_moe_offload
from conftest import reference
from hf_moe_offload.batching import config as batching_config
from hf_moe_offload.layout import SlabLayout
from hf_moe_offload.memory import cache as cache_module
from hf_moe_offload.planning import footprint as footprint_module
from hf_moe_offload.planning.footprint import CUDA_HEADROOM_FLOOR, Footprint, headroom_bytes
from hf_moe_offload.policy.offload_policy import PolicyError
from hf_moe_offload.runtime import engine as engine_module
from hf_moe_offload.storage import store as store_module
from hf_moe_offload.storage.quantize import QuantizedSlabLayout


def test_enable_keeps_no_expert_parameter_alive_when_the_cache_is_allocated(tiny_models, monkeypatch):
    """The experts' memory (on a GPU: device memory) is free by the time the cache asks for its own."""
    model = reference("mixtral", tiny_models["mixtral"])
    arch_layers = hf_moe_offload.arch.get_arch(model.config).find_layers(model)
    refs = [weakref.ref(p) for lay in arch_layers for p in lay.module.parameters()]
    del arch_layers
    alive_at_allocation = []
    original = cache_module.ExpertCache.__init__

    def watching_init(self, *args, **kwargs):
        import gc   # noqa: PLC0415 (test-only: collect cycles before looking at the weakrefs)
        gc.collect()
        alive_at_allocation.append(sum(r() is not None for r in refs))
        original(self, *args, **kwargs)

    monkeypatch.setattr(cache_module.ExpertCache, "__init__", watching_init)
    hf_moe_offload.enable(model, {"device": "cpu", "store": "disk", "expert_cache": "50%"})
    assert alive_at_allocation == [0]
    hf_moe_offload.disable(model)


def test_a_failed_attach_restores_every_layer_after_emptying_what_it_allocated(tiny_models, monkeypatch):
    model = reference("mixtral", tiny_models["mixtral"])
    before = {n: p.clone() for n, p in model.named_parameters()}

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(engine_module, "ExpertCache", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        hf_moe_offload.enable(model, {"device": "cpu", "store": "disk", "expert_cache": "50%"})
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_disable_with_a_host_store_restores_one_layer_at_a_time_and_frees_its_host_copy(tiny_models, monkeypatch):
    """No second full host copy of every expert: each layer is read, restored and released before the next."""
    model = reference("mixtral", tiny_models["mixtral"])
    hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
    engine = hf_moe_offload.runtime.engine.get_engine(model)
    store = engine.store
    total = store.total_bytes
    outstanding, peaks = [], []
    read, set_params = engine_module.read_layer_experts, engine.arch.set_expert_params

    def reading(store_, layer, device):
        outstanding.append(layer.index)
        held = sum(s.nbytes for s in store.slabs)                      # the store's host copy still alive
        peaks.append(held + sum(store.slab_bytes(i) * store.num_experts[i] for i in outstanding))
        assert len(outstanding) == 1, "a layer was read before the previous one was restored"
        return read(store_, layer, device)

    def setting(module, params):
        set_params(module, params)
        outstanding.pop()

    monkeypatch.setattr(engine_module, "read_layer_experts", reading)
    monkeypatch.setattr(engine.arch, "set_expert_params", setting)
    hf_moe_offload.disable(model)
    assert len(peaks) == len(engine.layers)
    one_layer = max(store.slab_bytes(i) * n for i, n in enumerate(store.num_experts))
    assert max(peaks) <= total + one_layer
    assert all(s.numel() == 0 for s in store.slabs)


def _footprint(**kwargs) -> Footprint:
    return Footprint(expert_bytes=1 << 30, slab_bytes=1 << 20, resident_bytes=1 << 28, top_k=2,
                     kv_bytes_per_token=1024, activation_bytes_per_token=4096, **kwargs)


def test_the_cuda_headroom_grows_with_quantized_experts_and_the_cpu_one_does_not():
    dense = SlabLayout(parts=(("gate_up", (512, 256)), ("down", (256, 256))))
    int8 = QuantizedSlabLayout.build(dense, "int8", 64, torch.bfloat16)
    int4 = QuantizedSlabLayout.build(dense, "int4", 64, torch.bfloat16)
    assert int8.dequant_workspace_bytes == 512 * 256 * 2
    assert int4.dequant_workspace_bytes > 0
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    plain = headroom_bytes(cuda, _footprint(), 1, 128)
    quantized = headroom_bytes(cuda, _footprint(dequant_workspace_bytes=int8.dequant_workspace_bytes), 1, 128)
    assert quantized == plain + int8.dequant_workspace_bytes
    assert headroom_bytes(cpu, _footprint(dequant_workspace_bytes=1 << 20), 1, 128) == \
        headroom_bytes(cpu, _footprint(), 1, 128)


def test_the_footprint_of_quantized_layouts_carries_their_workspace(tiny_models):
    model = reference("mixtral", tiny_models["mixtral"])
    layers = hf_moe_offload.arch.get_arch(model.config).find_layers(model)
    quantized = [QuantizedSlabLayout.build(lay.layout, "int4", 32, torch.float32) for lay in layers]
    fp = footprint_module.footprint(model, layers, torch.float32, quantized)
    assert fp.dequant_workspace_bytes == max(q.dequant_workspace_bytes for q in quantized) > 0
    assert footprint_module.footprint(model, layers, torch.float32).dequant_workspace_bytes == 0


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_device_quantized_matmul_matches_dequantize_then_linear(method, monkeypatch):
    """The CUDA path's arithmetic (no float32 copy of the whole weight), run on CPU tensors."""
    torch.manual_seed(0)
    dense = SlabLayout(parts=(("w", (96, 64)),))
    layout = QuantizedSlabLayout.build(dense, method, 32, torch.float32)
    slab = torch.empty(layout.numel, dtype=torch.uint8)
    layout.quantize_into({"w": torch.randn(96, 64)}, slab)
    weight = layout.views(slab)["w"]
    monkeypatch.setattr("hf_moe_offload.storage.quantize.INT4_CHUNK_ELEMENTS", 32 * 64)   # three row chunks
    x = torch.randn(5, 64)
    expected = torch.nn.functional.linear(x, weight.dequantize())
    torch.testing.assert_close(weight._device_linear(x), expected, rtol=1e-5, atol=1e-5)


def test_free_cuda_bytes_count_torch_cached_blocks_and_respect_the_memory_fraction(monkeypatch):
    cuda = footprint_module.torch.cuda
    monkeypatch.setattr(cuda, "mem_get_info", lambda d: (10 << 30, 80 << 30))
    monkeypatch.setattr(cuda, "memory_allocated", lambda d: 20 << 30)
    monkeypatch.setattr(cuda, "memory_reserved", lambda d: 25 << 30)
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d: 1.0)
    assert footprint_module.free_bytes(torch.device("cuda", 0)) == 15 << 30   # driver free + cached-unused
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d: 0.3)
    assert footprint_module.free_bytes(torch.device("cuda", 0)) == 4 << 30    # 24 GiB cap - 20 allocated


def test_generate_batch_grants_extra_kv_only_beyond_the_planned_activations_and_floor(monkeypatch):
    config = types.SimpleNamespace()
    model = types.SimpleNamespace(config=config, dtype=torch.bfloat16)
    engine = types.SimpleNamespace(policy=types.SimpleNamespace(device="cuda:0", max_batch_size=1, max_seq_len=4096),
                                   devices=None)
    per_token = {"kv_bytes_per_token": 128 << 10, "activation_bytes_per_token": 512 << 10, "max_positions": 0}
    monkeypatch.setattr(batching_config, "sequence_costs", lambda c, d: per_token)
    free = 4096 * (512 << 10) + CUDA_HEADROOM_FLOOR + (512 << 20)    # the plan's activations + floor + 512 MiB
    monkeypatch.setattr(batching_config.torch.cuda, "mem_get_info", lambda d: (free, 80 << 30))
    blocks = batching_config._blocks_in_free_memory(model, engine, page_size=256)
    block_bytes = 256 * (128 << 10)
    assert blocks == int((512 << 20) * batching_config.KV_FREE_SHARE[True] // block_bytes)
    monkeypatch.setattr(batching_config.torch.cuda, "mem_get_info", lambda d: (free - (512 << 20), 80 << 30))
    assert batching_config._blocks_in_free_memory(model, engine, page_size=256) == 0


def test_a_given_continuous_batching_config_gets_cuda_graphs_off_with_a_log_line(caplog):
    given = ContinuousBatchingConfig()
    assert given.use_cuda_graph is None
    with caplog.at_level(logging.INFO, logger=batching_config.logger.name):
        off = batching_config.without_cuda_graphs(given)
    assert off.use_cuda_graph is False and given.use_cuda_graph is None     # a copy: the user's is unchanged
    assert any("use_cuda_graph=False" in r.getMessage() for r in caplog.records)
    assert batching_config.without_cuda_graphs(off) is off
    with pytest.raises(PolicyError, match="use_cuda_graph"):
        batching_config.without_cuda_graphs(ContinuousBatchingConfig(use_cuda_graph=True))


def test_a_failed_host_registration_clears_the_cuda_last_error_and_names_the_fallback(monkeypatch):
    calls = []

    class FakeRuntime:
        def cudaHostRegister(self, address, nbytes, flags):
            return 2                       # cudaErrorMemoryAllocation

        def cudaGetErrorString(self, code):
            return "out of memory"

    class FakeLoaded:
        def cudaGetLastError(self):
            calls.append("cleared")
            return 2

    monkeypatch.setattr(store_module.torch.cuda, "cudart", lambda: FakeRuntime())
    monkeypatch.setattr(store_module.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(store_module, "_loaded_cudart", lambda: FakeLoaded())
    memory = store_module.HostMemory(torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="store='disk'") as err:
        memory.empty((1024,), torch.float32)
    assert calls == ["cleared"]
    assert "out of memory" in str(err.value)
    assert memory.pinned_bytes == 0


def test_a_lookahead_guess_whose_copy_has_not_landed_is_skipped_without_waiting():
    """Waiting on the guess's copy event would be a host sync of its own: the guess is ranked only once the copy
    has landed (a query), else that sample is skipped."""
    from hf_moe_offload.runtime.lookahead_gate import _PendingGuess

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

        def synchronize(self):
            raise AssertionError("a guess must never wait for its copy")

    counts = torch.tensor([0, 3, 1, 3])
    assert _PendingGuess(counts, Event(False)).ranked() is None
    assert _PendingGuess(counts, Event(True)).ranked() == [1, 3, 2]
