"""Packed attention for continuous batching (`hf_moe_offload.attention.packed`): request by request, the same
numbers as transformers' dense block-diagonal mask (causal alignment of prefill chunks, sliding windows, GQA,
batched decodes of different lengths), used by offloaded models' `generate_batch` in place of sdpa, with the
unpatched model's tokens, and the model's own attention put back afterwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, GenerationConfig
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.generation.continuous_batching.utils import build_attention_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_moe_offload
from conftest import generate_each, offloaded, prompt_ids, reference
from hf_moe_offload.attention import packed as packed_attention
from hf_moe_offload.attention.packed import ATTN_IMPLEMENTATION, packed_attention_forward

GEN = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=0)
POLICY = {"device": "cpu", "store": "disk", "expert_cache": "34%"}


class Attention(nn.Module):
    """What the attention functions read from a decoder layer's attention module."""

    def __init__(self, heads: int, kv_heads: int, sliding_window: int | None, layer_type: str | None = None):
        super().__init__()
        self.layer_idx, self.is_causal = 0, True
        self.num_key_value_groups = heads // kv_heads
        self.config = SimpleNamespace(sliding_window=sliding_window, layer_types=layer_type and [layer_type])


class PackedKeys(PagedAttentionCache):
    """A paged cache stand-in whose `update` returns already-packed keys/values and selects the layer type's
    boundaries, as `PagedAttentionCache.update` does (a real one needs a model and a scheduler)."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, layer_type: str):
        self.layer_to_allocator = {0: SimpleNamespace(layer_type=layer_type)}
        self.key, self.value = key, value

    def update(self, key_states, value_states, layer_idx, kwargs):
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][self.layer_to_allocator[layer_idx].layer_type]
        kwargs["max_length_k"] = kwargs["max_length_k"][self.layer_to_allocator[layer_idx].layer_type]
        return self.key, self.value


# (query tokens, key tokens) per request: a prefill chunk after earlier chunks, a whole prompt, decodes of
# different lengths (one longer than the sliding window), a padding request with nothing to do
REQUESTS = [(5, 12), (7, 7), (1, 9), (1, 3), (1, 14), (0, 0)]


@pytest.mark.parametrize("layer_type,window,layer_types", [
    ("full_attention", None, None), ("sliding_attention", 6, None),         # no layer types: the window decides
    ("full_attention", None, "full_attention"), ("sliding_attention", 6, "sliding_attention")])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("cache_in_attention", [True, False])
def test_packed_attention_equals_the_dense_block_diagonal_mask(layer_type, window, layer_types, heads, kv_heads,
                                                               cache_in_attention):
    """`cache_in_attention`: transformers <= 5.23 hands the paged cache to the attention function; later versions
    update it in the attention module and pass this layer's boundaries."""
    g = torch.Generator().manual_seed(0)
    cq, ck = [0], [0]
    for q_len, k_len in REQUESTS:
        cq.append(cq[-1] + q_len)
        ck.append(ck[-1] + k_len)
    d = 8
    query = torch.randn(1, heads, cq[-1], d, generator=g)
    key, value = (torch.randn(1, kv_heads, ck[-1], d, generator=g) for _ in range(2))
    module = Attention(heads, kv_heads, 6 if layer_types else window, layer_types)   # layer types beat the window
    mask = torch.full((1, 1, cq[-1], ck[-1]), torch.finfo(torch.float32).min)   # outside every request: masked
    build_attention_mask(mask, cq, ck, sliding_window=window or 1)   # what sdpa gets in continuous batching
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    cu_q = torch.tensor(cq, dtype=torch.int32)
    if cache_in_attention:
        packed, _ = packed_attention_forward(
            module, query, key, value, None, scaling=0.3, cache=PackedKeys(key, value, layer_type), cu_seq_lens_q=cu_q,
            cu_seq_lens_k={layer_type: torch.tensor(ck)}, max_length_k={layer_type: max(k for _, k in REQUESTS)})
    else:
        packed, _ = packed_attention_forward(module, query, key, value, None, scaling=0.3, cu_seq_lens_q=cu_q,
                                             cu_seq_lens_k=torch.tensor(ck), max_length_k=max(k for _, k in REQUESTS))
    assert packed.shape == expected.shape == (1, cq[-1], heads, d)
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-6)


def test_calls_outside_continuous_batching_are_sdpa_and_odd_packed_calls_are_refused():
    module = Attention(2, 2, None)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False                                             # a left-padded row
    torch.testing.assert_close(packed_attention_forward(module, q, k, v, mask)[0],
                               sdpa_attention_forward(module, q, k, v, mask)[0])
    x = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="continuous batching's packed passes only"):
        packed_attention_forward(module, x, x, x, None, cu_seq_lens_q=torch.tensor([0, 3]),
                                 block_table=torch.zeros(1, 1))
    with pytest.raises(RuntimeError, match="not read from the paged cache"):
        packed_attention_forward(module, x, x, x, None, cu_seq_lens_q=torch.tensor([0, 3]),
                                 cu_seq_lens_k={"full_attention": torch.tensor([0, 3])})
    cache = PackedKeys(x, x, "full_attention")
    with pytest.raises(ValueError, match="does not support softcap"):
        packed_attention_forward(module, x, x, x, None, cache=cache, cu_seq_lens_q=torch.tensor([0, 3]),
                                 cu_seq_lens_k={"full_attention": torch.tensor([0, 3])}, softcap=30.0)


def _prompts() -> list[list[int]]:
    return prompt_ids((5, 23, 9, 31, 3, 17))


class Spy:
    """Counts the packed attention's calls (registered in its place for the test)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return packed_attention_forward(*args, **kwargs)


@pytest.fixture
def spy():
    spy = Spy()
    AttentionInterface.register(ATTN_IMPLEMENTATION, spy)
    yield spy
    packed_attention.register()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_generate_batch_runs_packed_attention_with_the_unpatched_tokens(tiny_models, spy, family):
    expected = generate_each(reference(family, tiny_models[family]), _prompts(), GEN)
    model = offloaded(family, tiny_models[family], **POLICY)
    assert model.config._attn_implementation == "sdpa"
    out = model.generate_batch(_prompts(), generation_config=GEN, persistent_manager=True)
    assert [o.generated_tokens for o in out.values()] == expected
    manager = model._cached_continuous_batching_manager
    assert spy.calls > 0
    assert manager.batch_processor.inputs_and_outputs.attention_mask is None       # no dense mask was allocated
    assert model.config._attn_implementation == "sdpa"                             # put back when it stopped
    calls = spy.calls
    again = model.generate_batch(_prompts(), generation_config=GEN, persistent_manager=True)   # the kept manager
    assert [o.generated_tokens for o in again.values()] == expected and spy.calls > calls
    model.destroy_cached_continuous_batching_manager()
    assert model.config._attn_implementation == "sdpa"
    assert [t.tolist() for t in model.generate(torch.tensor([_prompts()[1]]), generation_config=GEN)[:, 23:]] \
        == [expected[1] + [0] * (GEN.max_new_tokens - len(expected[1]))]          # plain generate: sdpa again


def test_eager_models_keep_their_dense_mask(tiny_models, spy):
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICY)
    model.set_attn_implementation("eager")
    model.generate_batch(_prompts(), generation_config=GEN)
    assert spy.calls == 0 and model.config._attn_implementation == "eager"
    stats = hf_moe_offload.stats(model)
    assert stats["peak_cache_bytes"] <= stats["cache_capacity_bytes"]


def test_boundaries_are_read_again_for_each_pass_and_layer_type():
    """The per-pass memo of the request boundaries: two layer types alternate within a pass, and the next pass
    rewrites the same tensors in place (what transformers' batch processor does) with other requests."""
    g = torch.Generator().manual_seed(1)
    module = Attention(4, 2, None)
    cu_q, cu_full, cu_sliding = (torch.zeros(4, dtype=torch.int32) for _ in range(3))
    for requests in ([(1, 5), (1, 9), (4, 4)], [(3, 3), (1, 12), (1, 2)]):       # pass 1, then pass 2
        cq, ck = [0], [0]
        for q_len, k_len in requests:
            cq.append(cq[-1] + q_len)
            ck.append(ck[-1] + k_len)
        cu_q.copy_(torch.tensor(cq))
        cu_full.copy_(torch.tensor(ck))
        cu_sliding.copy_(torch.tensor(ck))
        query = torch.randn(1, 4, cq[-1], 8, generator=g)
        key, value = (torch.randn(1, 2, ck[-1], 8, generator=g) for _ in range(2))
        for layer_type, cu_k, window in [("full_attention", cu_full, None), ("sliding_attention", cu_sliding, 3)] * 2:
            module.config.sliding_window = window
            mask = torch.full((1, 1, cq[-1], ck[-1]), torch.finfo(torch.float32).min)
            build_attention_mask(mask, cq, ck, sliding_window=window or 1)
            expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
            packed, _ = packed_attention_forward(module, query, key, value, None, scaling=0.3, cu_seq_lens_q=cu_q,
                                                 cu_seq_lens_k=cu_k, max_length_k=max(ck))
            torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-6)


def test_padded_query_tokens_get_zeros_not_garbage():
    """With static shapes the pass has query tokens past the last request's; they attend to nothing."""
    g = torch.Generator().manual_seed(2)
    module = Attention(2, 2, None)
    query = torch.randn(1, 2, 5, 4, generator=g)                  # 3 real tokens (one request), 2 padding
    key, value = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(2))
    out, _ = packed_attention_forward(module, query, key, value, None, cu_seq_lens_q=torch.tensor([0, 3, 3]),
                                      cu_seq_lens_k=torch.tensor([0, 3, 3]), max_length_k=3)
    assert out.shape == (1, 5, 2, 4) and torch.equal(out[0, 3:], torch.zeros(2, 2, 4))
    expected = F.scaled_dot_product_attention(query[:, :, :3], key, value, is_causal=True)
    torch.testing.assert_close(out[:, :3], expected.transpose(1, 2))


def test_the_mask_is_sdpas_except_in_a_runs_generation_thread():
    args = {"batch_size": 1, "q_length": 4, "kv_length": 4, "attention_mask": torch.tensor([[0, 1, 1, 1]]).bool()}
    from transformers.masking_utils import sdpa_mask
    torch.testing.assert_close(packed_attention.packed_mask(**args), sdpa_mask(**args))
    packed_attention._layout.in_run = True
    try:
        assert packed_attention.packed_mask(**args) is None
    finally:
        packed_attention._layout.in_run = False
