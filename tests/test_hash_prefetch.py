"""Inference with a SiDA hash predictor: exact mode prefetches and keeps the unpatched model's greedy tokens;
predicted routing uses only predicted experts; a predictor made for another model is refused before loading."""

from __future__ import annotations

import pytest
import torch

import hf_moe_offload
from hf_moe_offload.prefetch.hash_predictor import HashPredictor, PredictorMismatchError
from conftest import VOCAB, build_tiny, offloaded, reference


@pytest.fixture(scope="module")
def predictors(tiny_models, tmp_path_factory):
    """An (untrained) predictor per family: behaviour, not accuracy, is under test here."""
    root = tmp_path_factory.mktemp("predictors")
    out = {}
    for family in ("mixtral", "switch_transformers"):
        torch.manual_seed(0)
        model = reference(family, tiny_models[family])
        HashPredictor.for_model(model, d_model=16, lstm_hidden=16,
                                causal=family != "switch_transformers").save(root / family)
        out[family] = str(root / family)
    return out


def _ids(batch=3, length=8):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("family", ["mixtral", "switch_transformers"])
def test_hash_prefetch_is_exact_and_prefetches(tiny_models, predictors, family):
    ids = _ids()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = reference(family, tiny_models[family]).generate(ids, **kwargs)
    model = offloaded(family, tiny_models[family], device="cpu", store="disk", expert_cache="50%",
                      prefetch="hash", predictor=predictors[family])
    assert torch.equal(model.generate(ids, **kwargs), expected)
    snap = hf_moe_offload.stats(model)
    assert snap["prefetch_issued"] > 0
    assert snap["prefetch_hits"] + snap["prefetch_wasted"] <= snap["prefetch_issued"]
    assert snap["bytes_to_device"] == (snap["misses"] + snap["prefetch_issued"]) * \
        hf_moe_offload.get_engine(model).store.slab_bytes(0)
    assert snap["peak_cache_bytes"] <= hf_moe_offload.get_engine(model).policy.expert_cache


def test_predicted_routing_uses_only_predicted_experts(tiny_models, predictors):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%",
                      routing="predicted", predictor=predictors["mixtral"])
    engine = hf_moe_offload.get_engine(model)
    prefetcher = engine.prefetcher
    requested = []

    class Spy(hf_moe_offload.LayerHook):
        def on_route(self, layer, experts):
            table = prefetcher._current()
            requested.append((set(experts), set(table.experts[prefetcher.axis_of[layer]])))

    engine.add_hook(Spy())
    ids = _ids()
    model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert requested and all(used <= predicted for used, predicted in requested)
    with torch.no_grad():   # an approximation: the logits are not the router's
        assert not torch.allclose(model(ids).logits, reference("mixtral", tiny_models["mixtral"])(ids).logits)


def test_predicted_routing_alone_does_not_prefetch(tiny_models, predictors):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%",
                      prefetch="none", routing="predicted", predictor=predictors["mixtral"])
    model.generate(_ids(), max_new_tokens=4, do_sample=False, pad_token_id=0)
    snap = hf_moe_offload.stats(model)
    assert snap["prefetch_issued"] == snap["readahead_issued"]   # only the streaming schedule's own read-ahead


def test_predictor_for_another_model_is_refused_before_loading(tiny_models, predictors, tmp_path):
    other = build_tiny("qwen3_moe", tmp_path / "qwen3")
    with pytest.raises(PredictorMismatchError, match="model_type"):
        offloaded("qwen3_moe", other, device="cpu", store="disk", expert_cache="50%", prefetch="hash",
                  predictor=predictors["mixtral"])


def test_missing_predictor_directory_is_named(tiny_models, tmp_path):
    with pytest.raises(FileNotFoundError, match="hash predictor file missing"):
        offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%",
                  prefetch="hash", predictor=str(tmp_path / "nowhere"))


def test_disable_removes_the_predictor_hooks(tiny_models, predictors):
    model = reference("mixtral", tiny_models["mixtral"])
    ids = _ids(1)
    with torch.no_grad():
        before = model(ids).logits
    hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu", "routing": "predicted",
                                  "predictor": predictors["mixtral"]})
    hf_moe_offload.disable(model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_predicted_routing_steps_aside_under_continuous_batching(tiny_models, predictors):
    """generate_batch packs a different set of requests into one row every pass: the per-row predictor state cannot
    follow, so the router decides there (tokens equal the unpatched model's)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 3)]
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=2, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_batch_tokens=8, num_blocks=16, page_size=16)

    def run(model):
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        return [o.generated_tokens for o in out.values()]

    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%",
                      routing="predicted", predictor=predictors["mixtral"])
    assert run(model) == run(reference("mixtral", tiny_models["mixtral"]))
    assert hf_moe_offload.get_engine(model).prefetcher._warned_paged
