"""The families with adapters of their own (GPT-OSS, DBRX, Llama-4 text): a tiny random model saved in the Hub
layout gives the unpatched model's greedy tokens and logits offloaded to disk with a cache of a third of its
experts and in host memory; a saved offloaded model reloads to the same tokens; disable() gives the model back;
what they cannot do (int8/int4 experts; MXFP4 checkpoints but GPT-OSS's, tests/test_mxfp4.py) is refused naming
why."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import (AutoModelForCausalLM, DbrxConfig, GptOssConfig, Llama4Config, Llama4ForConditionalGeneration,
                          Llama4TextConfig)

import hf_moe_offload
from hf_moe_offload.arch import get_arch, supported_families
from hf_moe_offload.arch.dbrx import DbrxArch
from hf_moe_offload.arch.gpt_oss import GptOssArch
from hf_moe_offload.arch.llama4 import Llama4Arch
from hf_moe_offload.planning.footprint import footprint
from hf_moe_offload.policy.offload_policy import PolicyError

from conftest import VOCAB, token_inputs

IDS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
LLAMA4_TEXT = dict(IDS, hidden_size=32, intermediate_size=48, intermediate_size_mlp=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=6,
                   num_experts_per_tok=1, max_position_embeddings=128, interleave_moe_layer_step=1)
CONFIGS = {
    "gpt_oss": lambda: GptOssConfig(**IDS, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=6,
                                    num_experts_per_tok=2, max_position_embeddings=128, sliding_window=64,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                    swiglu_limit=0.3),       # low enough that the clamp acts (see _random_biases)
    "dbrx": lambda: DbrxConfig(**IDS, d_model=32, n_heads=4, n_layers=2, max_seq_len=128,
                               attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                               ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 6, "moe_top_k": 2}),
    "llama4_text": lambda: Llama4TextConfig(**LLAMA4_TEXT),
}
ADAPTERS = {"gpt_oss": GptOssArch, "dbrx": DbrxArch, "llama4_text": Llama4Arch}
GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


def _decisive_routers(model) -> None:
    """Larger router weights: random near-ties would make greedy tokens fragile."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("router.weight", "router.layer.weight")):
                p.mul_(8.0)


def _random_biases(model) -> None:
    """Expert biases start at zero; random ones (and, with swiglu_limit=0.3, a clamp that acts) make the test see
    a forward that drops a bias or the clamp."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                p.normal_(0.0, 0.5)


def _outputs(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **GEN), model(ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (path of the tiny model in the Hub layout, its greedy tokens, its logits)."""
    out = {}
    ids, mask = token_inputs(2, 6, left_pad=True)
    for family, config in CONFIGS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config()).eval()
        _decisive_routers(model)
        _random_biases(model)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path, max_shard_size="100KB")     # several shards, as a real checkpoint
        reference = AutoModelForCausalLM.from_pretrained(path).eval()
        out[family] = (str(path), *_outputs(reference, ids, mask))
    return out


def check_disk_offload_saves_and_disables(path: str, want, want_logits, arch: type, tmp_path) -> None:
    """Offloaded to disk with a third of the experts cached: the unpatched tokens and logits through the cache; a
    saved offloaded model reloads to the same tokens and the same weights; `disable()` gives the model back (also
    used by tests/test_layout_flags.py)."""
    ids, mask = token_inputs(2, 6, left_pad=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, offload_policy={"device": "cpu", "store": "disk", "expert_cache": "34%"}).eval()   # 4 of 12
    engine = hf_moe_offload.get_engine(model)
    assert isinstance(engine.arch, arch) and len(engine.layers) == 2
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
    assert all(p.device.type == "cpu" for p in model.parameters())
    back, back_logits = _outputs(model, ids, mask)
    assert torch.equal(back, want)
    torch.testing.assert_close(back_logits, want_logits, rtol=1e-4, atol=1e-5)


def check_host_store_and_enable_disable(path: str, want, want_logits) -> None:
    """Experts in host memory give the unpatched tokens; enable() then disable() on a built model is bit-identical
    (also used by tests/test_layout_flags.py)."""
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


@pytest.mark.parametrize("family", list(CONFIGS))
def test_offloaded_to_disk_gives_the_same_tokens_saves_and_disables(family, saved, tmp_path):
    check_disk_offload_saves_and_disables(*saved[family], ADAPTERS[family], tmp_path)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_host_memory_store_and_enable_disable_are_exact(family, saved):
    check_host_store_and_enable_disable(*saved[family])


@pytest.mark.parametrize("family", list(CONFIGS))
def test_router_methods_rebuild_the_routers_own_output(family, saved):
    """routing_from_logits(router_logits(output)) is the router's output: predicted routing and look-ahead rely
    on it."""
    model = AutoModelForCausalLM.from_pretrained(saved[family][0]).eval()
    arch = get_arch(model.config)
    layer = arch.find_layers(model)[0]
    router = arch.router_module(model, layer)
    assert arch.router_weight(model, layer).shape == (6, 32)
    seen = []
    handle = router.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(token_inputs(1, 5)[0])
    handle.remove()
    output = seen[0]
    rebuilt = arch.routing_from_logits(router, arch.router_logits(output, router), output)
    for got, want in zip(rebuilt if isinstance(rebuilt, tuple) else (rebuilt,),
                         output if isinstance(output, tuple) else (output,)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family, name", [("gpt_oss", "GPT-OSS"), ("dbrx", "DBRX"), ("llama4_text", "Llama-4")])
@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_quantized_experts_are_refused_naming_the_family(family, name, store, saved, tmp_path):
    with pytest.raises(PolicyError, match=f"quantize='int8'/'int4' is not available for {name}.*quantize='none'"):
        AutoModelForCausalLM.from_pretrained(saved[family][0], offload_folder=str(tmp_path / "q"),
                                             offload_policy={"device": "cpu", "store": store, "quantize": "int8"})
    assert not (tmp_path / "q").exists()                      # refused before anything was written


@pytest.mark.parametrize("family", ["dbrx", "llama4_text"])
def test_mxfp4_checkpoint_of_another_adapter_family_is_refused_naming_the_method(family, saved, tmp_path):
    """MXFP4 is read for GPT-OSS only (tests/test_mxfp4.py); on the other adapters' families it is refused."""
    path = tmp_path / "mxfp4"
    shutil.copytree(saved[family][0], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PolicyError, match=f"quant_method='mxfp4' on model type '{family}'.*unquantized weights"):
        AutoModelForCausalLM.from_pretrained(path, offload_policy={"device": "cpu", "store": "disk"})


def test_llama4_composite_checkpoint_loads_its_text_model_offloaded(tmp_path):
    """A Llama-4 checkpoint with its vision tower (experts under `language_model.`), loaded for text generation."""
    torch.manual_seed(0)
    config = Llama4Config(text_config=LLAMA4_TEXT, vision_config=dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32, image_size=28,
        patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32))
    model = Llama4ForConditionalGeneration(config).eval()
    _decisive_routers(model)
    model.save_pretrained(tmp_path)
    ids, mask = token_inputs(2, 6)
    want = _outputs(AutoModelForCausalLM.from_pretrained(tmp_path).eval(), ids, mask)[0]
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, offload_policy={"device": "cpu", "store": "disk", "expert_cache": "34%"}).eval()
    assert isinstance(hf_moe_offload.get_engine(offloaded).arch, Llama4Arch)
    assert torch.equal(_outputs(offloaded, ids, mask)[0], want)
    assert hf_moe_offload.stats(offloaded)["misses"] > 0


def test_families_table_lists_them_as_supported():
    rows = {r["model_type"]: r for r in supported_families()}
    for model_type, adapter in (("gpt_oss", "GptOssArch"), ("dbrx", "DbrxArch"), ("llama4", "Llama4Arch"),
                                ("llama4_text", "Llama4Arch")):
        assert rows[model_type]["status"] == "supported" and adapter in rows[model_type]["experts"]
    assert rows["gpt_oss"]["checkpoint"].startswith("fused: gate_up_proj, gate_up_proj_bias")


def test_cpu_attention_of_a_model_sdpa_cannot_run_is_refused(saved):
    """GPT-OSS adds learned attention sinks, which transformers' sdpa (what CPU attention runs) would drop: the
    policy is refused before loading, and "auto" keeps the attention on the device."""
    path = saved["gpt_oss"][0]
    with pytest.raises(PolicyError, match="GptOssForCausalLM does not support.*attention='device'"):
        AutoModelForCausalLM.from_pretrained(path, offload_policy={"device": "cpu", "store": "disk",
                                                                   "attention": "cpu"})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    arch = get_arch(model.config)
    assert footprint(model, arch.find_layers(model), torch.float32).cpu_attention_refusal is not None


def test_dbrx_with_four_experts_per_token_in_bfloat16_is_bit_exact(tmp_path):
    """DBRX adds its experts' outputs into a bfloat16 buffer one expert at a time (real DBRX routes to four):
    the offloaded sum rounds the same way, so the logits are the same bits."""
    torch.manual_seed(0)
    config = DbrxConfig(**IDS, d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                        ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 8, "moe_top_k": 4})
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    _decisive_routers(model)
    model.save_pretrained(tmp_path / "dbrx")
    ids, mask = token_inputs(4, 10, left_pad=True)
    expected = _outputs(AutoModelForCausalLM.from_pretrained(tmp_path / "dbrx").eval(), ids, mask)
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dbrx", offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": "50%"}).eval()
    tokens, logits = _outputs(offloaded, ids, mask)
    assert torch.equal(logits, expected[1]) and torch.equal(tokens, expected[0])
