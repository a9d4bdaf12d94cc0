"""Tiny models of every supported family, built from configs with a fixed seed and saved in the Hub's checkpoint
layout (`save_pretrained` default), so tests load them through the real loading path. No network."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoModelForSeq2SeqLM, MixtralConfig, OlmoeConfig,
                          Qwen2MoeConfig, Qwen3MoeConfig, SwitchTransformersConfig)

import hf_moe_offload  # noqa: F401  (installs the offload_policy keyword)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers share the machine's cores: one intra-op thread each, so they do not oversubscribe them
    # (torch's OpenMP threads spin-wait for a core another worker holds).
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Machine profiles and quantized folders go to a folder of this run, not the user's cache: a profile cached
    there would make offload_policy="auto" plan differently, and tests must not fill it with quantized experts."""
    previous = os.environ.get("HF_MOE_OFFLOAD_CACHE")
    os.environ["HF_MOE_OFFLOAD_CACHE"] = str(tmp_path_factory.mktemp("hf_moe_offload_cache"))
    yield
    if previous is None:
        os.environ.pop("HF_MOE_OFFLOAD_CACHE", None)
    else:
        os.environ["HF_MOE_OFFLOAD_CACHE"] = previous

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)

CONFIGS = {
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=40,
                                        shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
                                        decoder_sparse_step=1, norm_topk_prob=False),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=40, head_dim=8,
                                        num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1),
    "olmoe": lambda: OlmoeConfig(**COMMON, intermediate_size=40, num_experts=6, num_experts_per_tok=2),
    "switch_transformers": lambda: SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
        num_experts=4, encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=64, pad_token_id=0,
        eos_token_id=2, decoder_start_token_id=0),
}
CAUSAL_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
FAMILIES = CAUSAL_FAMILIES + ["switch_transformers"]


def model_class(family: str):
    return AutoModelForSeq2SeqLM if family == "switch_transformers" else AutoModelForCausalLM


def token_inputs(batch: int, length: int, seed: int = 1, left_pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompt ids and their attention mask; `left_pad` pads rows 1 and 2 by 3 and 5 tokens on the left."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if left_pad:
        for row, pad in enumerate([0, 3, 5][:batch]):
            ids[row, :pad] = 0
            mask[row, :pad] = 0
    return ids, mask


def prompt_ids(lengths: tuple[int, ...], seed: int = 4) -> list[list[int]]:
    """Random prompts of the given lengths as token-id lists (what `generate_batch` takes)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def generate_each(model, prompts: list[list[int]], generation_config) -> list[list[int]]:
    """`generate` one prompt at a time, new tokens up to and including EOS (as `generate_batch` reports them): the
    reference continuous batching must reproduce."""
    eos, tokens = generation_config.eos_token_id, []
    for p in prompts:
        new = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             generation_config=generation_config)[0, len(p):].tolist()
        tokens.append(new[:new.index(eos) + 1] if eos in new else new)
    return tokens


def build_tiny(family: str, path, seed: int = 0, dtype: torch.dtype = torch.float32, **save_kwargs) -> str:
    """Build a tiny `family` model with random weights and save it in the Hub layout at `path`."""
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    model = model_class(family).from_config(config).to(dtype).eval()
    # Larger router weights make routing decisive (random near-ties would make greedy tokens fragile).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.classifier.weight")) and p.dim() == 2 and p.shape[0] <= 8:
                p.mul_(8.0)
    model.save_pretrained(path, **save_kwargs)
    return str(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> path of a saved tiny model (sharded, so several files are read)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {f: build_tiny(f, root / f, max_shard_size="100KB") for f in FAMILIES}


def reference(family: str, path: str):
    return model_class(family).from_pretrained(path).eval()


def offloaded(family: str, path: str, **policy):
    return model_class(family).from_pretrained(path, offload_policy=policy).eval()


def file_backed(weight: torch.Tensor) -> bool:
    """Whether `weight`'s memory is a mapping of a safetensors file (the process's memory map says so)."""
    address = weight.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return rest[-1].endswith(".safetensors")
    return False


def forward_logits(model, family: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One forward's logits (Switch: with the first 5 ids as decoder inputs), without autograd."""
    with torch.no_grad():
        if family == "switch_transformers":
            return model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :5]).logits
        return model(input_ids=ids, attention_mask=mask).logits
