"""The README's demo: the embedded trained model generates the same text with and without offloading, both runs
timed alike; a bad policy is refused before anything loads; "auto" plans a policy on this machine and logs it in
one line."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationMixin

import hf_moe_offload
from hf_moe_offload.cli import main
from hf_moe_offload.demo import DEMO_MODEL, WARMUP_TOKENS, run_demo
from hf_moe_offload.policy.offload_policy import PolicyError


def test_demo_command_shows_identical_text_and_the_plan(capsys, caplog):
    verbosity = transformers.logging.get_verbosity()
    assert main(["demo", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "same tokens as without offloading: yes" in out
    assert "tokens/s" in out and "misses" in out
    # the package's INFO lines are shown (the CLI sets its level), transformers' own verbosity is untouched
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("auto policy: device=cpu" in m for m in logged) and any("MoE layers offloaded" in m for m in logged)
    assert transformers.logging.get_verbosity() == verbosity


def test_demo_with_a_host_store_drops_its_default_disk_cache(capsys):
    """The demo's default policy caches a quarter of the experts for its disk store; `--store cpu` alone must not
    be refused for that default (a host store has no separate cache), while a cache given with it still is."""
    from hf_moe_offload.demo import DEMO_POLICY
    assert main(["demo", "--max-new-tokens", "2", "--store", "cpu"]) == 0
    assert "same tokens as without offloading: yes" in capsys.readouterr().out
    assert DEMO_POLICY["expert_cache"] == "25%"                   # the default itself is untouched
    assert main(["demo", "--max-new-tokens", "2", "--store", "cpu", "--expert-cache", "25%"]) == 2
    assert "expert_cache='25%' has no effect with store='cpu'" in capsys.readouterr().err


def test_demo_refuses_a_bad_policy_before_loading_anything(capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded although the policy is bad")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    assert main(["demo", "--policy", "tape"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert "unknown offload_policy preset 'tape'; allowed presets: ['auto', 'low-ram']" in captured.err
    assert captured.out == ""
    with pytest.raises(PolicyError, match="allowed presets"):
        run_demo(policy="tape")


def test_demo_times_both_runs_alike(monkeypatch, capsys):
    calls = []
    generate = GenerationMixin.generate

    def spy(model, *args, **kwargs):
        calls.append((hf_moe_offload.get_engine(model) is not None, kwargs["max_new_tokens"], str(model.device)))
        return generate(model, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    result = run_demo(max_new_tokens=6, repeats=2)
    offloaded = [c[1:] for c in calls if c[0]]
    resident = [c[1:] for c in calls if not c[0]]
    # each: one short untimed warm-up, then the same number of full-length timed runs, on the same device
    assert offloaded == resident == [(WARMUP_TOKENS, "cpu"), (6, "cpu"), (6, "cpu")]
    assert "one warm-up, mean of 2 runs" in capsys.readouterr().out
    assert result["identical"] and result["reference_tokens_per_s"] > 0


def test_auto_policy_loads_and_logs_its_plan(caplog):
    with caplog.at_level(logging.INFO, logger="hf_moe_offload"):
        model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, offload_policy="auto")
    plans = [r.getMessage() for r in caplog.records if "auto policy" in r.getMessage()]
    assert len(plans) == 1 and "device=cpu" in plans[0]
    policy = hf_moe_offload.get_engine(model).policy
    assert policy.device == "cpu" and policy.store in ("cpu", "disk") and isinstance(policy.expert_cache, int)
    ids = torch.tensor([[1, 50, 60, 70]])
    reference = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=3)
    assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_demo_with_quantized_experts_says_the_tokens_are_approximate_and_exits_0(capsys):
    from hf_moe_offload.cli import main

    assert main(["demo", "--quantize", "int4", "--store", "disk", "--expert_cache", "25%", "--max-new-tokens",
                 "8"]) == 0
    out = capsys.readouterr().out
    assert "as expected with quantize='int4' (approximate)" in out or "same tokens as without offloading: yes" in out
