"""Shared set-up of the evaluation tests: a tiny random Mixtral with a real (byte-level BPE) tokenizer trained here on
CPython's pydoc text, saved like a Hub checkpoint; and checks of the shipped task data. No network."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import COMMON
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, MixtralConfig, PreTrainedTokenizerFast

from hf_moe_offload.integrations import task_data, task_names, tasks_dir

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]          # ids 0..3
# Offloaded and streamed: 4 slots for 12 experts (2 layers x 6), top-2, read from the checkpoint files.
STREAMING = {"device": "cpu", "store": "disk", "expert_cache": "34%"}


def train_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE (no <unk> on any text) trained on a few hundred lines of pydoc text."""
    topics = task_data.pydoc_topics()
    lines = [line for key in sorted(topics)[:40] for line in topics[key].splitlines() if line.strip()][:600]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", padding_side="left", model_max_length=256)


def build_eval_model(path: Path, seed: int = 0) -> str:
    """Save a tiny random Mixtral (6 experts, top-2, 2 layers, sharded Hub layout) and its tokenizer at `path`."""
    tokenizer = train_tokenizer()
    torch.manual_seed(seed)
    config = MixtralConfig(**{**COMMON, "vocab_size": len(tokenizer), "max_position_embeddings": 256,
                              "pad_token_id": 3, "bos_token_id": 1, "eos_token_id": 2},
                           intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():    # decisive routing, as in conftest.build_tiny
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] <= 8:
                p.mul_(8.0)
    model.save_pretrained(path, max_shard_size="100KB")
    tokenizer.save_pretrained(path)
    return str(path)


def test_tokenizer_round_trips_pydoc_text():
    tok = train_tokenizer()
    text = 'The "assert" statement: x = 1 + 2  # ok'
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok(text)["input_ids"][0] == tok.bos_token_id


def test_shipped_task_data_is_well_formed():
    data = tasks_dir() / "data"
    assert task_names() == ["hfmo_arith", "hfmo_pydoc_cloze", "hfmo_pydoc_ppl"]
    cloze = [json.loads(line) for line in (data / "pydoc_cloze.jsonl").open()]
    assert len(cloze) >= 50
    for doc in cloze:
        assert len(doc["choices"]) == 4 and len(set(doc["choices"])) == 4 and 0 <= doc["label"] < 4
    arith = [json.loads(line) for line in (data / "arith_test.jsonl").open()]
    for doc in arith:
        a, op, b = doc["question"].removeprefix("What is ").removesuffix("?").split()
        assert int(doc["answer"]) == (int(a) + int(b) if op == "plus" else int(a) - int(b))
    # the arithmetic files are independent of the Python version: regenerating gives the same docs
    assert arith == task_data.arithmetic_docs(task_data.ARITH_TEST_DOCS, seed=2)
    heldout = [json.loads(line)["topic"] for line in (data / "pydoc_heldout.jsonl").open()]
    assert {d["topic"] for d in cloze} <= set(heldout)
