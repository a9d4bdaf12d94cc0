"""The fused families with layout flags other than Mixtral's: Aria (`is_transposed=True`: `gate_up_proj [E, H, 2I]`,
`down_proj [E, I, H]`, Hub keys `fc1`/`fc2`) and Nemotron-H (`has_gate=False`: `up_proj`, `down_proj` and a
relu² on `up` alone; Hub keys per expert under `backbone.`). A tiny random model saved in the Hub layout gives the
unpatched model's tokens offloaded to disk or held in host memory; a saved offloaded model reloads to the same
tokens; `disable()` gives the model back bit-identical; int8 works for the gateless layout and is refused, naming
why, for the transposed one."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_moe_offload
from hf_moe_offload.arch.fused import FusedExpertsArch
from hf_moe_offload.execute import MatmulSlabLayout
from hf_moe_offload.policy import PolicyError

from conftest import token_inputs
from test_families import tiny_model

FAMILIES = ["aria_text", "nemotron_h"]
GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


def _outputs(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **GEN), model(ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (path of the tiny model in the Hub layout, its greedy tokens, its logits)."""
    out = {}
    ids, mask = token_inputs(2, 6, left_pad=True)
    for family in FAMILIES:
        torch.manual_seed(0)
        model = tiny_model(family).eval()
        with torch.no_grad():      # decisive routing: random near-ties would make greedy tokens fragile
            for name, p in model.named_parameters():
                if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2:
                    p.mul_(8.0)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path, max_shard_size="20KB")       # several shards, as a real checkpoint
        reference = AutoModelForCausalLM.from_pretrained(path).eval()
        out[family] = (str(path), *_outputs(reference, ids, mask))
    return out


def test_slab_layouts_follow_the_flags(saved):
    arch = FusedExpertsArch()
    aria = AutoModelForCausalLM.from_pretrained(saved["aria_text"][0])
    layout = arch.layout(aria.model.layers[0].mlp.experts)
    assert isinstance(layout, MatmulSlabLayout)                   # kept [in, out]: no [out, in] int8/int4 kernel
    assert layout.parts == (("gate_up", (32, 96)), ("down", (48, 32)))
    nemotron = AutoModelForCausalLM.from_pretrained(saved["nemotron_h"][0])
    layout = arch.layout(nemotron.model.layers[0].mixer.experts)
    assert not isinstance(layout, MatmulSlabLayout)
    assert layout.parts == (("up", (40, 32)), ("down", (32, 40)))


@pytest.mark.parametrize("family", FAMILIES)
def test_disk_store_saves_and_disables_to_the_same_tokens(family, saved, tmp_path):
    path, want, want_logits = saved[family]
    ids, mask = token_inputs(2, 6, left_pad=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, offload_policy={"device": "cpu", "store": "disk", "expert_cache": "34%"}).eval()   # 4 of 12
    assert isinstance(hf_moe_offload.get_engine(model).arch, FusedExpertsArch)
    got, got_logits = _outputs(model, ids, mask)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-5)
    stats = hf_moe_offload.stats(model)
    assert stats["misses"] > 0 and stats["evictions"] > 0     # the experts really came from disk through the cache

    model.save_pretrained(tmp_path / "saved")                 # every expert, read back from the store
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert torch.equal(_outputs(reloaded, ids, mask)[0], want)
    original = AutoModelForCausalLM.from_pretrained(path).state_dict()
    for key, value in reloaded.state_dict().items():         # the experts in their own orientation
        torch.testing.assert_close(value, original[key], rtol=0, atol=0)

    hf_moe_offload.disable(model)
    assert hf_moe_offload.get_engine(model) is None
    back, back_logits = _outputs(model, ids, mask)
    assert torch.equal(back, want)
    torch.testing.assert_close(back_logits, want_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_host_memory_store_and_enable_disable_are_exact(family, saved):
    path, want, want_logits = saved[family]
    ids, mask = token_inputs(2, 6, left_pad=True)
    model = AutoModelForCausalLM.from_pretrained(path, offload_policy={"device": "cpu", "store": "cpu"}).eval()
    got, got_logits = _outputs(model, ids, mask)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-5)

    built = AutoModelForCausalLM.from_pretrained(path).eval()
    before = _outputs(built, ids, mask)[1]
    hf_moe_offload.enable(built, {"device": "cpu", "store": "disk", "expert_cache": "50%"})
    assert torch.equal(_outputs(built, ids, mask)[0], want)
    hf_moe_offload.disable(built)
    assert torch.equal(_outputs(built, ids, mask)[1], before)   # bit-identical to before enable


def test_int8_works_for_gateless_experts(saved):
    path, _, want_logits = saved["nemotron_h"]
    ids, mask = token_inputs(2, 6, left_pad=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, offload_policy={"device": "cpu", "store": "cpu", "quantize": "int8"}).eval()
    got_logits = _outputs(model, ids, mask)[1]
    # Approximate (one scale per output channel), but close: a wrong part or orientation would be far off.
    error = (got_logits - want_logits).abs().max()
    assert 0 < error < 0.01 * want_logits.abs().max()


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_int8_is_refused_for_transposed_experts_naming_why(store, saved, tmp_path):
    with pytest.raises(PolicyError, match=r"quantize='int8'/'int4' is not available for AriaExperts experts "
                                          r"\(transposed weights.*allowed for AriaExperts: quantize='none'"):
        AutoModelForCausalLM.from_pretrained(saved["aria_text"][0], offload_folder=str(tmp_path / "q"),
                                             offload_policy={"device": "cpu", "store": store, "quantize": "int8"})
    assert not (tmp_path / "q").exists()                      # refused before anything was written
