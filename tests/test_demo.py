"""The README's demo: the embedded trained model generates the same text with and without offloading; "auto"
plans a policy on this machine and logs it in one line."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM

import hf_moe_offload
from hf_moe_offload.cli import main
from hf_moe_offload.demo import DEMO_MODEL


def test_demo_command_shows_identical_text(capsys):
    assert main(["demo", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "same tokens as without offloading: yes" in out
    assert "tokens/s" in out and "misses" in out


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
