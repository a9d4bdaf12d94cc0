"""The model's own dense weights left in the checkpoint's file (`loading.mapped_dense`): their packed copies made at
load whatever the budget, the same logits as with the weights in memory and the unpatched model's tokens, the
same `state_dict()`, the weights back in memory after `disable()`, and a weight that differs from its file or is
shared left as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny, file_backed, forward_logits, model_class, offloaded, reference, token_inputs

import hf_moe_offload
from hf_moe_offload.loading import file_maps, finish, mapped_dense
from hf_moe_offload.memory.cpu_kernels import prepack_supported
from hf_moe_offload.storage.checkpoint import CheckpointIndex

pytestmark = pytest.mark.skipif(not prepack_supported(torch.bfloat16), reason="oneDNN has no bf16 on this CPU")

DISK = dict(device="cpu", store="disk", expert_cache="50%")


@pytest.fixture(scope="module")
def bf16_mixtral(tmp_path_factory):
    return build_tiny("mixtral", tmp_path_factory.mktemp("bf16") / "mixtral", dtype=torch.bfloat16)


@pytest.fixture
def every_size(monkeypatch):
    """The tiny model's weights are far below the size worth mapping: map them all."""
    monkeypatch.setattr(mapped_dense, "MIN_BYTES", 0)


def _own_linears(model) -> list[torch.nn.Linear]:
    return [model.model.layers[0].self_attn.q_proj, model.model.layers[1].self_attn.o_proj, model.lm_head]


def test_weights_left_in_the_file_give_the_same_logits_tokens_and_state_dict(bf16_mixtral, monkeypatch):
    ids, mask = token_inputs(2, 9)
    in_memory = offloaded("mixtral", bf16_mixtral, **DISK)          # MIN_BYTES: nothing this small is mapped
    assert hf_moe_offload.stats(in_memory)["dense_in_file_bytes"] == 0
    assert not any(file_backed(layer.weight) for layer in _own_linears(in_memory))
    monkeypatch.setattr(mapped_dense, "MIN_BYTES", 0)
    model = offloaded("mixtral", bf16_mixtral, **DISK)
    assert all(file_backed(layer.weight) for layer in _own_linears(model))
    stats = hf_moe_offload.stats(model)
    mapped = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and file_backed(m.weight)]
    assert stats["dense_in_file_bytes"] == sum(m.weight.nbytes for m in mapped) > 0
    assert stats["prepacked_bytes"] >= stats["dense_in_file_bytes"]          # packed at load, before any forward
    logits = forward_logits(model, "mixtral", ids, mask)
    assert torch.equal(logits, forward_logits(in_memory, "mixtral", ids, mask))   # the same bytes: the same bits
    ref = reference("mixtral", bf16_mixtral)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    state, ref_state = model.state_dict(), ref.state_dict()
    assert set(state) == set(ref_state)
    assert all(torch.equal(state[name], tensor) for name, tensor in ref_state.items())


def test_weights_left_in_the_file_are_packed_when_the_budget_allows_no_copies(bf16_mixtral, monkeypatch):
    """Inside a container whose memory leaves nothing for copies: the mapped weights still get theirs (a copy
    replaces the weight's memory), the others compute through F.linear."""
    monkeypatch.setattr(finish, "prepack_budget", lambda: 0)
    ids, mask = token_inputs(1, 5)
    plain = offloaded("mixtral", bf16_mixtral, **DISK)
    forward_logits(plain, "mixtral", ids, mask)
    assert hf_moe_offload.stats(plain)["prepacked_bytes"] == 0
    monkeypatch.setattr(mapped_dense, "MIN_BYTES", 0)
    model = offloaded("mixtral", bf16_mixtral, **DISK)
    forward_logits(model, "mixtral", ids, mask)
    stats = hf_moe_offload.stats(model)
    assert stats["prepacked_bytes"] == stats["dense_in_file_bytes"] > 0


def test_disable_puts_the_weights_back_in_memory(bf16_mixtral, every_size):
    model = offloaded("mixtral", bf16_mixtral, **DISK)
    layers = _own_linears(model)
    hf_moe_offload.disable(model)
    ref = reference("mixtral", bf16_mixtral)
    for layer, ref_layer in zip(layers, _own_linears(ref)):
        assert not file_backed(layer.weight) and "forward" not in layer.__dict__
        assert torch.equal(layer.weight, ref_layer.weight)
    ids, mask = token_inputs(1, 6)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_disable_under_inference_mode_gives_back_weights_that_train(bf16_mixtral, every_size):
    model = offloaded("mixtral", bf16_mixtral, **DISK)
    layers = _own_linears(model)
    with torch.inference_mode():
        hf_moe_offload.disable(model)
    assert not any(p.is_inference() for p in model.parameters())
    with torch.no_grad():
        layers[-1].weight.mul_(1.0)              # an in-place update, as an optimizer makes


def test_a_weight_that_differs_from_its_file_or_is_shared_stays_in_memory(bf16_mixtral, every_size):
    model = reference("mixtral", bf16_mixtral).to(torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():      # in memory, as an offloaded load leaves them
            parameter.data = parameter.data.clone()
    index = CheckpointIndex.open(bf16_mixtral)
    q_proj, k_proj = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj
    with torch.no_grad():
        k_proj.weight[0, 0] += 1                                    # no longer the file's bytes
    model.lm_head.weight = model.model.embed_tokens.weight          # tied: the table is read by its row lookups
    layers = {"model.layers.0.self_attn.q_proj": q_proj, "model.layers.0.self_attn.k_proj": k_proj,
              "lm_head": model.lm_head}
    assert mapped_dense.map_dense_weights(model, layers, index, file_maps.FileMaps()) == [q_proj]
    assert file_backed(q_proj.weight) and not file_backed(k_proj.weight)
    assert not file_backed(model.lm_head.weight)


def _resident_bytes_of_mapping(address: int) -> int:
    """Resident bytes of the memory mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "Rss:":
            return int(fields[1]) * 1024
    raise AssertionError("no mapping holds the address")


def test_a_mapped_weight_is_read_once_then_its_pages_are_handed_back(tmp_path):
    """The comparison reads the weight's pages from the file; once packed, `release_pages` drops them, so the
    packed copy is the weight's only memory."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 1024, bias=False).to(torch.bfloat16)       # 2 MiB
    original = layer.weight.detach().clone()
    save_file({"proj.weight": original}, str(tmp_path / "model.safetensors"))
    model = torch.nn.Module()
    model.proj = layer
    [mapped] = mapped_dense.map_dense_weights(model, {"proj": layer}, CheckpointIndex.open(tmp_path),
                                               file_maps.FileMaps())
    weight = mapped.weight
    assert weight is not original and file_backed(weight)
    assert _resident_bytes_of_mapping(weight.data_ptr()) >= weight.nbytes - 8192
    mapped_dense.release_pages(weight)
    assert _resident_bytes_of_mapping(weight.data_ptr()) <= 8192              # at most the two boundary pages
    x = torch.randn(1, 1024).to(torch.bfloat16)
    assert torch.equal(torch.nn.functional.linear(x, weight), torch.nn.functional.linear(x, original))


def test_no_file_is_mapped_where_transformers_would_not_map_it(bf16_mixtral, every_size, monkeypatch):
    """`from_pretrained(disable_mmap=True)` keeps the dense weights and the embedding table in memory; so does a
    checkpoint on hf-mount, where transformers reads files instead of mapping them. An explicit
    `embedding="mapped"` there is refused, naming why."""
    stats = hf_moe_offload.stats(offloaded("mixtral", bf16_mixtral, **DISK))
    assert stats["dense_in_file_bytes"] > 0 and stats["embedding"] == "mapped"
    no_mmap = model_class("mixtral").from_pretrained(bf16_mixtral, offload_policy=DISK, disable_mmap=True)
    stats = hf_moe_offload.stats(no_mmap)
    assert stats["dense_in_file_bytes"] == 0 and stats["embedding"] == "memory"
    assert not any(file_backed(layer.weight) for layer in _own_linears(no_mmap))
    with pytest.raises(hf_moe_offload.PolicyError, match="disable_mmap"):
        model_class("mixtral").from_pretrained(bf16_mixtral, offload_policy={**DISK, "embedding": "mapped"},
                                               disable_mmap=True)
    monkeypatch.setattr(file_maps, "_is_on_hf_mount", lambda path: True)
    on_mount = offloaded("mixtral", bf16_mixtral, **DISK)
    stats = hf_moe_offload.stats(on_mount)
    assert stats["dense_in_file_bytes"] == 0 and stats["embedding"] == "memory"
    with pytest.raises(hf_moe_offload.PolicyError, match="hf-mount"):
        offloaded("mixtral", bf16_mixtral, **DISK, embedding="mapped")
