"""The planner and the machine profile: memory never exceeded, CPU attention when the KV cache
cannot fit the device, impossible budgets refused naming the smallest, profile files accepted or refused by field."""

import dataclasses
import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig

from hf_moe_offload.cli import main
from hf_moe_offload.demo import DEMO_MODEL
from hf_moe_offload.planning.planner import ModelShape, make_plan, memory_needed
from hf_moe_offload.policy.offload_policy import OffloadPolicy, PolicyError
from hf_moe_offload.planning.measure import measure
from hf_moe_offload.planning.profile import MachineProfile, ProfileError, load_profile
from hf_moe_offload.memory.cpu_kernels import prepack_supported

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
    # Tiny sizes everywhere: the expert curve's defaults (hidden 1024, rows up to 1024, 256 MiB of cold experts)
    # would take seconds of bf16 matmuls, and a slow CPU's bf16 is several times slower still.
    p = measure(disk_piece_bytes=1 << 16, disk_pieces=4, memcpy_bytes=1 << 20, matmul_hidden=64, matmul_large_rows=8,
                seconds_per_kernel=0.001, device="cpu", expert_hidden=64, expert_rows=(1, 8), cold_bytes=1 << 20)
    assert not p.has_device and p.disk_read_bytes_per_s > 0 and p.cpu_flops_bf16_large > 0
    assert sorted(p.cpu_expert_flops_bf16, key=int) == ["1", "8"] and p.cpu_elementwise_fp32_per_s > 0
    if prepack_supported(torch.bfloat16):     # the prepacked kernel's curve, measured where oneDNN has bf16
        assert sorted(p.cpu_expert_flops_bf16_packed, key=int) == ["1", "8"]
    else:
        assert p.cpu_expert_flops_bf16_packed is None
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


def test_plan_cli_takes_a_share_of_the_profiles_device_memory(capsys):
    """`--device-memory 50%`: half the profile's device memory (the T4's 16 GB), not half of an unbounded number."""
    args = ["plan", "--model", str(DEMO_MODEL), "--batch", "8", "--prompt-len", "32", "--gen-len", "16",
            "--profile", "t4", "--device-memory"]
    assert main([*args, "50%"]) == 0
    share = capsys.readouterr().out
    assert main([*args, str(load_profile("t4").device_memory_bytes // 2)]) == 0
    assert capsys.readouterr().out == share
    assert main([*args, "0.00001%"]) == 2                   # a few KiB of a T4: too small for the model
    assert "smallest workable" in capsys.readouterr().err
    assert main([*args, "150%"]) == 2
    assert "--device-memory='150%' is outside 0%..100%: a share is of the profile's device memory" in \
        capsys.readouterr().err
    assert main([*args, "auto"]) == 2
    err = capsys.readouterr().err
    assert "--device-memory='auto' is not a size" in err and "expert" not in err
    assert main([*args, "0%"]) == 2
    assert "--device-memory 0%: no memory to plan with" in capsys.readouterr().err


# ------------------------------------------------------------------ the cost model's profile fields and "auto"

def _cpu_profile(**extra) -> MachineProfile:
    """The T4 machine's host side (no GPU fields) with a measured-looking expert curve."""
    data = {k: v for k, v in load_profile("t4").to_dict().items()
            if k not in ("h2d_bytes_per_s", "device_flops", "device_memory_bytes", "device_memory_bytes_per_s",
                         "device_name")}
    data.update(name="cpu test", cpu_expert_flops_bf16={"1": 2e10, "64": 3e11, "1024": 4e11},
                cpu_expert_flops_fp32={"1": 1e10, "1024": 1e11}, cpu_elementwise_bf16_per_s=4e9,
                cpu_elementwise_fp32_per_s=5e9, layer_overhead_s=5e-4, step_overhead_s=1e-3, **extra)
    return MachineProfile.from_dict(data)


def test_new_profile_fields_round_trip_and_old_files_still_load(tmp_path):
    p = _cpu_profile(cpu_expert_flops_bf16_packed={"1": 4e10, "1024": 4e11})
    path = p.save(tmp_path / "p.json")
    assert MachineProfile.load(path) == p
    assert p.expert_flops(1024, 2) == pytest.approx(4e11) and 2e10 < p.expert_flops(8, 2) < 3e11
    # The shipped files predate these fields: they load, and plan with the two-point roofline.
    old = load_profile("l4")
    assert old.cpu_expert_flops_bf16 is None and old.expert_flops(8, 2) is None
    for field, value in (("cpu_expert_flops_bf16", [1, 2]), ("cpu_expert_flops_fp32", {"x": 1e9}),
                         ("cpu_expert_flops_bf16", {"4": -1}), ("cpu_expert_flops_bf16_packed", {"1": 0}),
                         ("cpu_elementwise_bf16_per_s", "fast"),
                         ("step_overhead_s", 0)):
        path.write_text(json.dumps(dict(p.to_dict(), **{field: value})))
        with pytest.raises(ProfileError, match=field):
            MachineProfile.load(path)


def test_cost_model_counts_what_a_matmul_misses(mixtral):
    """The curve and elementwise terms make CPU passes slower than the bare matmul roofline, never faster, and the
    measured read bytes replace the uniform-routing estimate."""
    from hf_moe_offload.planning.planner import Candidate, predict

    plain = dataclasses.replace(_cpu_profile(), cpu_expert_flops_bf16=None, cpu_elementwise_bf16_per_s=None,
                                layer_overhead_s=None, step_overhead_s=None)
    cand = Candidate("stream", "on_demand", 0.25, 64, "device")
    full = predict(mixtral, _cpu_profile(), cand, "cpu", "disk", 1, 64, 16)
    bare = predict(mixtral, plain, cand, "cpu", "disk", 1, 64, 16)
    assert full[0] < bare[0] and full[1] < bare[1]
    fewer = predict(mixtral, _cpu_profile(), cand, "cpu", "disk", 1, 64, 16, read_bytes=(None, 0.0))
    assert fewer[1] > full[1]   # a decode that reads nothing is faster than one reading 75% of its experts


def test_prepacked_curve_speeds_up_what_the_engine_packs_and_nothing_else(mixtral):
    """A CPU store's experts and every dense layer compute through the prepacked kernel on the CPU; a disk store's
    cache slots keep F.linear. A profile without the packed curve (older files, no oneDNN bf16) plans as before."""
    from hf_moe_offload.planning.planner import Candidate, predict

    fast = _cpu_profile(cpu_expert_flops_bf16_packed={"1": 6e10, "64": 4e11, "1024": 4e11})
    assert fast.expert_flops(1, 2, packed=True) == pytest.approx(6e10)
    assert fast.expert_flops(1, 2) == pytest.approx(2e10) and fast.expert_flops(1, 4, packed=True) == 1e10
    assert _cpu_profile().expert_flops(1, 2, packed=True) == pytest.approx(2e10)      # no curve: F.linear's
    cand = Candidate("on_demand", "on_demand", 1.0, 16, "device")
    in_ram = {p: predict(mixtral, prof, cand, "cpu", "cpu", 1, 16, 16)[1] for p, prof in
              (("packed", fast), ("plain", _cpu_profile()))}
    assert in_ram["packed"] > 2 * in_ram["plain"]            # experts and dense layers both 3x faster at 1 row
    slots = dataclasses.replace(cand, resident_share=0.25)
    from_disk = {p: predict(mixtral, prof, slots, "cpu", "disk", 1, 16, 16, read_bytes=(None, 0.0))[1]
                 for p, prof in (("packed", fast), ("plain", _cpu_profile()))}
    assert from_disk["plain"] < from_disk["packed"] < 1.5 * from_disk["plain"]    # only the dense layers gain


def test_auto_uses_the_cached_profile_and_logs_its_plan(tmp_path, monkeypatch, caplog):
    import hf_moe_offload

    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path))
    _cpu_profile().save()
    policy = {"device": "cpu", "store": "disk", "expert_cache": "50%", "max_batch_size": 8, "max_seq_len": 64}
    with caplog.at_level(logging.INFO, logger="hf_moe_offload"):
        model = hf_moe_offload.from_pretrained(DEMO_MODEL, policy)
    lines = [r.getMessage() for r in caplog.records if "auto plan" in r.getMessage()]
    assert len(lines) == 1 and "predicted prefill" in lines[0] and "bound by" in lines[0]
    plan = hf_moe_offload.stats(model)["plan"]
    engine = hf_moe_offload.get_engine(model)
    # The plan's choice is what the engine runs with, and stats shows it beside the measured side.
    assert engine.policy.stream_window == plan["policy_fields"]["stream_window"]
    assert engine.policy.schedule == plan["policy_fields"]["schedule"]
    assert f"stream_window={engine.policy.stream_window}" in lines[0] and plan["profile"] == "cpu test"
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    snap = hf_moe_offload.stats(model)
    assert snap["plan"]["predicted_tok_s"] > 0 and snap["measured"]
    hf_moe_offload.disable(model)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), out)


def test_auto_without_a_profile_keeps_the_rule_and_says_so(tmp_path, monkeypatch, caplog):
    import hf_moe_offload

    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path))   # nothing cached there
    with caplog.at_level(logging.INFO, logger="hf_moe_offload"):
        model = hf_moe_offload.from_pretrained(DEMO_MODEL, {"device": "cpu", "store": "disk", "expert_cache": "50%"})
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "no usable machine profile" in text and "hf-moe-offload profile" in text
    assert hf_moe_offload.get_engine(model).policy.stream_window == 2
    assert "plan" not in hf_moe_offload.stats(model)
    hf_moe_offload.disable(model)


def test_shape_takes_the_stored_dtype_when_the_config_names_none(tmp_path):
    """A config without a dtype: the planner sizes the model at its safetensors weights' dtype, not float32."""
    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, vocab_size=128)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        saved.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    shape = ModelShape.from_pretrained(str(tmp_path))
    assert shape.dtype_bytes == 2
    assert shape.expert_bytes == 3 * 64 * 128 * 2


@pytest.mark.parametrize("in_place,slots", [(True, 3), (False, 3), (False, 64)])
def test_a_cpu_store_feeding_cache_slots_is_planned_with_its_slots(monkeypatch, in_place, slots):
    """On the CPU, a store used in place (plain slabs) is all resident; one feeding cache slots (a GGUF or packed
    store) has only its slots: a streamed schedule whose window and top-k do not fit them is never weighed."""
    from hf_moe_offload.planning import auto_plan
    from hf_moe_offload.planning.footprint import Footprint
    from hf_moe_offload.policy.offload_policy import OffloadPolicy

    slab = 22020096
    weighed = []
    real_predict = auto_plan.predict

    def recording_predict(shape, profile, cand, *args, **kwargs):
        weighed.append(cand)
        return real_predict(shape, profile, cand, *args, **kwargs)

    monkeypatch.setattr(auto_plan, "predict", recording_predict)
    fp = Footprint(expert_bytes=64 * slab, slab_bytes=slab, resident_bytes=181569536, top_k=2,
                   kv_bytes_per_token=32768, layer_experts=(8,) * 8, host_store_in_place=in_place,
                   store_bytes=0 if in_place else 16 * slab)
    given = OffloadPolicy(device="cpu", store="cpu", expert_cache=slots * slab, max_batch_size=32, max_seq_len=256)
    done = dataclasses.replace(given, stream_window=2)
    auto_plan.plan_for_policy(given, done, fp, load_profile("t4"))
    streamed = [c for c in weighed if "stream" in (c.prefill_schedule, c.decode_schedule)]
    if in_place:
        assert streamed and {c.resident_share for c in weighed} == {1.0}
    else:
        assert {c.resident_share for c in weighed} == {slots / 64}
        assert streamed and all(slots >= c.stream_window + 2 for c in streamed)


def test_a_faster_gpu_never_predicts_slower_with_cpu_attention(mixtral):
    """CPU attention runs beside the device's work: shrinking the device's expert time cannot lengthen a layer."""
    from hf_moe_offload.planning.planner import Candidate, predict
    t4 = load_profile("t4")
    cand = Candidate("on_demand", "on_demand", 0.9, 64 * 256, "cpu", 1)
    rates = [predict(mixtral, dataclasses.replace(t4, device_flops=t4.device_flops * scale), cand, "cuda", "disk",
                     64, 256, 64)[:2] for scale in (1, 4, 16, 64)]
    assert all(b[0] >= a[0] and b[1] >= a[1] for a, b in zip(rates, rates[1:])), rates


def test_a_plan_below_a_share_prints_a_cache_the_engine_takes(mixtral):
    """A plan with no resident share still budgets a pass's working set: its policy names those bytes, not "0%"."""
    plan = make_plan(mixtral, load_profile("t4"), batch=64, prompt_len=256, gen_len=64, device_memory=16 * GiB)
    policy = plan.policy()
    if plan.candidate.resident_share == 0:
        assert isinstance(policy["expert_cache"], int) and policy["expert_cache"] >= 2 * mixtral.expert_bytes
    OffloadPolicy.from_any({**policy, "device": "cpu"})  # a policy the package takes (this machine has no GPU)


def test_the_smallest_workable_budget_named_in_the_error_is_workable(mixtral):
    t4 = dataclasses.replace(load_profile("t4"), host_memory_bytes=32 * GiB)
    with pytest.raises(PolicyError, match=r"smallest workable device memory is .* \(device_memory=(\d+)\)") as err:
        make_plan(mixtral, t4, 64, 4096, 4096, device_memory=16 * GiB, store="disk")
    minimum = int(str(err.value).rsplit("device_memory=", 1)[1].rstrip(")"))
    assert make_plan(mixtral, t4, 64, 4096, 4096, device_memory=minimum, store="disk").device_memory_bytes <= minimum


def test_a_cpu_machine_whose_ram_holds_the_weights_but_not_the_kv_cache_is_planned_from_disk(mixtral):
    """The store "auto" would pick (host memory: the weights fit) leaves no room for the KV cache: the disk store's
    plan is given instead of an error."""
    cpu = dataclasses.replace(load_profile("t4"), h2d_bytes_per_s=None, device_flops=None, device_memory_bytes=None,
                              device_memory_bytes_per_s=None, device_name=None)
    budget = mixtral.all_expert_bytes + mixtral.resident_bytes + GiB
    plan = make_plan(mixtral, cpu, 64, 256, 64, device_memory=budget)
    assert plan.store == "disk" and plan.device_memory_bytes <= budget


def test_the_auto_plan_sizes_a_float32_model_at_four_bytes_a_weight(monkeypatch):
    """The footprint carries the compute dtype's width, and the auto plan's shape of the model uses it."""
    from hf_moe_offload.arch import get_arch
    from hf_moe_offload.planning import auto_plan
    from hf_moe_offload.planning.footprint import footprint

    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, vocab_size=128)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    fp = footprint(skeleton, get_arch(config).find_layers(skeleton), torch.float32)
    assert fp.dtype_bytes == 4
    seen = []
    real = auto_plan.shape_from_footprint
    monkeypatch.setattr(auto_plan, "shape_from_footprint", lambda fp, dtype_bytes=2: seen.append(dtype_bytes)
                        or real(fp, dtype_bytes))
    given = OffloadPolicy(device="cpu", store="disk", expert_cache=fp.expert_bytes // 2, max_batch_size=8,
                          max_seq_len=256)
    auto_plan.plan_for_policy(given, dataclasses.replace(given, stream_window=2), fp, load_profile("t4"))
    assert seen == [4]


@pytest.mark.parametrize("batch, prompt_len, gen_len, budget_gib", [(16, 512, 128, 16), (64, 512, 64, 16),
                                                                     (8, 2048, 512, 12)])
def test_the_resident_share_takes_the_memory_the_kv_cache_and_activations_leave(mixtral, batch, prompt_len,
                                                                                gen_len, budget_gib):
    """Cached experts pay off at every batch here, so the plan fills the budget: "all that fits" is sized beside
    the KV cache and activations of each candidate, not beside the resident part alone."""
    plan = make_plan(mixtral, load_profile("t4"), batch=batch, prompt_len=prompt_len, gen_len=gen_len,
                     device_memory=budget_gib * GiB)
    assert plan.candidate.resident_share > 0
    assert budget_gib * GiB - mixtral.expert_bytes < plan.device_memory_bytes <= budget_gib * GiB


@pytest.mark.parametrize("batch", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("prompt_len", [16, 512])
@pytest.mark.parametrize("budget_gib", [12, 48])
def test_the_printed_schedule_runs_each_phase_as_planned(mixtral, batch, prompt_len, budget_gib):
    """A plan whose phases differ prints schedule="auto": the engine's per-pass rule must then give each phase
    the schedule the plan predicted with (a pass is wide by its own tokens: the prefill pass's, the batch's)."""
    from hf_moe_offload.runtime.pass_scheduler import is_wide_pass
    plan = make_plan(mixtral, load_profile("t4"), batch=batch, prompt_len=prompt_len, gen_len=64,
                     device_memory=budget_gib * GiB)
    cand, schedule = plan.candidate, plan.policy()["schedule"]

    def runs(tokens: int) -> str:
        if schedule != "auto":
            return schedule
        return "stream" if is_wide_pass(tokens, mixtral.top_k, mixtral.experts) else "on_demand"
    assert (runs(cand.micro_batch), runs(batch)) == (cand.prefill_schedule, cand.decode_schedule)


@pytest.mark.parametrize("store", ["disk", "cpu"])
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
@pytest.mark.parametrize("max_seq_len", [32, 2048])
def test_auto_plans_only_schedules_the_engine_runs(store, batch, max_seq_len):
    """`schedule="auto"` sets a schedule only where one is forced for both phases; otherwise the engine's per-pass
    rule runs, so a plan must not predict with a pair of schedules that rule does not give."""
    from hf_moe_offload.planning.auto_plan import plan_for_policy
    from hf_moe_offload.planning.footprint import Footprint
    from hf_moe_offload.runtime.pass_scheduler import is_wide_pass
    expert = 3 * 4096 * 14336 * 2                     # Mixtral-8x7B's, in bf16
    fp = Footprint(expert_bytes=32 * 8 * expert, slab_bytes=expert, resident_bytes=3 * GiB, top_k=2,
                   kv_bytes_per_token=128 << 10, layer_experts=(8,) * 32)
    for share in (0.05, 0.2, 0.6):
        policy = OffloadPolicy(device="cuda:0", store=store, max_batch_size=batch, max_seq_len=max_seq_len)
        resolved = dataclasses.replace(policy, expert_cache=int(share * fp.expert_bytes), schedule="auto",
                                       stream_window=2, attention="device")
        planned, summary = plan_for_policy(policy, resolved, fp, load_profile("t4"))
        job = summary["job"]

        def runs(tokens: int) -> str:
            if planned.schedule != "auto":
                return planned.schedule
            return "stream" if is_wide_pass(tokens, fp.top_k, 8) else "on_demand"
        ran = f"prefill {runs(job['batch'] * job['prompt_len'])}, decode {runs(job['batch'])}"
        assert ran == summary["schedule"], (share, planned.schedule)
