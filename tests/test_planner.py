"""The planner and the machine profile (issue 9 parts 2-3): memory never exceeded, CPU attention when the KV cache
cannot fit the device, impossible budgets refused naming the smallest, profile files accepted or refused by field."""

import json

import pytest
import torch
from transformers import MixtralConfig

from hf_moe_offload.cli import main
from hf_moe_offload.demo import DEMO_MODEL
from hf_moe_offload.planner import ModelShape, make_plan, memory_needed
from hf_moe_offload.policy import PolicyError
from hf_moe_offload.profile import MachineProfile, ProfileError, load_profile, measure

GiB = 1 << 30


@pytest.fixture(scope="module")
def mixtral():
    """Mixtral-8x7B's shape (meta skeleton: no memory)."""
    return ModelShape.from_config(MixtralConfig(), torch.bfloat16)


@pytest.mark.parametrize("budget_gib", [6, 10, 16])
@pytest.mark.parametrize("batch", [1, 64, 512])
def test_plan_never_exceeds_the_memory_given(mixtral, budget_gib, batch):
    plan = make_plan(mixtral, load_profile("t4"), batch=batch, prompt_len=128, gen_len=64,
                     device_memory=budget_gib * GiB)
    needed, _host = memory_needed(mixtral, plan.candidate, "cuda", batch, 128, 64)
    assert plan.device_memory_bytes == needed <= budget_gib * GiB
    assert plan.decode_tok_s > 0 and plan.prefill_tok_s > 0
    line = plan.explain()
    assert "predicted" in line and "bound by" in line and plan.binding in line


def test_cpu_attention_when_the_kv_cache_cannot_fit_the_device(mixtral):
    batch, length = 256, 512   # 256 x 576 tokens x 128 KiB = 18 GiB of KV cache: more than the T4's 16 GiB
    assert batch * (length + 64) * mixtral.kv_bytes_per_token > 16 * GiB
    plan = make_plan(mixtral, load_profile("t4"), batch=batch, prompt_len=length, gen_len=64)
    assert plan.candidate.attention == "cpu"
    assert plan.policy()["attention"] == "cpu"
    # A batch whose cache fits easily may keep attention on the device: the choice follows the numbers.
    small = make_plan(mixtral, load_profile("t4"), batch=1, prompt_len=16, gen_len=8)
    assert small.device_memory_bytes <= 16 * GiB


def test_impossible_budget_names_the_smallest_workable_one(mixtral):
    with pytest.raises(PolicyError, match=r"smallest workable device memory is .*device_memory=(\d+)") as info:
        make_plan(mixtral, load_profile("t4"), batch=8, prompt_len=64, gen_len=16, device_memory=1 * GiB)
    smallest = int(info.value.args[0].rsplit("device_memory=", 1)[1].rstrip(")"))
    plan = make_plan(mixtral, load_profile("t4"), batch=8, prompt_len=64, gen_len=16, device_memory=smallest)
    assert plan.device_memory_bytes <= smallest
    with pytest.raises(PolicyError, match="batch must be an int >= 1"):
        make_plan(mixtral, load_profile("t4"), batch=0, prompt_len=64, gen_len=16)


def test_profile_file_accepted_and_malformed_refused_naming_the_field(tmp_path):
    good = load_profile("l4").to_dict()
    path = tmp_path / "other.json"
    path.write_text(json.dumps(good))
    assert MachineProfile.load(path) == load_profile("l4")
    cases = {"disk_read_bytes_per_s": -1.0, "version": 99, "h2d_bytes_per_s": None, "colour": "blue"}
    for field, value in cases.items():
        bad = dict(good, **{field: value})
        path.write_text(json.dumps(bad))
        with pytest.raises(ProfileError, match=field):
            MachineProfile.load(path)
    del good["cpu_threads"]
    path.write_text(json.dumps(good))
    with pytest.raises(ProfileError, match="missing field 'cpu_threads'"):
        MachineProfile.load(path)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        MachineProfile.load(path)


def test_measure_smoke_saves_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path))
    p = measure(disk_piece_bytes=1 << 16, disk_pieces=4, memcpy_bytes=1 << 20, matmul_hidden=64, matmul_large_rows=8,
                seconds_per_kernel=0.001, device="cpu", overhead=False)
    assert not p.has_device and p.disk_read_bytes_per_s > 0 and p.cpu_flops_bf16_large > 0
    saved = p.save()
    assert saved == tmp_path / "profile.json"
    assert load_profile() == p
    # A CPU-only profile plans for the CPU device (host memory is the budget).
    plan = make_plan(ModelShape.from_pretrained(DEMO_MODEL), p, batch=4, prompt_len=16, gen_len=8)
    assert plan.device == "cpu" and plan.candidate.attention == "device"
    with pytest.raises(ValueError, match="disk_pieces must be an int >= 1"):
        measure(disk_pieces=0)


def test_plan_cli_on_the_demo_model_with_the_t4_profile(capsys):
    assert main(["plan", "--model", str(DEMO_MODEL), "--batch", "8", "--prompt-len", "32", "--gen-len", "16",
                 "--profile", "t4", "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "profile: T4" in out and "plan: prefill" in out and "bound by" in out
    assert main(["plan", "--model", str(DEMO_MODEL), "--batch", "8", "--prompt-len", "32", "--gen-len", "16",
                 "--profile", "t4", "--device-memory", "1KiB"]) == 2
    assert "smallest workable" in capsys.readouterr().err
    assert main(["plan", "--model", str(DEMO_MODEL), "--batch", "8", "--prompt-len", "32", "--gen-len", "16",
                 "--profile", "/nonexistent/profile.json"]) == 2
    assert "does not exist" in capsys.readouterr().err
