"""The smallest caches the policy accepts still generate the unpatched model's tokens when read-ahead fills the
slots that are not pinned with guesses: a demand load takes a guessed expert's slot rather than failing, with
`resident_layers`, with `micro_batches` (a layer's experts held between its slices), and with several threads
generating on one model."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig

import hf_moe_offload
from hf_moe_offload import PolicyError
from hf_moe_offload.memory.slots import SlotTable
from conftest import COMMON, VOCAB

# 4 MoE layers of 8 experts, top-2: one layer's experts are a quarter of all of them.
LAYERS, EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 4, 8, 2, 32, 48
SLAB = 3 * HIDDEN * INTERMEDIATE * 4          # one expert's w1, w2, w3 in float32


@pytest.fixture(scope="module")
def eight_experts(tmp_path_factory):
    """path of a saved Mixtral with 4 layers of 8 experts, and its unpatched model."""
    torch.manual_seed(0)
    config = MixtralConfig(**{**COMMON, "num_hidden_layers": LAYERS}, intermediate_size=INTERMEDIATE,
                           num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():                 # decisive routing: greedy tokens do not hang on near-ties
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] <= 16:
                p.mul_(8.0)
    path = tmp_path_factory.mktemp("eight_experts") / "mixtral"
    model.save_pretrained(path, max_shard_size="100KB")
    return str(path), AutoModelForCausalLM.from_pretrained(path).eval()


def _generate(model, batch: int, new_tokens: int, seed: int = 1) -> list[list[int]]:
    ids = torch.randint(3, VOCAB, (batch, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0).tolist()


def _offloaded(path: str, **policy):
    return AutoModelForCausalLM.from_pretrained(path, offload_policy={"device": "cpu", "store": "disk",
                                                                      **policy}).eval()


def _read_ahead_lands_before_each_layer(model) -> None:
    """Before each decoder layer runs, let the experts read ahead for it land (as they do when the layer's
    attention takes longer than a read): the cache then holds landed guesses, not reads still in flight, when
    the layer asks for its own experts."""
    cache = hf_moe_offload.get_engine(model).cache

    def wait_for_reads(module, args):
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            with cache.lock:
                pending = [s for s in cache.table.unwaited() if s.load is not None and not SlotTable.has_landed(s)]
            if not pending:
                return
            time.sleep(0.001)
        raise AssertionError(f"{len(pending)} reads ahead did not land in 30 s")   # else the scenario changes

    for layer in model.model.layers:
        layer.register_forward_pre_hook(wait_for_reads)


@pytest.mark.parametrize("policy", [{"resident_layers": 1, "expert_cache": (EXPERTS + TOP_K) * SLAB},
                                    {"micro_batches": 4, "expert_cache": EXPERTS * SLAB}])
def test_the_caches_below_are_the_smallest_the_policy_accepts(eight_experts, policy):
    path, _ = eight_experts
    with pytest.raises(PolicyError, match="use at least expert_cache"):
        _offloaded(path, **{**policy, "expert_cache": policy["expert_cache"] - SLAB})


@pytest.mark.parametrize("batch", [1, 2])
def test_a_resident_layer_with_the_smallest_cache_and_read_ahead(eight_experts, batch):
    """resident_layers=1 keeps one layer's 8 experts in the cache for good; the 2 slots left (top_k) are all the
    other layers get, and read-ahead guesses must not keep a layer's own experts out of them."""
    path, unpatched = eight_experts
    model = _offloaded(path, expert_cache=(EXPERTS + TOP_K) * SLAB, resident_layers=1, schedule="on_demand",
                       prefetch="lookahead")
    _read_ahead_lands_before_each_layer(model)
    assert _generate(model, batch, 16) == _generate(unpatched, batch, 16)


@pytest.mark.parametrize("batch", [4, 6, 8])
def test_micro_batches_with_a_cache_of_one_layer_and_read_ahead(eight_experts, batch):
    """micro_batches holds a layer's experts until its last slice; with a cache of exactly one layer's experts,
    read-ahead guesses for the next layer give their slots back to the experts the later slices need."""
    path, unpatched = eight_experts
    model = _offloaded(path, expert_cache=EXPERTS * SLAB, micro_batches=4, schedule="on_demand",
                       prefetch="lookahead")
    _read_ahead_lands_before_each_layer(model)
    assert _generate(model, batch, 8) == _generate(unpatched, batch, 8)


def test_threads_generating_on_one_micro_batched_model(eight_experts):
    """One thread's batch is split in micro-batches (a layer's experts held between slices), the other's single
    sequence is not: both get their own tokens, the second waiting for the slots instead of failing."""
    path, unpatched = eight_experts
    model = _offloaded(path, expert_cache=EXPERTS * SLAB, micro_batches=2, prefetch="none")
    want = {batch: _generate(unpatched, batch, 12, seed=batch) for batch in (6, 1)}
    errors, wrong = [], []

    def worker(batch: int) -> None:
        for _ in range(6):
            try:
                if _generate(model, batch, 12, seed=batch) != want[batch]:
                    wrong.append(batch)
            except Exception as err:          # noqa: BLE001 - reported below, with the batch that raised
                errors.append((batch, repr(err)))

    threads = [threading.Thread(target=worker, args=(batch,)) for batch in (6, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and wrong == []
