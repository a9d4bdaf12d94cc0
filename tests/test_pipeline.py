"""transformers' `pipeline("text-generation", ..., batch_size=16)` on an offloaded model: a user's batch-generation
script unchanged. Its batches go through the streamed schedule and give the unpatched model's text."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import hf_moe_offload
from hf_moe_offload.demo import DEMO_MODEL

PROMPTS = ["The import statement", "A list comprehension", "Exceptions are raised", "def add(a, b):",
           "class Stack:", "for i in range(10):", "The dictionary", "A generator"] * 2
POLICY = {"device": "cpu", "store": "disk", "expert_cache": "25%"}


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tok.padding_side = "left"            # decoder-only batches pad on the left
    return tok


def generated(model, tokenizer, batch_size: int) -> list[str]:
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = pipe(PROMPTS, batch_size=batch_size, max_new_tokens=8, do_sample=False, return_full_text=False)
    return [rows[0]["generated_text"] for rows in out]


@pytest.mark.parametrize("batch_size", [16, 4])
def test_text_generation_pipeline_batches_stream_and_match_the_unpatched_model(tokenizer, batch_size):
    expected = generated(AutoModelForCausalLM.from_pretrained(DEMO_MODEL), tokenizer, batch_size)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, offload_policy=POLICY)
    assert generated(model, tokenizer, batch_size) == expected
    stats = hf_moe_offload.stats(model)
    # A batch of 16 (and each batch's prefill) touches most experts of a layer: those passes stream.
    assert stats["passes"].get("stream", 0) > 0
    assert stats["repeat_reads"] == 0
    assert stats["peak_cache_bytes"] <= stats["cache_capacity_bytes"]
