"""`print(hf_moe_offload.stats(model))` reads as a grouped summary, the snapshot stays a plain mapping, and no two
of its fields contradict each other (`lookahead_on` follows the look-ahead trial's verdict)."""

from __future__ import annotations

import json

import torch

import hf_moe_offload
from hf_moe_offload.runtime.lookahead_gate import LookaheadGate, PayoffTrial
from hf_moe_offload.runtime.pass_scheduler import PassScheduler
from hf_moe_offload.stats import StatsSnapshot, format_snapshot
from conftest import CONFIGS, VOCAB, model_class

GENERATE = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


def _offloaded(**policy):
    torch.manual_seed(0)
    model = model_class("mixtral").from_config(CONFIGS["mixtral"]()).eval()
    return hf_moe_offload.enable(model, {"device": "cpu", "store": "disk", "expert_cache": "34%", **policy})


def _ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))


def test_printed_stats_are_grouped_lines_over_the_unchanged_mapping():
    model = _offloaded()
    model.generate(_ids(), **GENERATE)
    snap = hf_moe_offload.stats(model)

    text = str(snap)
    lines = text.splitlines()
    assert len(lines) > 8 and max(map(len, lines)) <= 120
    for title in ("cache", "timings", "prefetch and look-ahead", "per layer"):
        assert title in lines
    assert f"hits {snap['hits']}, misses {snap['misses']}" in text
    assert sum(line.startswith(("  0:", "  1:")) for line in lines) == len(snap["per_layer"]) == 2

    assert isinstance(snap, dict) and snap["hits"] == dict(snap)["hits"]
    assert json.loads(json.dumps(snap)) == json.loads(json.dumps(dict(snap)))
    assert repr(snap) == repr(dict(snap))


def test_keys_the_groups_do_not_know_are_still_shown():
    snap = StatsSnapshot({"hits": 1, "misses": 0, "hit_rate": 1.0, "predictor_s": 0.25,
                          "plan": {"predicted_tok_s": 12.5, "predicted_prefill_tok_s": 100.0,
                                   "predicted_decode_tok_s": 10.0, "binding": "disk", "schedule": "x",
                                   "profile": "t4", "profile_source": "shipped", "job": {"batch": 1}}},
                         lambda: None)
    text = str(snap)
    assert "predictor_s: 0.25" in text and "predicted 12.5 tok/s" in text and "job: {batch: 1}" in text
    assert text == format_snapshot(dict(snap))


def test_lookahead_on_agrees_with_the_trial_verdict():
    model = _offloaded(schedule="on_demand")
    engine = hf_moe_offload.get_engine(model)
    lookahead = next(h for h in engine.hooks if isinstance(h, PassScheduler)).lookahead
    lookahead.gate = LookaheadGate(min_guesses=10**6)      # scores, never decides: stays as set
    lookahead.gate.on = True                               # the precision rule allows reading ahead
    lookahead.trial = PayoffTrial(hold=10**6)
    lookahead.trial.verdict = "off"                        # and the trial found it does not pay
    model.generate(_ids(), **GENERATE)
    snap = hf_moe_offload.stats(model)
    assert snap["lookahead_trial"]["verdict"] == "off"
    assert snap["lookahead_on"] is False and lookahead.reading_ahead is False
    assert snap["readahead_issued"] == 0
    assert "look-ahead reading off" in str(snap)

    lookahead.trial.verdict = "on"
    model.generate(_ids(), **GENERATE)
    snap = hf_moe_offload.stats(model)
    assert snap["lookahead_trial"]["verdict"] == "on" and snap["lookahead_on"] is True
