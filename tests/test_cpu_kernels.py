"""The CPU kernels for bfloat16 matmuls (`memory.cpu_kernels`): prepacked oneDNN weights with the same bits as
`F.linear`, only for registered memory, within the budget, built once, remade after an in-place write, gone after
`disable()`; the model's own linear layers routed through them and given back; the opt-in compiled one-row product
within a rounding of `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_moe_offload
from conftest import build_tiny, forward_logits, offloaded, reference, token_inputs
from hf_moe_offload.memory import cpu_kernels
from hf_moe_offload.memory.cpu_kernels import PrepackedWeights, linear, prepack_budget, prepack_supported

pytestmark = pytest.mark.skipif(not prepack_supported(torch.bfloat16), reason="oneDNN has no bf16 on this CPU")

SHAPES = [(7168, 1024), (1024, 3584), (64, 32), (96, 40), (200, 33)]


ONE_ULP = dict(rtol=2**-7, atol=1e-6)     # bfloat16 keeps 8 bits: one rounding apart


@pytest.fixture
def no_compiled_gemv(monkeypatch):
    monkeypatch.setattr(cpu_kernels._COMPILED_GEMV, "fn", None)


def test_the_compiled_product_is_opt_in(monkeypatch):
    assert cpu_kernels._CompiledGemv().fn is None
    monkeypatch.setenv(cpu_kernels.GEMV_ENV, "1")
    assert cpu_kernels._CompiledGemv().fn is not None


@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_one_row_product_is_within_a_rounding_of_f_linear(shape, monkeypatch):
    monkeypatch.setenv(cpu_kernels.GEMV_ENV, "1")
    gemv = cpu_kernels._CompiledGemv()
    n, k = shape
    torch.manual_seed(0)
    weight, x = torch.randn(n, k).to(torch.bfloat16), torch.randn(1, k).to(torch.bfloat16)
    out = gemv(x, weight)
    assert out is not None, "compiling the one-row product failed on this machine"
    torch.testing.assert_close(out, F.linear(x, weight), **ONE_ULP)
    exact = (x.double() @ weight.double().T)
    assert (out.double() - exact).abs().max() <= (F.linear(x, weight).double() - exact).abs().max() * 2 + 1e-6


def test_a_failed_compile_falls_back_once_with_a_warning(monkeypatch, caplog):
    def broken(x, w):
        raise RuntimeError("no C++ compiler")

    gemv = cpu_kernels._CompiledGemv()
    gemv.fn = broken
    monkeypatch.setattr(cpu_kernels, "_COMPILED_GEMV", gemv)
    weight, x = torch.randn(64, 32).to(torch.bfloat16), torch.randn(1, 32).to(torch.bfloat16)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert gemv.fn is None and "unavailable" in caplog.text


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_prepacked_linear_equals_f_linear_bit_for_bit(shape, rows, no_compiled_gemv):
    n, k = shape
    torch.manual_seed(rows)
    slab = torch.randn(2, n * k).to(torch.bfloat16)            # two "experts" of one part each
    x = torch.randn(rows, k).to(torch.bfloat16)
    with PrepackedWeights([slab], budget_bytes=1 << 30) as packed:
        for e in range(2):
            weight = slab[e].view(n, k)
            assert torch.equal(linear(x, weight), F.linear(x, weight))
        assert packed.packed_bytes == slab.numel() * 2


def test_a_weight_written_in_place_is_packed_again():
    weight = torch.randn(64, 32).to(torch.bfloat16)
    x = torch.randn(2, 32).to(torch.bfloat16)
    with PrepackedWeights([weight], budget_bytes=weight.nbytes) as packed:
        linear(x, weight)
        weight.mul_(2)
        assert torch.equal(linear(x, weight), F.linear(x, weight))
        assert packed.packed_bytes == weight.nbytes


def test_inference_tensors_are_packed_too():
    with torch.inference_mode():
        slab = torch.randn(2, 64 * 32).to(torch.bfloat16)
        x = torch.randn(3, 32).to(torch.bfloat16)
        with PrepackedWeights([slab], budget_bytes=1 << 20) as packed:
            for _ in range(2):
                assert torch.equal(linear(x, slab[1].view(64, 32)), F.linear(x, slab[1].view(64, 32)))
            assert packed.packed_bytes == 64 * 32 * 2


def test_three_dimensional_input_keeps_its_shape(no_compiled_gemv):
    slab = torch.randn(64 * 32).to(torch.bfloat16)
    x = torch.randn(2, 3, 32).to(torch.bfloat16)
    with PrepackedWeights([slab], budget_bytes=1 << 20):
        assert torch.equal(linear(x, slab.view(64, 32)), F.linear(x, slab.view(64, 32)))


def test_only_registered_memory_within_the_budget_is_packed(no_compiled_gemv):
    inside = torch.randn(3, 64 * 32).to(torch.bfloat16)
    outside = torch.randn(64, 32).to(torch.bfloat16)
    x = torch.randn(1, 32).to(torch.bfloat16)
    one_weight = 64 * 32 * 2
    with PrepackedWeights([inside], budget_bytes=one_weight) as packed:
        assert packed.packed(outside) is None                  # not registered: F.linear
        assert packed.packed(inside[0].view(64, 32)) is not None
        assert packed.packed(inside[1].view(64, 32)) is None   # over the budget
        assert packed.packed_bytes == one_weight
        first = packed.packed(inside[0].view(64, 32))
        assert packed.packed(inside[0].view(64, 32)) is first  # built once
        assert torch.equal(linear(x, inside[1].view(64, 32)), F.linear(x, inside[1].view(64, 32)))
    assert packed not in cpu_kernels.active_registrations() and packed.packed_bytes == 0


def test_float32_weights_keep_f_linear():
    slab = torch.randn(64 * 32)
    with PrepackedWeights([slab], budget_bytes=1 << 20) as packed:
        linear(torch.randn(1, 32), slab.view(64, 32))
        assert packed.packed_bytes == 0


def test_budget_keeps_a_reserve_of_ram():
    assert prepack_budget(available=1 << 30, total=8 << 30) == 0
    assert prepack_budget(available=20 << 30, total=40 << 30) == (20 << 30) - 4 * (1 << 30)


@pytest.fixture(scope="module")
def bf16_mixtral(tmp_path_factory):
    return build_tiny("mixtral", tmp_path_factory.mktemp("bf16") / "mixtral", dtype=torch.bfloat16)


def test_cpu_store_prepacks_and_matches_the_unpacked_path_exactly(bf16_mixtral):
    ids, mask = token_inputs(2, 10)
    model = offloaded("mixtral", bf16_mixtral, device="cpu", store="cpu")
    plain = offloaded("mixtral", bf16_mixtral, device="cpu", store="disk", expert_cache="100%")   # slots: F.linear
    out = forward_logits(model, "mixtral", ids, mask)
    assert hf_moe_offload.stats(model)["prepacked_bytes"] > 0
    assert hf_moe_offload.stats(plain)["prepacked_bytes"] == 0
    assert torch.equal(out, forward_logits(plain, "mixtral", ids, mask))
    ref = reference("mixtral", bf16_mixtral)
    torch.testing.assert_close(out.float(), forward_logits(ref, "mixtral", ids, mask).float(), rtol=2e-2, atol=2e-2)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_own_linear_layers_take_the_kernels_and_are_given_back(bf16_mixtral):
    model = offloaded("mixtral", bf16_mixtral, device="cpu", store="cpu")
    q_proj = model.model.layers[0].self_attn.q_proj
    assert "forward" in q_proj.__dict__ and "forward" in model.lm_head.__dict__
    x = torch.randn(1, 1, q_proj.in_features).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(q_proj(x), F.linear(x, q_proj.weight))
    experts = hf_moe_offload.get_engine(model).store.total_bytes      # packed at load: the experts' only memory
    assert hf_moe_offload.stats(model)["prepacked_bytes"] == q_proj.weight.nbytes + experts
    assert set(model.state_dict()) == set(reference("mixtral", bf16_mixtral).state_dict())
    hf_moe_offload.disable(model)
    assert "forward" not in q_proj.__dict__ and "forward" not in model.lm_head.__dict__


def test_state_dict_and_disable_read_the_store_not_the_packed_copies(bf16_mixtral):
    ids, mask = token_inputs(1, 6)
    model = offloaded("mixtral", bf16_mixtral, device="cpu", store="cpu")
    forward_logits(model, "mixtral", ids, mask)
    packed = hf_moe_offload.get_engine(model).cache.cpu.prepacked
    assert packed is not None and packed.packed_bytes > 0
    ref_state = reference("mixtral", bf16_mixtral).state_dict()
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in ref_state.items())
    hf_moe_offload.disable(model)
    assert packed not in cpu_kernels.active_registrations() and packed.packed_bytes == 0
    restored = model.state_dict()
    assert all(torch.equal(restored[name], tensor) for name, tensor in ref_state.items())


def test_weight_read_rates_and_the_profile_field():
    from hf_moe_offload.planning.measure import weight_read_rates
    from hf_moe_offload.planning.profile import MachineProfile, ProfileError

    active = set(cpu_kernels.active_registrations())           # other tests' models may still be alive
    rates = weight_read_rates(nbytes=1 << 20, hidden=64, seconds=0, threads=(1,))
    assert sorted(rates) == ["bf16_1t", "int4_1t", "int8_1t", "stream_1t"] and min(rates.values()) > 0
    assert set(cpu_kernels.active_registrations()) <= active   # its registration is closed
    p = MachineProfile(name="x", source="test", disk_read_bytes_per_s=2e9, host_memcpy_bytes_per_s=1e10,
                       cpu_flops_bf16_batch1=5e9, cpu_flops_bf16_large=1e11, cpu_flops_fp32_batch1=5e9,
                       cpu_flops_fp32_large=1e11, cpu_threads=2, host_memory_bytes=1 << 34,
                       weight_read_bytes_per_s=rates)
    assert MachineProfile.from_dict(p.to_dict()) == p and "weight reads" in p.summary()
    with pytest.raises(ProfileError, match="weight_read_bytes_per_s"):
        MachineProfile.from_dict({**p.to_dict(), "weight_read_bytes_per_s": {"bf16_1t": -1}})


def test_default_threads_leave_the_busy_cores_and_respect_a_choice(monkeypatch):
    from hf_moe_offload.memory import cpu_threads

    assert cpu_threads.free_cores(load=1.2, cpus=8) == 6 and cpu_threads.free_cores(load=9.0, cpus=2) == 1
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: before)
        monkeypatch.setattr(cpu_threads, "free_cores", lambda: 1)
        restore = cpu_threads.apply_default_threads()
        assert torch.get_num_threads() == 1 and (restore is not None or before == 1)
        if restore is not None:
            restore()
        assert torch.get_num_threads() == before
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")                         # sleeping waits keep every core
        assert cpu_threads.apply_default_threads() is None and torch.get_num_threads() == before
        monkeypatch.delenv("OMP_WAIT_POLICY")
        monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: before + 1)      # the user set another count
        assert cpu_threads.apply_default_threads() is None and torch.get_num_threads() == before
        monkeypatch.setenv(cpu_threads.THREADS_ENV, "1")
        restore = cpu_threads.apply_default_threads()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv(cpu_threads.THREADS_ENV, "zero")
        with pytest.raises(ValueError, match="HF_MOE_OFFLOAD_THREADS"):
            cpu_threads.apply_default_threads()
    finally:
        torch.set_num_threads(before)


def test_this_processs_own_load_is_not_taken_for_a_neighbours(monkeypatch):
    """The 1-minute load average counts this process too (its load just kept every core busy): what other
    processes keep busy in a short sample bounds it, with this process's own CPU time taken out."""
    from collections import namedtuple

    from hf_moe_offload.memory import cpu_threads

    Machine = namedtuple("Machine", "user system idle iowait")
    Own = namedtuple("Own", "user system")
    clock = {"machine": [Machine(0, 0, 0, 0), None], "own": [Own(0, 0), None]}

    def sample(machine_busy: float, own_busy: float):       # cores busy over the window, all / this process's
        window = cpu_threads.SAMPLE_S
        clock["machine"][1] = Machine(machine_busy * window, 0, 1, 0)
        clock["own"][1] = Own(own_busy * window, 0)
        calls = {"machine": 0, "own": 0}

        def machine_times():
            calls["machine"] += 1
            return clock["machine"][calls["machine"] - 1]

        class Process:
            def cpu_times(self):
                calls["own"] += 1
                return clock["own"][calls["own"] - 1]
        monkeypatch.setattr(cpu_threads.psutil, "cpu_times", machine_times)
        monkeypatch.setattr(cpu_threads.psutil, "Process", Process)
        monkeypatch.setattr(cpu_threads.time, "sleep", lambda s: None)

    sample(machine_busy=2.0, own_busy=2.0)                   # only this process was busy
    assert cpu_threads.others_busy() == pytest.approx(0.0)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (1.9, 1.0, 0.5))
    sample(machine_busy=2.0, own_busy=2.0)
    assert cpu_threads.free_cores(cpus=2) == 2               # its own loading does not cost it a thread
    sample(machine_busy=2.0, own_busy=1.0)                   # a neighbour holds one core
    assert cpu_threads.others_busy() == pytest.approx(1.0)
    sample(machine_busy=2.0, own_busy=1.0)
    assert cpu_threads.free_cores(cpus=2) == 1


def test_a_model_dropped_without_disable_takes_its_prepacked_weights_along():
    """The registrations `linear` consults are weak: a model deleted without `disable()` (a notebook's reload, an
    evaluation loop) frees its slabs and packed copies instead of keeping them for the life of the process."""
    import gc
    import weakref

    from hf_moe_offload.demo import DEMO_MODEL
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.bfloat16,
                                                 offload_policy={"device": "cpu", "store": "cpu"})
    model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    registrations = [weakref.ref(r) for r in hf_moe_offload.get_engine(model).stats.prepacked]
    assert registrations and any(r().packed_bytes > 0 for r in registrations)
    del model
    gc.collect()
    assert all(r() is None for r in registrations)


def test_copies_are_made_only_where_the_cpu_computes_bf16_itself(monkeypatch):
    """oneDNN emulates bf16 on AVX-512 CPUs without avx512_bf16, where the packed kernel and F.linear may sum in
    different orders: no packed copies there, F.linear's bits."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not prepack_supported(torch.bfloat16)
