"""Router kinds (`hf_moe_offload.arch.routing`): for every supported fused family, the routing rebuilt from the
router's logits is the routing the experts really receive, and the look-ahead guess from the same hidden states is
the experts the router picks; look-ahead prefetch and eviction on a sigmoid, group-limited, biased router
(DeepSeek-V3) keep the unpatched model's greedy tokens and guess right."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_moe_offload
from hf_moe_offload.arch import get_arch
from hf_moe_offload.arch.routing import RouterKind, RoutingUnsupportedError, replacement_output
from hf_moe_offload.runtime.lookahead_gate import rank_experts

from conftest import token_inputs
from test_families import FUSED, SKIP, tiny_config

EXPERTS = 8
# Routers whose routing depends on more than their logits output, and what is (not) rebuilt.
NOT_REBUILT = {"zaya": "refused",         # a skip expert (E + 1 logits) and router state carried across layers
               "deepseek_v4": "refused"}  # hash-routed layers route by input_ids, not by hidden states
WEIGHTS_NOT_REBUILT = {"inkling_text"}    # shared experts scored in the same softmax as the routed ones


def routed_config(model_type: str, layers: int = 2):
    """The tiny config, with two expert groups (one kept) where the family has group-limited top-k."""
    config = tiny_config(model_type, experts=EXPERTS, layers=layers)
    for attr in ("n_group", "num_expert_group"):
        if getattr(config, attr, None) == 1:
            setattr(config, attr, 2)
    if getattr(config, "topk_method", None) == "greedy":
        config.topk_method = "group_limited_greedy"
    return config


def randomise_routing(model) -> None:
    """Non-zero correction biases and scales, so a rebuild that ignores them picks other experts."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            last = name.rsplit(".", 1)[-1]
            if tensor.is_floating_point() and tensor.numel() in (EXPERTS, EXPERTS + 1) and (
                    ("bias" in last and last != "bias") or last == "per_expert_scale"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) * 0.5 + 0.1)


def capture_routing(model, arch, layers):
    """One forward; per layer: the router's input hidden states, its output, and the (indices, weights) the
    experts module was called with."""
    seen = {layer.index: {} for layer in layers}
    handles = []
    for layer in layers:
        router, slot = arch.router_module(model, layer), seen[layer.index]

        def router_in(module, args, kwargs, slot=slot):
            slot["hidden"] = (args[0] if args else kwargs["hidden_states"]).detach()

        def router_out(module, args, output, slot=slot):
            slot["output"] = output

        def experts_in(module, args, kwargs, slot=slot):
            values = list(args) + [kwargs.get(k) for k in ("top_k_index", "top_k_weights") if k in kwargs]
            slot["indices"], slot["weights"] = values[1], values[2]

        handles += [router.register_forward_pre_hook(router_in, with_kwargs=True),
                    router.register_forward_hook(router_out),
                    layer.module.register_forward_pre_hook(experts_in, with_kwargs=True)]
    ids, mask = token_inputs(2, 7)
    with torch.no_grad():
        model(ids, attention_mask=mask)
    for h in handles:
        h.remove()
    return seen


def _sorted(indices, weights):
    order = indices.argsort(dim=-1)
    return indices.gather(1, order), weights.float().gather(1, order)


ROUTED = [t for t in FUSED if t not in SKIP]


@pytest.mark.parametrize("model_type", ROUTED)
def test_rebuilt_routing_is_what_the_experts_receive(model_type):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(routed_config(model_type)).eval()
    randomise_routing(model)
    arch = get_arch(model.config)
    layers = arch.find_layers(model)
    kinds = {layer.index: arch.router_kind(model, layer) for layer in layers}
    seen = capture_routing(model, arch, layers)
    for layer in layers:
        kind, got = kinds[layer.index], seen[layer.index]
        if NOT_REBUILT.get(model_type) == "refused" and kind.refused:
            assert kind.refused
            with pytest.raises(RoutingUnsupportedError, match="predicted routing.*allowed"):
                kind.check("predicted routing")
            continue
        assert kind.refused is None, kind.refused
        router = arch.router_module(model, layer)
        logits = kind.logits(got["output"])
        assert logits.shape == (got["indices"].reshape(-1, layer.top_k).shape[0], EXPERTS)
        weights, indices = kind.select(logits)
        want_i, want_w = _sorted(got["indices"].reshape(-1, layer.top_k), got["weights"].reshape(-1, layer.top_k))
        got_i, got_w = _sorted(indices, weights)
        assert torch.equal(got_i, want_i), kind.describe()          # the same experts, per token
        if model_type in WEIGHTS_NOT_REBUILT:
            assert kind.weights_refused
            with pytest.raises(RoutingUnsupportedError):
                kind.check("predicted routing", weights=True)
        else:
            torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)
        # look-ahead: the same hidden states give the experts the router picked
        assert torch.equal(_sorted(kind.experts_for(got["hidden"]), weights)[0], want_i)
        assert set(rank_experts(kind.experts_for(got["hidden"]), EXPERTS)) == set(want_i.reshape(-1).tolist())


def test_a_plain_topk_of_logits_is_not_the_sigmoid_group_router():
    """The test above can fail: DeepSeek-V3's picks differ from a top-k of its raw logits."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(routed_config("deepseek_v3")).eval()
    randomise_routing(model)
    arch = get_arch(model.config)
    layers = arch.find_layers(model)
    kind = arch.router_kind(model, layers[0])
    assert kind.score == "sigmoid" and kind.bias is not None and kind.n_group == 2
    seen = capture_routing(model, arch, layers)[0]
    plain = arch.router_logits(seen["output"]).topk(2, dim=-1).indices.sort(dim=-1).values
    assert not torch.equal(plain, seen["indices"].sort(dim=-1).values)


def test_kind_select_documented_example():
    kind = RouterKind(router=None, num_experts=4, top_k=2, score="softmax", normalize=True)
    weights, indices = kind.select(torch.tensor([[4.0, 3.0, 0.0, -1.0]]))
    assert sorted(indices[0].tolist()) == [0, 1] and abs(float(weights.sum()) - 1.0) < 1e-6


def test_predicted_logits_decide_through_the_rebuilt_router():
    """What `routing="predicted"` does: the router's output replaced from other logits; the experts then get exactly
    the routing `select` gives for those logits (sigmoid, bias, groups, scaling included)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(routed_config("deepseek_v3")).eval()
    randomise_routing(model)
    arch = get_arch(model.config)
    layer = arch.find_layers(model)[0]
    router, kind = arch.router_module(model, layer), arch.router_kind(model, layer)
    forced = {}

    def replace(module, args, output):
        forced["logits"] = torch.randn(arch.router_logits(output).shape, generator=torch.Generator().manual_seed(3))
        return arch.routing_from_logits(module, forced["logits"], output)

    handle = router.register_forward_hook(replace)
    try:
        got = capture_routing(model, arch, [layer])[layer.index]
    finally:
        handle.remove()
    weights, indices = kind.select(forced["logits"])
    assert torch.equal(_sorted(got["indices"], got["weights"])[0], _sorted(indices, weights)[0])
    torch.testing.assert_close(_sorted(got["indices"], got["weights"])[1], _sorted(indices, weights)[1])


def test_logits_only_router_gets_logits_back_for_the_block_to_choose():
    """A router returning only logits (top-k computed in the MoE block): the replacement is the predicted logits
    themselves, so the block's own top-k picks the predicted experts."""
    kind = RouterKind(router=None, num_experts=4, top_k=2, score="softmax")
    original = torch.zeros(1, 3, 4, dtype=torch.bfloat16)
    predicted = torch.tensor([[0.0, 5.0, 4.0, -1.0]] * 3)
    out = replacement_output(kind, predicted, original)
    assert out.shape == original.shape and out.dtype == torch.bfloat16
    assert out.reshape(3, 4).float().topk(2).indices.sort().values.tolist() == [[1, 2]] * 3


def test_refused_router_is_refused_only_where_lookahead_is_used(tmp_path):
    """Zaya (a skip expert, router state across layers) loads and generates offloaded; look-ahead prefetch is refused
    with the reason, and the default prefetch guesses every expert instead of guessing wrong."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("zaya")).save_pretrained(tmp_path)
    policy = {"device": "cpu", "store": "disk", "expert_cache": "50%"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path, offload_policy=policy)
    ids, mask = token_inputs(1, 5)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    del model
    with pytest.raises(RoutingUnsupportedError, match="prefetch='lookahead'.*skip expert"):
        AutoModelForCausalLM.from_pretrained(tmp_path, offload_policy={**policy, "prefetch": "lookahead"})


@pytest.mark.parametrize("prefetch, eviction", [("auto", "lookahead"), ("lookahead", "lookahead"),
                                                ("lookahead", "layer")])
def test_lookahead_on_a_sigmoid_group_router_keeps_tokens_and_guesses_right(tmp_path, prefetch, eviction):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(routed_config("deepseek_v3", layers=3)).eval()
    randomise_routing(model)
    with torch.no_grad():          # decisive routing: random near-ties would make greedy tokens fragile
        for layer in get_arch(model.config).find_layers(model):
            get_arch(model.config).router_module(model, layer).weight.mul_(8.0)
    model.save_pretrained(tmp_path)
    ids, mask = token_inputs(1, 6, seed=11)
    generate = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **generate)
    del model
    model = AutoModelForCausalLM.from_pretrained(tmp_path, offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": "34%", "prefetch": prefetch, "eviction": eviction})
    with torch.no_grad():
        got = model.generate(ids, **generate)
    assert torch.equal(got, want)
    stats = hf_moe_offload.stats(model)
    if prefetch == "auto":          # every on-demand pass scores its guesses: some were what the router chose
        assert stats["lookahead_used"] > 0 and stats["lookahead_guesses"] >= stats["lookahead_used"]
    else:
        assert stats["readahead_issued"] > 0 and stats["lookahead_on"] is True
