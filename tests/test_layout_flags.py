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

from hf_moe_offload.arch.fused import FusedExpertsArch
from hf_moe_offload.arch.forward import MatmulSlabLayout
from hf_moe_offload.policy.offload_policy import PolicyError

from conftest import token_inputs
from test_adapters import _outputs, check_disk_offload_saves_and_disables, check_host_store_and_enable_disable
from test_families import tiny_model

FAMILIES = ["aria_text", "nemotron_h"]


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
    check_disk_offload_saves_and_disables(*saved[family], FusedExpertsArch, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_host_memory_store_and_enable_disable_are_exact(family, saved):
    check_host_store_and_enable_disable(*saved[family])


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
