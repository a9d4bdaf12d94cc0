"""Test helpers: turn a tiny float checkpoint into a packed (GPTQ, AWQ, compressed-tensors) one, and write next to
it the dense checkpoint of the same weights as the format's reference dequantizes them, which transformers loads
as the unpatched model to compare with."""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

# (module, float weight [out, in]) -> (the packed tensors by suffix, the reference's dequantized weight)
Packer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def quantized_layer(key: str, tensor: torch.Tensor) -> bool:
    """The layers a quantizer packs: every linear of the attention and of the experts (not embeddings, norms,
    router, lm_head), with a shared expert's (Qwen2-MoE)."""
    return key.endswith(".weight") and tensor.dim() == 2 and any(s in key for s in (".self_attn.", ".experts.",
                                                                                  ".shared_expert."))


def pack_checkpoint(path: str, packed_path: str, dense_path: str, packer: Packer, quantization_config: dict) -> None:
    """Write `packed_path` (the checkpoint at `path`, its linears packed by `packer`, the config given
    `quantization_config`) and `dense_path` (the same, each linear replaced by its reference dequantization, cast to
    the checkpoint's dtype; no quantization_config)."""
    for out in (packed_path, dense_path):
        shutil.copytree(path, out, dirs_exist_ok=True)
    index_name = "model.safetensors.index.json"
    index = json.load(open(os.path.join(path, index_name))) if os.path.exists(os.path.join(path, index_name)) else None
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        packed, dense = {}, {}
        for key, tensor in load_file(file).items():
            if not quantized_layer(key, tensor):
                packed[key] = dense[key] = tensor
                continue
            module = key.removesuffix(".weight")
            tensors, reference = packer(module, tensor)
            dense[key] = reference.to(tensor.dtype).contiguous()
            for suffix, value in tensors.items():
                packed[f"{module}.{suffix}"] = value.contiguous()
                if index is not None:
                    index["weight_map"].pop(key, None)
                    index["weight_map"][f"{module}.{suffix}"] = os.path.basename(file)
        save_file(packed, os.path.join(packed_path, os.path.basename(file)), metadata={"format": "pt"})
        save_file(dense, os.path.join(dense_path, os.path.basename(file)), metadata={"format": "pt"})
    if index is not None:
        json.dump(index, open(os.path.join(packed_path, index_name), "w"))
    edit_config(packed_path, quantization_config=quantization_config)


def edit_config(path: str, **fields) -> None:
    config_path = os.path.join(path, "config.json")
    config = json.load(open(config_path))
    config.update(fields)
    json.dump(config, open(config_path, "w"))


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> the int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
