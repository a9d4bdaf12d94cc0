"""A CPU store served in place on the CPU keeps only its experts' packed copies: the slabs' pages are handed back at
load, decoding gives the unpatched model's tokens and logits, `state_dict()` and `disable()` read the plain bytes
from the checkpoint, and anything that would read a handed-back weight instead of its copy is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny, forward_logits, offloaded, reference, token_inputs
from test_families import tiny_config

import hf_moe_offload
from hf_moe_offload.memory import cpu_kernels
from hf_moe_offload.memory.cpu_kernels import prepack_supported

pytestmark = pytest.mark.skipif(not prepack_supported(torch.bfloat16), reason="oneDNN has no bf16 on this CPU")

IN_MEMORY = dict(device="cpu", store="cpu")


@pytest.fixture(scope="module")
def bf16_mixtral(tmp_path_factory):
    return build_tiny("mixtral", tmp_path_factory.mktemp("bf16") / "mixtral", dtype=torch.bfloat16)


def test_only_the_copies_stay_and_the_model_is_unchanged(bf16_mixtral):
    model = offloaded("mixtral", bf16_mixtral, **IN_MEMORY)
    store = hf_moe_offload.get_engine(model).store
    assert not store.plain_in_memory and store.reader is not None
    assert (store.slabs[0] == 0).float().mean() > 0.5              # the pages were handed back: they read as zeros
    assert hf_moe_offload.stats(model)["prepacked_bytes"] >= store.total_bytes
    ref = reference("mixtral", bf16_mixtral).to(torch.bfloat16)
    ids, mask = token_inputs(2, 7)
    # The same bits as experts whose plain bytes stay (a disk store's slots compute through F.linear, the same bits
    # as the packed kernel), and the unpatched model's tokens.
    slots = offloaded("mixtral", bf16_mixtral, device="cpu", store="disk", expert_cache="100%")
    assert torch.equal(forward_logits(model, "mixtral", ids, mask), forward_logits(slots, "mixtral", ids, mask))
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    state, ref_state = model.state_dict(), ref.state_dict()            # the experts read from the checkpoint
    assert set(state) == set(ref_state) and all(torch.equal(state[k], v) for k, v in ref_state.items())
    hf_moe_offload.disable(model)
    assert all(torch.equal(p, ref_state[k]) for k, p in model.state_dict().items())


def test_a_handed_back_weight_is_refused_rather_than_read(bf16_mixtral):
    model = offloaded("mixtral", bf16_mixtral, **IN_MEMORY)
    store = hf_moe_offload.get_engine(model).store
    weight = next(iter(store.layouts[0].views(store.slabs[0][0]).values()))
    x = torch.randn(1, weight.shape[1])
    assert cpu_kernels.linear(x.to(torch.bfloat16), weight).abs().sum() > 0      # its copy computes
    with pytest.raises(RuntimeError, match="held only as its packed CPU copy.*float32 input.*disable"):
        cpu_kernels.linear(x, weight)                                            # F.linear would read zeros


def test_x_at_w_experts_keep_their_slabs(tmp_path):
    """Experts computed as `x @ W` (GPT-OSS) never go through the packed kernel: their slabs stay in memory."""
    config = tiny_config("gpt_oss", experts=4)
    model = hf_moe_offload.from_pretrained(_saved(config, tmp_path), dtype=torch.bfloat16, offload_policy=IN_MEMORY)
    store = hf_moe_offload.get_engine(model).store
    assert store.plain_in_memory and store.slabs[0].abs().sum() > 0


def _saved(config, tmp_path) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    return str(tmp_path / "m")
