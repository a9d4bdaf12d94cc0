"""CPU compute of missing experts (`expert_compute`) and the static resident split (`resident_layers`).

On a machine without a GPU both sides are the CPU: a disk store with a CPU device has cache slots AND host reads,
so "cpu" computes a miss from a host buffer while "device" copies it into a slot, through the same code as on CUDA.
"auto" on the CPU device has a fixed rule (documented in placement.py); the tests inject the measurements of a
machine where the two sides differ, so that its decisions really split between the CPU and copies.
"""

from __future__ import annotations

import logging

import pytest
import torch

import hf_moe_offload
from conftest import forward_logits, offloaded, reference, token_inputs
from hf_moe_offload.memory.placement import ExpertPlacement, token_bucket
from hf_moe_offload.planning.resolve import check_placement
from hf_moe_offload.policy.offload_policy import OffloadPolicy, PolicyError

FAMILIES = ["mixtral", "qwen3_moe", "switch_transformers"]
DISK = dict(device="cpu", store="disk")
MODES = {
    "cpu": dict(expert_compute="cpu"),
    "auto": dict(expert_compute="auto", expert_cache="50%"),
    "device+resident": dict(expert_compute="device", resident_layers=1, expert_cache="100%"),
    "cpu+resident": dict(expert_compute="cpu", resident_layers=1),
}


def gpu_like_placement() -> ExpertPlacement:
    """Measurements of a machine with a slow link: an 18 KiB tiny expert computes on the CPU for 1-2 tokens and
    is copied from 4 tokens on (see test_auto_decision_few_tokens_on_cpu_many_copied)."""
    return ExpertPlacement(same_memory=False, host_store=False, h2d_bytes_per_s=1e6, host_bytes_per_s=1e9,
                           cpu_flops=1.5e6)


def _inject(model, placement: ExpertPlacement) -> None:
    """Replace the CPU device's fixed rule by `placement`, and stop online measurements from overriding it (the
    tiny experts compute in microseconds, which would send every bucket to the CPU)."""
    cache = hf_moe_offload.get_engine(model).cache
    placement.record_cpu = lambda tokens, seconds: None
    cache.placement = placement
    cache.stats.placement = placement.measurements


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_and_logits_match_the_unpatched_model(tiny_models, family, mode):
    path = tiny_models[family]
    ids, mask = token_inputs(3, 8, seed=2, left_pad=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = reference(family, path)
    expected, ref_logits = ref.generate(ids, **kwargs), forward_logits(ref, family, ids, mask)
    model = offloaded(family, path, **DISK, **MODES[mode])
    if mode == "auto":
        _inject(model, gpu_like_placement())
    assert torch.equal(model.generate(ids, **kwargs), expected)
    torch.testing.assert_close(forward_logits(model, family, ids, mask), ref_logits, rtol=1e-4, atol=1e-5)
    snap = hf_moe_offload.stats(model)
    assert snap["hits"] + snap["misses"] + snap["cpu_computed"] == snap["experts_used"]
    assert snap["peak_cache_bytes"] <= snap["cache_capacity_bytes"]
    if mode.startswith("cpu"):
        assert snap["misses"] == 0 and snap["bytes_to_device"] == 0 and snap["cpu_computed"] > 0
        slab = hf_moe_offload.get_engine(model).store.slab_bytes(0)
        assert snap["cpu_bytes_read"] == snap["cpu_computed"] * slab     # each CPU expert read once from disk
    if mode == "auto":                                   # few tokens on the CPU, the prefill's many copied
        assert snap["cpu_computed"] > 0 and snap["misses"] > 0
        assert snap["h2d_bytes_per_s"] == 1e6 and snap["cpu_flops"] == 1.5e6
    if mode.endswith("resident"):
        assert snap["per_layer"][0]["misses"] == snap["per_layer"][0]["cpu_computed"] == 0


def test_resident_layers_are_loaded_at_attach_and_never_evicted(tiny_models):
    """Budget = the resident layer + one top-k working set: layer 1 runs through 2 slots, layer 0 never moves."""
    path = tiny_models["mixtral"]
    engine_of = hf_moe_offload.get_engine
    model = offloaded("mixtral", path, **DISK, resident_layers=1, expert_cache=(6 + 2) * 18432)
    cache = engine_of(model).cache
    assert cache.num_slots == 8
    layer0 = {key: slot.index for key, slot in cache.resident.items() if key[0] == 0}
    assert sorted(e for _, e in layer0) == list(range(6))
    observed = []
    for layer in engine_of(model).layers:
        layer.module.register_forward_hook(lambda *_: observed.append(cache.resident_bytes()))
    ids, mask = token_inputs(3, 8, seed=4, left_pad=True)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    snap = hf_moe_offload.stats(model)
    assert snap["per_layer"][0]["misses"] == snap["per_layer"][0]["evictions"] == 0
    assert snap["per_layer"][0]["hits"] == snap["per_layer"][0]["experts_used"] > 0
    assert snap["per_layer"][1]["misses"] > 0 and snap["per_layer"][1]["evictions"] > 0   # the others did churn
    assert {key: slot.index for key, slot in cache.resident.items() if key[0] == 0} == layer0   # same slots
    assert max(observed) <= snap["cache_capacity_bytes"] == 8 * 18432
    assert snap["peak_cache_bytes"] <= snap["cache_capacity_bytes"]


def test_auto_decision_few_tokens_on_cpu_many_copied():
    nbytes, numel = 18432, 4608
    p = gpu_like_placement()
    assert [p.on_cpu(nbytes, numel, t) for t in (1, 2, 4, 8, 64)] == [True, True, False, False, False]
    # Mixtral-8x7B shapes on a PCIe 4 GPU with a 16-core CPU: one token's expert is cheaper on the CPU.
    big = ExpertPlacement(same_memory=False, host_store=True, h2d_bytes_per_s=25e9, host_bytes_per_s=60e9,
                          cpu_flops=1e12)
    assert big.on_cpu(352 << 20, 176 << 20, tokens=1) and not big.on_cpu(352 << 20, 176 << 20, tokens=512)
    # A measurement of the CPU time for a token bucket replaces the model's estimate for that bucket.
    p.record_cpu(tokens=8, seconds=1e-4)
    assert p.on_cpu(nbytes, numel, 8) and p.on_cpu(nbytes, numel, 7) and not p.on_cpu(nbytes, numel, 16)
    assert p.measurements()["cpu_expert_s"] == {8: pytest.approx(1e-4)}
    assert [token_bucket(t) for t in (1, 3, 8, 9)] == [1, 4, 8, 16]


def test_auto_decision_uses_the_copy_engines_measured_bandwidth():
    from hf_moe_offload.memory.copy_engine import TransferMeter

    meter = TransferMeter()
    p = ExpertPlacement(same_memory=False, host_store=True, h2d_bytes_per_s=1e12, host_bytes_per_s=1e9,
                        cpu_flops=1.5e6, copy_meter=meter)
    assert not p.on_cpu(18432, 4608, 1)          # calibrated link: copying is nearly free
    meter.record(18432, 0.018)                   # the copies actually made run at 1 MB/s
    assert p.on_cpu(18432, 4608, 1) and p.measurements()["h2d_bytes_per_s"] == pytest.approx(18432 / 0.018)


def test_auto_on_the_cpu_device_is_a_fixed_documented_rule(tiny_models, caplog):
    """Both sides are the same memory: host-memory experts compute in place, disk experts go into the cache."""
    assert ExpertPlacement(same_memory=True, host_store=True).on_cpu(1 << 30, 1 << 28, tokens=10_000)
    assert not ExpertPlacement(same_memory=True, host_store=False).on_cpu(1 << 30, 1 << 28, tokens=1)
    with caplog.at_level(logging.INFO, logger="hf_moe_offload"):
        model = offloaded("mixtral", tiny_models["mixtral"], **DISK, expert_compute="auto", expert_cache="50%")
        model(torch.randint(3, 96, (1, 5)))
        model(torch.randint(3, 96, (1, 5)))
    assert sum("expert_compute='auto' on the CPU device" in r.getMessage() for r in caplog.records) == 1
    snap = hf_moe_offload.stats(model)
    assert snap["cpu_computed"] == 0 and snap["misses"] > 0


def test_budget_too_small_for_the_resident_layers_names_the_smallest_that_works(tiny_models, monkeypatch):
    path = tiny_models["mixtral"]
    import hf_moe_offload.loading.load as loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the policy was refused")

    with monkeypatch.context() as patched:
        patched.setattr(loading, "_device_map", no_loading)   # the first step after the policy is resolved
        with pytest.raises(PolicyError, match=r"resident_layers=1 .*use at least expert_cache=147456") as err:
            offloaded("mixtral", path, **DISK, resident_layers=1, expert_cache=147455)
        assert "top-k working set" in str(err.value)
        with pytest.raises(PolicyError, match=r"resident_layers=3 is more than this model's 2 MoE layers; "
                                              r"allowed: 0 to 2"):
            offloaded("mixtral", path, **DISK, resident_layers=3)
        with pytest.raises(PolicyError, match=r"prefetch='lookahead' cannot work with expert_compute='cpu'.*"
                                              r"expert_compute='auto'"):
            offloaded("mixtral", path, **DISK, expert_compute="cpu", prefetch="lookahead")
    model = offloaded("mixtral", path, **DISK, resident_layers=1, expert_cache=147456)   # the named budget works
    assert hf_moe_offload.get_engine(model).cache.num_slots == 8


def test_cpu_compute_needs_only_the_resident_layers_budget():
    """With expert_compute='cpu' no other expert is copied: the budget is capped to the resident layers, and a
    budget below the top-k working set is fine."""
    policy = OffloadPolicy(expert_compute="cpu", resident_layers=1).validate()
    assert check_placement(policy, [6, 6], 100, 2, cache_bytes=10_000, zero_copy=False) == 600
    assert check_placement(OffloadPolicy(expert_compute="cpu"), [6, 6], 100, 2, 10_000, False) == 0
    with pytest.raises(PolicyError, match="use at least expert_cache=600"):
        check_placement(policy, [6, 6], 100, 2, cache_bytes=599, zero_copy=False)
    # All layers resident: no working set needed for others.
    every = OffloadPolicy(resident_layers=2).validate()
    assert check_placement(every, [6, 6], 100, 2, cache_bytes=1200, zero_copy=False) == 1200


def test_bad_expert_compute_values_are_refused_with_the_allowed_ones():
    with pytest.raises(PolicyError, match=r"expert_compute='gpu' is not allowed; allowed: \['device', 'cpu', "
                                          r"'auto'\]"):
        OffloadPolicy(expert_compute="gpu").validate()
    with pytest.raises(PolicyError, match="resident_layers=-1 is not allowed"):
        OffloadPolicy(resident_layers=-1).validate()


def test_quantized_experts_compute_on_the_cpu_like_on_the_device(tiny_models, tmp_path, monkeypatch):
    """quantize='int8' with expert_compute='cpu' runs the same quantized arithmetic from the host copy."""
    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))   # the quantized folder goes here
    path = tiny_models["mixtral"]
    ids, mask = token_inputs(3, 8, seed=2, left_pad=True)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    copied = offloaded("mixtral", path, **DISK, expert_cache="50%", quantize="int8")
    on_cpu = offloaded("mixtral", path, **DISK, quantize="int8", expert_compute="cpu")
    assert torch.equal(on_cpu.generate(ids, **kwargs), copied.generate(ids, **kwargs))
    assert hf_moe_offload.stats(on_cpu)["cpu_computed"] > 0 == hf_moe_offload.stats(on_cpu)["misses"]
