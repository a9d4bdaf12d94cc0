"""CPU attention against a host KV cache (`attention="cpu"`, hf_moe_offload.attention.cpu): the same logits (within float
tolerance) and greedy tokens as transformers' sdpa, with GQA, left padding and generate's dynamic cache, with and
without expert offloading."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

import hf_moe_offload
from hf_moe_offload._compat import cache_keyword
from hf_moe_offload.attention.cpu import (ATTN_IMPLEMENTATION, HostKVCache, HostLayer, cpu_attention_forward,
                                      restore_attention, use_cpu_attention)
from hf_moe_offload.policy.offload_policy import OffloadPolicy, PolicyError

from conftest import offloaded, reference, token_inputs

FAMILIES = ["mixtral", "qwen3_moe"]
NEW_TOKENS = 6


def _run(model, ids, mask, **kwargs):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
    return logits, out


def _assert_same(expected, got):
    (ref_logits, ref_out), (logits, out) = expected, got
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
    assert torch.equal(out.sequences, ref_out.sequences)
    for a, b in zip(out.logits, ref_out.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_attention_and_mask_functions_registered():
    assert AttentionInterface._global_mapping[ATTN_IMPLEMENTATION] is cpu_attention_forward
    # Without a registered mask function transformers hands the attention no mask: padded batches go wrong.
    assert AttentionMaskInterface._global_mapping[ATTN_IMPLEMENTATION] is sdpa_mask


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offloaded"])
def test_equals_sdpa_left_padded_generate(tiny_models, family, offload):
    path = tiny_models[family]
    ref = reference(family, path)
    assert ref.config._attn_implementation == "sdpa"
    assert ref.config.num_key_value_heads < ref.config.num_attention_heads      # GQA
    ids, mask = token_inputs(3, 9, left_pad=True)
    expected = _run(ref, ids, mask)

    if offload:
        model = offloaded(family, path, device="cpu", store="disk", expert_cache="33%", attention="cpu")
    else:
        model = use_cpu_attention(reference(family, path))
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    got = _run(model, ids, mask)
    _assert_same(expected, got)
    # generate's own dynamic cache was turned into host layers
    assert all(isinstance(layer, HostLayer) for layer in got[1].past_key_values.layers)

    if offload:
        hf_moe_offload.disable(model)
    else:
        restore_attention(model)
    assert model.config._attn_implementation == "sdpa"
    assert "generate_batch" not in vars(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    assert type(out.past_key_values.layers[0]).__name__ == "DynamicLayer"    # no host cache any more
    torch.testing.assert_close(out.logits, expected[0], atol=1e-5, rtol=1e-4)


def test_user_caches_dynamic_and_host(tiny_models):
    """A DynamicCache passed to generate is converted in place; a HostKVCache is used as given."""
    ref = reference("mixtral", tiny_models["mixtral"])
    ids, mask = token_inputs(3, 7, seed=3, left_pad=True)
    expected = _run(ref, ids, mask)
    use_cpu_attention(ref)
    for cache in (DynamicCache(config=ref.config), HostKVCache(config=ref.config)):
        with torch.no_grad():
            out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0, **{cache_keyword(ref.forward): cache})
        assert torch.equal(out, expected[1].sequences)
        assert all(isinstance(layer, HostLayer) for layer in cache.layers)
        assert cache.layers[0].keys.device.type == "cpu" and cache.get_seq_length() == 7 + NEW_TOKENS - 1
    # a static cache stays where transformers puts it (copied to the host per layer; a warning says so)
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0, cache_implementation="static")
    assert torch.equal(out, expected[1].sequences)


def test_host_layer_grows_and_follows_batch_edits():
    """Past its first buffer, and after transformers replaces its keys (batch select, crop), the host layer holds
    exactly what DynamicLayer holds."""
    torch.manual_seed(0)
    host, plain = HostKVCache(), DynamicCache()
    batch = 3
    for step, n in enumerate([50, 1, 30, 1, 40]):
        k, v = torch.randn(batch, 2, n, 8), torch.randn(batch, 2, n, 8)
        for cache in (host, plain):
            cache.update(k, v, 0)
        assert torch.equal(host.layers[0].keys, plain.layers[0].keys)
        assert torch.equal(host.layers[0].values, plain.layers[0].values)
        if step == 2:
            for cache in (host, plain):
                cache.batch_select_indices(torch.tensor([0, 2]))
                cache.crop(-5)
            batch = 2
    assert host.get_seq_length() == plain.get_seq_length() == 117
    assert isinstance(host.layers[0], HostLayer)


def test_generate_batch_refused_with_reason(tiny_models):
    model = use_cpu_attention(reference("mixtral", tiny_models["mixtral"]))
    with pytest.raises(PolicyError, match="continuous batching.*'sdpa', 'paged\\|eager' or a flash"):
        model.generate_batch([[5, 6, 7]])
    restore_attention(model)
    assert "generate_batch" not in vars(model)


def test_bad_attention_value_refused():
    with pytest.raises(PolicyError, match=r"attention='gpu' is not allowed; allowed: \['auto', 'device', 'cpu'\]"):
        OffloadPolicy.from_any({"attention": "gpu"})
    assert OffloadPolicy.from_any({"attention": "cpu"}).attention == "cpu"
    assert OffloadPolicy().attention == "auto"


GiB = 1 << 30


def _on_a_gpu(monkeypatch, free_bytes: int):
    """resolve() as on a GPU with `free_bytes` free (this machine has none: the device and its memory are faked)."""
    from hf_moe_offload.planning import resolve as auto

    monkeypatch.setattr(auto, "normalize_device", lambda device: torch.device(device))
    monkeypatch.setattr(auto, "free_bytes", lambda device: free_bytes if device.type == "cuda" else 64 * GiB)
    return auto


def _footprint(**changes):
    from hf_moe_offload.planning.footprint import Footprint

    # Mixtral-8x7B-like sizes: 8 x 32 experts of 336 MiB, a 3 GiB resident part, 128 KiB of KV per token.
    base = dict(expert_bytes=256 * (336 << 20), slab_bytes=336 << 20, resident_bytes=3 * GiB, top_k=2,
                kv_bytes_per_token=128 << 10, activation_bytes_per_token=16 << 10, max_positions=32768)
    return Footprint(**{**base, **changes})


@pytest.mark.parametrize("batch, expected", [(1, "device"), (256, "cpu")])
def test_auto_attention_moves_to_the_cpu_when_the_kv_cache_cannot_fit_the_gpu(monkeypatch, batch, expected):
    """16 GiB free: one sequence of 2048 tokens needs 256 MiB of KV and stays on the GPU; 256 need 64 GiB, so the
    keys and values go to host memory and the GPU's memory goes to the expert cache instead."""
    auto = _on_a_gpu(monkeypatch, 16 * GiB)
    policy = OffloadPolicy(device="cuda:0", store="cpu", max_batch_size=batch, max_seq_len=2048)
    resolved = auto.resolve(policy, _footprint())
    assert resolved.policy.attention == expected
    kv = batch * 2048 * (128 << 10)
    activations = batch * 2048 * (16 << 10)
    room = 16 * GiB - 3 * GiB - activations - auto.CUDA_HEADROOM_FLOOR
    assert resolved.cache_bytes == (room if expected == "cpu" else room - kv)   # host KV: no device headroom


def test_auto_attention_keeps_the_device_when_the_user_or_the_model_says_so(monkeypatch):
    auto = _on_a_gpu(monkeypatch, 16 * GiB)
    big = dict(device="cuda:0", store="cpu", max_batch_size=64, max_seq_len=2048, expert_cache="8GiB")
    assert auto.resolve(OffloadPolicy(**big), _footprint()).policy.attention == "cpu"
    assert auto.resolve(OffloadPolicy(**big, attention="device"), _footprint()).policy.attention == "device"
    refused = _footprint(cpu_attention_refusal="an encoder-decoder model")
    assert auto.resolve(OffloadPolicy(**big), refused).policy.attention == "device"
    on_cpu = dict(big, device="cpu", store="disk")
    assert auto.resolve(OffloadPolicy(**on_cpu), _footprint()).policy.attention == "device"


def test_auto_attention_resolves_at_load_and_knows_which_models_it_can_serve(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%")
    assert hf_moe_offload.get_engine(model).policy.attention == "device"     # the CPU device: nothing to move
    from hf_moe_offload.arch import get_arch
    from hf_moe_offload.planning.footprint import footprint

    for family, refused in (("mixtral", False), ("switch_transformers", True)):
        reference_model = reference(family, tiny_models[family])
        layers = get_arch(reference_model.config).find_layers(reference_model)
        fp = footprint(reference_model, layers, torch.float32)
        assert (fp.cpu_attention_refusal is not None) == refused


def test_encoder_decoder_refused_before_loading(tiny_models):
    with pytest.raises(PolicyError, match="encoder-decoder.*attention='device'"):
        offloaded("switch_transformers", tiny_models["switch_transformers"], device="cpu", store="disk",
                  attention="cpu")
