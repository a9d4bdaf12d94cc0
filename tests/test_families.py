"""Every fused-experts family hf_moe_offload discovers in the installed transformers: a tiny random model saved in
the Hub layout gives the unpatched model's greedy tokens offloaded to disk with a cache of a third of its experts
(transposed Aria and gateless Nemotron-H experts included); an experts layout still not supported (biased) is
refused naming why."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.integrations.moe import use_experts_implementation

import hf_moe_offload
from hf_moe_offload.arch import UnsupportedModelError, get_arch, supported_families, supported_model_types
from hf_moe_offload.arch import fused
from hf_moe_offload.arch.fused import FusedExpertsArch, discover_families

from conftest import CONFIGS, VOCAB, token_inputs

# Defaults of the config classes shrunk to a tiny model; only the fields a config has are set.
SHRINK = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
              shared_expert_intermediate_size=24, n_shared_experts=1, n_group=1, topk_group=1,
              num_expert_group=1, num_group=1, first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[], num_dense_layers=0,
              q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, qk_head_dim=8,
              moe_layer_start_index=0, moe_layer_interval=1, expert_layer_period=1, expert_layer_offset=0,
              attn_layer_period=1, attn_layer_offset=0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, sliding_window=64, enable_moe_block=True)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_KS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts")
# Indexed (DSA) attention: an indexer of 2 heads of 8 picking 4 keys. MLA expands its latent into per-head keys,
# so these families need as many key/value heads as query heads.
_INDEXED = dict(index_head_dim=8, index_n_heads=2, index_topk=4, num_key_value_heads=4)
# Fields the shrunk defaults do not fit, per family (sizes, and hybrids' layer kinds: one of each, an attention last).
OVERRIDES = {
    "zaya": {"num_experts_per_tok": 1},          # its config refuses any other top-k
    "axk2": _INDEXED, "deepseek_v32": _INDEXED, "glm_moe_dsa": _INDEXED, "dots3_note_text": _INDEXED,
    "hy_v4": dict(index_head_dim=8, index_n_heads=2, index_topk=4),
    "deepseek_v4": dict(index_head_dim=8, index_n_heads=2, index_topk=4, o_lora_rank=16, head_dim=8,
                        num_key_value_heads=1, mlp_layer_types=["hash_moe", "moe"]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8),
    "inkling2_text": dict(head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                          moe_intermediate_size=40,   # gate_up [80, 32] and down [32, 40]: a transpose would show
                          unpadded_vocab_size=VOCAB),  # transformers 5.24 pads the unembedding to vocab_size on save
    "inkling2_loop_text": dict(head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                               moe_intermediate_size=40, unpadded_vocab_size=VOCAB),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # Two MoE layers around an attention layer; up [40, 32] and down [32, 40]: a transpose would show.
    "nemotron_h": dict(layers_block_type=["moe", "full_attention", "moe"], moe_intermediate_size=40,
                       moe_shared_expert_intermediate_size=24),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention"], linear_key_head_dim=8,
                           linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, hc_lowrank=8,
                           indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                           indexer_compress_ratio=2),
}
# Composite (vision + text) families: tiny towers for the whole model, saved in the layout their Hub checkpoints
# have; AutoModelForCausalLM loads the text model from it (Qwen4-Exp's keys are under model.language_model.).
TOWERS = {
    "dots3_note": dict(
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           moe_intermediate_size=16, mlp_layer_types=["dense"], num_local_experts=2,
                           adapter_in_dim=16, adapter_out_dim=32, per_layer_config={}),
        audio_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=8, downsample_hidden_size=8, adapter_input_size=16,
                          adapter_out_dim=32, conv_output_size=24)),
    "qwen4_exp": dict(vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                         out_hidden_size=32, num_position_embeddings=16)),
}
TOWERS["qwen3_5_moe"] = TOWERS["qwen3_vl_moe"] = TOWERS["qwen4_exp"]      # the same vision tower
OVERRIDES["dots3_note"], OVERRIDES["qwen4_exp"] = OVERRIDES["dots3_note_text"], OVERRIDES["qwen4_exp_text"]
# Families whose tiny model cannot be built here, and why (none today).
SKIP: dict[str, str] = {}


def tiny_config(model_type: str, experts: int = 6, layers: int = 2):
    """The config class's defaults shrunk: hidden 32, `layers` layers all MoE, `experts` experts, top-2."""
    text = AutoConfig.for_model(model_type).get_text_config(decoder=True)
    fields = text.to_dict()
    kwargs = {k: v for k, v in SHRINK.items() if k in fields}
    if "qk_rope_head_dim" in fields:          # MLA: rotary part of the head sets head_dim
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    kwargs["num_hidden_layers"] = layers
    kwargs.update({k: experts for k in EXPERT_COUNTS if k in fields})
    kwargs.update({k: 2 for k in TOP_KS if k in fields})
    for key, value in fields.items():         # per-layer lists follow the new depth
        if isinstance(value, list) and len(value) == text.num_hidden_layers and value and isinstance(value[0], str):
            if "mlp" in key or "moe" in key:
                kwargs[key] = ["sparse" if v == "dense" else v for v in value[:layers]]
            else:                              # keep one full attention layer (hybrid models need one)
                full = [v for v in value if "full" in v]
                kwargs[key] = value[:layers - 1] + [full[0] if full else value[layers - 1]]
    kwargs.update(OVERRIDES.get(model_type, {}))
    return type(text)(**kwargs)


def tiny_model(model_type: str):
    """A random model of `tiny_config(model_type)`; for a composite family (`TOWERS`) the whole vision + text
    model, whose checkpoint is laid out as the family's published ones."""
    if model_type not in TOWERS:
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    else:
        composite = type(AutoConfig.for_model(model_type))(text_config=tiny_config(model_type).to_dict(),
                                                           **TOWERS[model_type])
        model = AutoModelForImageTextToText.from_config(composite)
    with torch.no_grad():     # routers initialised to zero (AFMoE) would send every token to the same experts
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and not p.any():
                p.normal_(0.0, 0.02)
    return model


FUSED = sorted(t for t, f in discover_families().items() if f.supported)


@pytest.fixture(scope="module")
def saved_families(tmp_path_factory):
    """model_type -> (checkpoint, the unpatched model's tokens and logits), built on first use and shared by the
    micro-batch variants: building, saving and running a family's reference costs as much as the offloaded run."""
    cache: dict[str, tuple] = {}

    def get(model_type: str) -> tuple:
        if model_type not in cache:
            path = tmp_path_factory.mktemp(model_type)
            torch.manual_seed(0)
            model = tiny_model(model_type).eval()
            with torch.no_grad():      # decisive routing: random near-ties would make greedy tokens fragile
                for name, p in model.named_parameters():
                    if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and p.shape[0] <= 8:
                        p.mul_(8.0)
            model.save_pretrained(path)           # Hub layout (per-expert keys where the family has them)
            del model
            ids, mask = token_inputs(2, 6)
            reference = AutoModelForCausalLM.from_pretrained(path).eval()
            with torch.no_grad():
                want = reference.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                          pad_token_id=0)
                want_logits = reference(ids, attention_mask=mask).logits
            cache[model_type] = (path, want, want_logits)
        return cache[model_type]

    return get


@pytest.mark.parametrize("model_type", FUSED)
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_family_offloaded_to_disk_gives_the_same_tokens(model_type, micro_batches, saved_families):
    """Also with micro-batches (2 slices of the batch per MoE decoder layer, a cache holding a layer's experts):
    every family's decoder layers run on slices of their inputs and their caches, or whole where they cannot."""
    if model_type in SKIP:
        pytest.skip(SKIP[model_type])
    path, want, want_logits = saved_families(model_type)
    ids, mask = token_inputs(2, 6)
    policy = {"device": "cpu", "store": "disk", "expert_cache": "34%"}     # 4 of 12
    if micro_batches > 1:
        policy.update(expert_cache="67%", micro_batches=micro_batches)      # 8 of 12: a layer's 6 and 2 more
    model = AutoModelForCausalLM.from_pretrained(path, offload_policy=policy).eval()
    engine = hf_moe_offload.get_engine(model)
    assert engine is not None and len(engine.layers) == 2
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got_logits = model(ids, attention_mask=mask).logits
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-5)
    stats = hf_moe_offload.stats(model)
    assert stats["misses"] > 0     # the experts really came from disk through the cache
    assert stats["evictions"] > 0 or micro_batches > 1         # (a cache holding a layer may hold them all)
    if micro_batches > 1:
        assert stats["repeat_reads"] == 0
        assert stats["micro_batches"]["split"] + stats["micro_batches"]["whole"] > 0


@pytest.mark.parametrize("model_type", ["dots3_note", "qwen3_5_moe", "qwen3_vl_moe"])
def test_vision_text_families_load_as_image_text_to_text_and_save_whole(model_type, tmp_path):
    """Loaded as their whole vision + text model: the experts are found where the published layout keeps them (at
    the top for Dots3-Note, which transformers renames by class), and `save_pretrained` writes every expert through
    the family's save-time conversions (Qwen3-VL-MoE's transposes check the shapes they write)."""
    torch.manual_seed(0)
    tiny_model(model_type).save_pretrained(tmp_path / "model")
    ids, mask = token_inputs(2, 6)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    unpatched = AutoModelForImageTextToText.from_pretrained(tmp_path / "model").eval()
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "model", offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": "34%"}).eval()
    want = unpatched.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs), want)
    model.save_pretrained(tmp_path / "saved")
    saved = AutoModelForImageTextToText.from_pretrained(tmp_path / "saved").eval()
    assert saved.state_dict().keys() == unpatched.state_dict().keys()
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in unpatched.state_dict().items())


def test_discovery_registers_the_families_seen_to_work():
    types = supported_model_types()
    for model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "phimoe",
                       "glm4_moe", "jamba", "granitemoe", "switch_transformers"):
        assert model_type in types
    assert len(FUSED) >= 40                    # transformers 5.23 has ~50 such decoder families
    assert discover_families()["granitemoe"].fused_renames    # input_linear/output_linear in its checkpoints
    assert discover_families()["phimoe"].expert_names == ("w1", "w3", "w2")
    assert isinstance(get_arch(AutoConfig.for_model("deepseek_v3")), FusedExpertsArch)


@use_experts_implementation(has_bias=True)
class BiasedExperts(nn.Module):
    """A layout still unsupported by the fused path: biased experts (GPT-OSS has an adapter of its own)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.randn(self.num_experts, 2 * inter, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.randn(self.num_experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.randn(self.num_experts, hidden, inter))
        self.down_proj_bias = nn.Parameter(torch.randn(self.num_experts, hidden))
        self.act_fn = torch.nn.functional.silu

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise NotImplementedError   # never reached: the layout is refused first


def test_unsupported_layout_is_refused_naming_why(monkeypatch):
    # Discovery: a family whose only experts class is biased is listed as refused, with the flag that is wrong.
    monkeypatch.setattr(fused, "_modeling_module", lambda t: SimpleNamespace(
        __name__=__name__, BiasedExperts=BiasedExperts))
    monkeypatch.setattr(fused, "_SEEN", {})
    family = fused.discover_family.__wrapped__("biased_moe_for_test")
    assert family.refused == "BiasedExperts has biased experts (has_bias=True)"
    # A built model holding such experts: enable() refuses naming why and what is allowed, and changes nothing.
    model = AutoModelForCausalLM.from_config(CONFIGS["mixtral"]()).eval()
    for layer in model.model.layers:
        layer.mlp.experts = BiasedExperts(model.config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=r"BiasedExperts has biased experts \(has_bias=True\).*"
                                                    r"supported: gate_up_proj \[E, 2I, H\]"):
        hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
    assert hf_moe_offload.get_engine(model) is None
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_transposed_and_gateless_families_are_supported():
    rows = {r["model_type"]: r for r in supported_families()}
    assert rows["aria_text"]["status"] == rows["nemotron_h"]["status"] == "supported"
    assert rows["aria_text"]["checkpoint"] == "fused: fc1, fc2"               # as Aria's Hub checkpoints hold them
    assert rows["nemotron_h"]["checkpoint"] == "per expert: up_proj, down_proj"
    assert {"aria_text", "nemotron_h"} <= set(FUSED)


@pytest.mark.parametrize("model_type", ["jetmoe", "llama"])   # DBRX, Llama-4, GPT-OSS: own adapters (test_adapters)
def test_experts_outside_the_interface_are_refused(model_type):
    with pytest.raises(UnsupportedModelError, match="fused experts interface.*supported model type.*docs/models.md"):
        get_arch(AutoConfig.for_model(model_type))
