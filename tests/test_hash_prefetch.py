"""Inference with a SiDA hash predictor: exact mode prefetches and keeps the unpatched model's greedy tokens;
predicted routing uses only predicted experts; a predictor made for another model is refused before loading."""

from __future__ import annotations

import pytest
import torch

import hf_moe_offload
from hf_moe_offload.prefetch.hash import HashPredictor, PredictorMismatchError
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


# -- fewer wasted prefetches: confidence filter, per-layer shut-off, counters ---------------------------------------

def _spy_prefetches(engine, prefetcher):
    """Wrap the cache's prefetch: record (layer, expert, the table's chance for it) for every hash prefetch."""
    calls, original = [], engine.cache.prefetch

    def prefetch(layer, experts):
        chances = dict(prefetcher._current().ranked[prefetcher.axis_of[layer]])
        calls.extend((layer, e, chances.get(e)) for e in experts)
        return original(layer, experts)

    engine.cache.prefetch = prefetch
    return calls


def _hash_model(tiny_models, predictors, budget="50%"):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache=budget,
                      prefetch="hash", predictor=predictors["mixtral"])
    engine = hf_moe_offload.get_engine(model)
    return model, engine, engine.prefetcher


def test_low_confidence_predictions_are_not_prefetched(tiny_models, predictors):
    ids, kwargs = _ids(1), dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = reference("mixtral", tiny_models["mixtral"]).generate(ids, **kwargs)
    model, engine, prefetcher = _hash_model(tiny_models, predictors)
    prefetcher.configure(min_precision=0.0, min_confidence=0.5)
    calls = _spy_prefetches(engine, prefetcher)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    snap = hf_moe_offload.stats(model)
    assert calls and all(chance is not None and chance >= 0.5 for _, _, chance in calls)
    assert snap["hash_skipped_low_confidence"] > 0

    prefetcher.configure(min_confidence=1.0)          # no estimate reaches certainty: nothing is prefetched
    snap.reset()
    calls.clear()
    assert torch.equal(model.generate(ids, **kwargs), expected)
    snap = hf_moe_offload.stats(model)
    assert calls == [] and snap["hash_prefetch_issued"] == 0 and snap["hash_skipped_low_confidence"] > 0


def test_a_layer_with_low_precision_is_shut_off_and_still_tracked(tiny_models, predictors):
    ids, kwargs = _ids(1), dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = reference("mixtral", tiny_models["mixtral"]).generate(ids, **kwargs)
    model, engine, prefetcher = _hash_model(tiny_models, predictors)
    # an untrained predictor is often wrong: demanding every prediction be right shuts its layers off
    prefetcher.configure(min_confidence=0.0, min_precision=1.0, min_samples=4, precision_window=8)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    off = prefetcher.layers_off()
    assert off and hf_moe_offload.stats(model)["hash_layers_off"] == len(off)
    precision = prefetcher.precision()
    assert all(precision[layer] < 1.0 for layer in off)

    calls = _spy_prefetches(engine, prefetcher)
    hf_moe_offload.stats(model).reset()
    assert torch.equal(model.generate(ids, **kwargs), expected)
    snap = hf_moe_offload.stats(model)
    still_off = set(off) & set(prefetcher.layers_off())
    assert still_off and not [c for c in calls if c[0] in still_off]
    assert snap["hash_skipped_layer_off"] > 0

    prefetcher.configure(min_precision=0.0)           # a bar every layer clears: prefetching resumes everywhere
    hf_moe_offload.stats(model).reset()
    model.generate(ids, **kwargs)
    assert prefetcher.layers_off() == [] and hf_moe_offload.stats(model)["hash_skipped_layer_off"] == 0


def test_hash_counters_add_up_and_reset(tiny_models, predictors):
    model, engine, prefetcher = _hash_model(tiny_models, predictors, budget="75%")
    prefetcher.configure(min_confidence=0.0, min_precision=0.0, share_cap=False)
    new_tokens = 6
    model.generate(_ids(2), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    snap = hf_moe_offload.stats(model)
    assert snap["hash_tables"] == new_tokens                     # one table per forward pass
    assert 0 <= snap["hash_tables_ready"] <= snap["hash_tables"]
    assert snap["hash_prefetch_issued"] > 0
    # every prefetched layer is routed in the same pass: each prefetch is scored used or unused
    assert snap["hash_prefetch_used"] + snap["hash_prefetch_unused"] == snap["hash_prefetch_issued"]
    # the cache counts the same prefetches (beside the streaming read-ahead)
    assert snap["prefetch_issued"] - snap["readahead_issued"] == snap["hash_prefetch_issued"]
    snap.reset()
    after = hf_moe_offload.stats(model)
    assert all(after[k] == 0 for k in ("hash_prefetch_issued", "hash_prefetch_used", "hash_prefetch_unused",
                                       "hash_skipped_low_confidence", "hash_tables", "hash_tables_ready",
                                       "predictor_s"))


def test_configure_refuses_bad_values(tiny_models, predictors):
    _, _, prefetcher = _hash_model(tiny_models, predictors)
    with pytest.raises(ValueError, match=r"min_confidence must be a probability in \[0, 1\], got 1.5"):
        prefetcher.configure(min_confidence=1.5)
    with pytest.raises(ValueError, match="precision_window must be an int >= 1"):
        prefetcher.configure(precision_window=0)
    with pytest.raises(ValueError, match="min_samples .* must not exceed precision_window"):
        prefetcher.configure(min_samples=100, precision_window=10)


def test_one_token_lstm_step_matches_nn_lstm_with_a_padded_row():
    from hf_moe_offload.prefetch.hash import HashPredictorConfig

    torch.manual_seed(0)
    predictor = HashPredictor(HashPredictorConfig(model_type="mixtral", num_layers=2, layer_names=["a", "b"],
                                                  num_experts=4, hidden_size=8, vocab_size=10, top_k=2,
                                                  d_model=8, lstm_hidden=8))
    prompt, token = torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    mask = torch.tensor([[1], [0]])                   # row 1 has no token this step: its state must not move
    _, state = predictor.step(prompt)
    fast, fast_state = predictor.step(token, mask, state)
    predictor.one_token_cells = False
    slow, slow_state = predictor.step(token, mask, state)
    torch.testing.assert_close(fast[0], slow[0])
    for a, b in zip(fast_state.hc, slow_state.hc):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(fast_state.hc[0][:, 1], state.hc[0][:, 1])


def test_decode_tables_come_from_the_greedy_guess_and_prefetch_the_first_layer(tiny_models, predictors):
    """The next step's table is predicted from this step's greedy token while generate() picks it; a right guess
    gives the table before the pass starts, so even the first MoE layer's experts are prefetched."""
    ids, kwargs = _ids(1), dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = reference("mixtral", tiny_models["mixtral"]).generate(ids, **kwargs)
    model, engine, prefetcher = _hash_model(tiny_models, predictors, budget="25%")
    prefetcher.configure(min_confidence=0.0, min_precision=0.0)
    calls = _spy_prefetches(engine, prefetcher)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    snap = hf_moe_offload.stats(model)
    # greedy: every decode pass's guess is its token (the prefill's table cannot be guessed)
    assert snap["hash_speculation_hits"] == kwargs["max_new_tokens"] - 1
    assert snap["hash_speculated"] >= snap["hash_speculation_hits"]
    assert snap["hash_tables"] == kwargs["max_new_tokens"]
    assert any(layer == prefetcher.order[0] for layer, _, _ in calls)


def test_share_cap_bounds_the_prefetches_per_layer_and_pass(tiny_models, predictors):
    from hf_moe_offload.prefetch.hash import Prediction

    def issued_for_a_sure_table(share_cap):
        _, engine, prefetcher = _hash_model(tiny_models, predictors, budget="100%")   # an empty cache
        prefetcher.configure(share_cap=share_cap)
        layer, experts = prefetcher.order[1], engine.layers[0].num_experts
        ranked = [[(e, 1.0) for e in range(experts)] for _ in prefetcher.order]    # every expert certain
        table = Prediction(torch.zeros(1, len(ranked), experts), [list(range(experts))] * len(ranked), None, ranked)
        caller = prefetcher._caller()
        with engine.cache.lock:
            prefetcher._plan(caller, table, [layer])
        return len(caller.issued[layer]), max(prefetcher.top_k, engine.cache.num_slots // 3)

    uncapped, share = issued_for_a_sure_table(False)
    capped, _ = issued_for_a_sure_table(True)
    assert capped == share < uncapped


def test_predicted_routing_of_a_call_does_not_depend_on_earlier_calls(tiny_models, tmp_path):
    """generate(inputs_embeds=...) hashes no prompt ids: its decode steps start a new summary instead of going on
    from the state an earlier, unrelated call left, so the same call routes to the same experts."""
    torch.manual_seed(1)
    predictor = HashPredictor.for_model(reference("mixtral", tiny_models["mixtral"]), d_model=16, lstm_hidden=16)
    with torch.no_grad():                   # larger weights: the summary of earlier tokens decides the routing
        for p in predictor.parameters():
            p.mul_(2.0)
    predictor.save(tmp_path / "predictor")
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%",
                      prefetch="none", routing="predicted", predictor=str(tmp_path / "predictor"))
    routes = []

    class Routes(hf_moe_offload.LayerHook):
        def on_route(self, layer, experts):
            routes.append((layer, tuple(experts)))

    hf_moe_offload.get_engine(model).add_hook(Routes())
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    embeds = model.get_input_embeddings()(_ids(batch=2, length=6)).detach()

    def routes_of_the_call() -> tuple[torch.Tensor, list]:
        routes.clear()
        tokens = model.generate(inputs_embeds=embeds, **kwargs)
        return tokens, list(routes)

    first = routes_of_the_call()
    for seed in range(3):
        model.generate(torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(10 + seed)), **kwargs)
        again = routes_of_the_call()
        assert torch.equal(again[0], first[0]) and again[1] == first[1]


def test_hash_prefetch_with_a_static_cache_and_masks_per_layer_type(tiny_models, tmp_path):
    """A static cache on a model whose config has `layer_types` (Qwen2-MoE) gives the model a mask per layer type
    (a dict): the predictor goes on without padding information, exactly."""
    reference_model = reference("qwen2_moe", tiny_models["qwen2_moe"])
    torch.manual_seed(0)
    HashPredictor.for_model(reference_model, d_model=16, lstm_hidden=16).save(tmp_path / "predictor")
    ids = _ids(batch=1, length=6)
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static")
    model = offloaded("qwen2_moe", tiny_models["qwen2_moe"], device="cpu", store="disk", expert_cache="34%",
                      prefetch="hash", predictor=str(tmp_path / "predictor"))
    assert torch.equal(model.generate(ids, **kwargs), reference_model.generate(ids, **kwargs))
