"""Budgets are honest: sizes parse exactly or are refused with the allowed range, an explicit budget is never
silently ignored, and "auto" sizes the device cache from the workload (KV cache, activations) and from the memory
that offloading frees. CUDA sizing is checked on the CPU with a mocked `torch.cuda`."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig, SwitchTransformersConfig

import hf_moe_offload
from hf_moe_offload import OffloadPolicy, PolicyError
from hf_moe_offload.planning.footprint import CUDA_HEADROOM_FLOOR, Footprint, sequence_costs
from hf_moe_offload.planning.resolve import resolve
from hf_moe_offload.policy.offload_policy import parse_size
from conftest import offloaded

GiB = 1 << 30
MiB = 1 << 20
# Mixtral-8x7B-like sizes, so the headroom terms have realistic weight.
FP = Footprint(expert_bytes=8 * GiB, slab_bytes=64 * MiB, resident_bytes=1 * GiB, top_k=2,
               kv_bytes_per_token=128 << 10, activation_bytes_per_token=256 << 10, max_positions=32768)
HEADROOM_1x4096 = 4096 * (384 << 10) + CUDA_HEADROOM_FLOOR      # 1.5 GiB of KV + activations, 0.5 GiB floor


@pytest.fixture
def log():
    """INFO records of the package's loggers (they propagate to transformers' logger, not to the root)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger, handler = logging.getLogger("hf_moe_offload"), Keep(logging.INFO)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


@pytest.fixture
def cuda(monkeypatch):
    """One fake CUDA device whose free memory the test sets: `cuda["free"] = bytes`."""
    state = {"free": 0, "total": 80 * GiB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], state["total"]))
    # Nothing allocated or cached by torch on the fake device, and no per-process memory fraction set.
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
    return state


# -- sizes ----------------------------------------------------------------------------------------------------------

def test_a_huge_size_is_exact_and_capped_to_all_expert_bytes_with_a_log(tiny_models, log):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="1" + "0" * 400)
    engine = hf_moe_offload.get_engine(model)
    all_experts = 2 * 6 * (2 * 48 * 32 + 32 * 48) * 4        # layers x experts x (gate_up + down) x float32
    assert engine.policy.expert_cache == all_experts
    assert any("is more than all expert bytes" in m and "capped to %d" % all_experts in m for m in log)


@pytest.mark.parametrize("value,match", [
    ("150%", r"expert_cache='150%' is outside 0%\.\.100%.*allowed: .*from '0%' to '100%'"),
    ("-1%", r"expert_cache='-1%' is outside 0%\.\.100%"),
    (-5, r"expert_cache=-5 is negative; allowed: a whole number of bytes >= 0"),
    ("-5GiB", r"expert_cache='-5GiB' is negative; allowed:"),
    ("nan", r"expert_cache='nan' is not a finite number; allowed:"),
    (float("inf"), r"expert_cache=inf is not a finite number; allowed:"),
    (float("nan"), r"expert_cache=nan is not a finite number; allowed:"),
    (True, r"expert_cache=True is a bool, not a size; allowed:"),
    (1.5, r"expert_cache=1\.5 is not a whole number of bytes; allowed:"),
    ("1.5", r"expert_cache='1\.5' is not a whole number of bytes; allowed:"),
])
def test_a_bad_size_names_the_allowed_range(value, match):
    with pytest.raises(PolicyError, match=match):
        OffloadPolicy.from_any({"expert_cache": value})


def test_whole_floats_and_fractional_units_are_bytes():
    assert parse_size(2e9, 0) == 2_000_000_000                   # JSON/YAML write 2e9 as a float
    assert parse_size("0.3KiB", 0) == 307                       # a unit rounds down to whole bytes
    assert parse_size("12.5%", 1000) == 125


@pytest.mark.parametrize("value", [0, -1, "0", "x", True, 2.0])
def test_a_bad_workload_hint_is_refused(value):
    with pytest.raises(PolicyError, match=r"max_batch_size=.* is not allowed; allowed: a whole number >= 1, or "
                                          r"'auto'"):
        OffloadPolicy.from_any({"max_batch_size": value})


def test_workload_hints_from_a_command_line_are_numbers():
    assert OffloadPolicy.from_any({"max_batch_size": "8", "max_seq_len": " 2048 "}).to_dict()["max_seq_len"] == 2048


# -- an explicit budget is never ignored ----------------------------------------------------------------------------

def test_a_budget_on_the_cpu_device_picks_the_disk_store_and_says_why(tiny_models, log):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", expert_cache="50%")
    assert hf_moe_offload.get_engine(model).policy.store == "disk"
    plan = [m for m in log if "auto policy" in m]
    assert len(plan) == 1 and "store=disk (expert_cache='50%' given for the CPU device" in plan[0]


def test_a_budget_with_host_memory_experts_on_the_cpu_device_is_refused(tiny_models):
    with pytest.raises(PolicyError, match=r"expert_cache='25%' has no effect with store='cpu' on the CPU device: "
                                          r"experts in host memory are used in place.*use store='disk'.*or drop "
                                          r"expert_cache"):
        offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="cpu", expert_cache="25%")


def test_a_budget_that_holds_every_expert_is_allowed_in_place():
    resolved = resolve(OffloadPolicy.from_any({"device": "cpu", "store": "cpu", "expert_cache": "100%"}), FP)
    assert resolved.cache_bytes == FP.expert_bytes


# -- "auto" on CUDA: headroom from the workload (F6) -----------------------------------------------------------------

def test_auto_cache_on_cuda_leaves_kv_and_activation_headroom(cuda, log):
    cuda["free"] = 6 * GiB
    resolved = resolve(OffloadPolicy.from_any({"store": "cpu"}), FP)
    assert resolved.policy.device == "cuda:0"
    assert (resolved.policy.max_batch_size, resolved.policy.max_seq_len) == (1, 4096)   # auto: one 4096-token seq
    assert resolved.cache_bytes == 6 * GiB - FP.resident_bytes - HEADROOM_1x4096
    assert any("headroom on cuda:0 2.0 GiB = KV cache 512.0 MiB (max_batch_size=1 x max_seq_len=4096" in m
               for m in log)


def test_workload_hints_grow_the_headroom(cuda):
    cuda["free"] = 12 * GiB
    resolved = resolve(OffloadPolicy.from_any({"store": "cpu", "max_batch_size": 2, "max_seq_len": 8192}), FP)
    assert resolved.cache_bytes == 12 * GiB - FP.resident_bytes - 2 * 8192 * (384 << 10) - CUDA_HEADROOM_FLOOR


def test_auto_sequence_length_is_the_models_when_shorter(cuda):
    cuda["free"] = 6 * GiB
    short = dataclasses.replace(FP, max_positions=1024)
    resolved = resolve(OffloadPolicy.from_any({"store": "cpu"}), short)
    assert resolved.policy.max_seq_len == 1024
    assert resolved.cache_bytes == 6 * GiB - FP.resident_bytes - 1024 * (384 << 10) - CUDA_HEADROOM_FLOOR


@pytest.mark.parametrize("config,dtype,kv", [
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 32/4 = 8 x 4 bytes; no head_dim in the config
    (MixtralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
     torch.float32, 256),
    # explicit head_dim (16, not 32/4), bf16
    (Qwen3MoeConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
     torch.bfloat16, 256),
    # no num_key_value_heads (multi-head attention), encoder-decoder: self + cross attention per decoder layer
    (SwitchTransformersConfig(d_model=32, num_layers=3, num_decoder_layers=2, num_heads=4, d_kv=8),
     torch.float32, 2 * 2 * 2 * 4 * 8 * 4),
])
def test_kv_bytes_per_token_from_the_config(config, dtype, kv):
    costs = sequence_costs(config, dtype)
    assert costs["kv_bytes_per_token"] == kv and costs["activation_bytes_per_token"] > 0


# -- enable() on a model already on the device (F7) -----------------------------------------------------------------

def test_experts_already_on_the_device_count_as_free_and_the_resident_part_once(cuda):
    cuda["free"] = 1 * GiB               # the whole model sits on the GPU now
    on_gpu = dataclasses.replace(FP, experts_device="cuda:0", resident_device="cuda:0")
    resolved = resolve(OffloadPolicy.from_any({"store": "cpu"}), on_gpu)
    assert resolved.cache_bytes == 1 * GiB + FP.expert_bytes - HEADROOM_1x4096


def test_experts_on_another_device_free_nothing_here(cuda):
    cuda["free"] = 6 * GiB
    on_cpu = dataclasses.replace(FP, experts_device="cpu", resident_device="cpu")
    resolved = resolve(OffloadPolicy.from_any({"store": "cpu"}), on_cpu)
    assert resolved.cache_bytes == 6 * GiB - FP.resident_bytes - HEADROOM_1x4096


def test_a_policy_given_as_json_text_is_parsed_with_clear_errors():
    from hf_moe_offload.policy.offload_policy import OffloadPolicy, PolicyError

    assert OffloadPolicy.from_any(' {"store": "disk", "expert_cache": "25%"} ').store == "disk"
    with pytest.raises(PolicyError, match="not valid JSON.*allowed: a preset name"):
        OffloadPolicy.from_any('{"store": disk}')
    with pytest.raises(PolicyError, match="unknown offload_policy preset"):
        OffloadPolicy.from_any("[1, 2]")


def test_a_workload_too_big_for_the_device_blames_the_workload_hints_not_the_cache():
    policy = OffloadPolicy(device="cpu", store="disk", max_batch_size=60000, max_seq_len=4096)
    with pytest.raises(PolicyError, match=r"max_batch_size=60000 x max_seq_len=4096 needs .* KV cache and "
                                          r"activations.*lower max_batch_size or max_seq_len") as err:
        resolve(policy, FP)
    assert "expert_cache=0 B is smaller" not in str(err.value)
