"""`from_pretrained(path, gguf_file=..., offload_policy=...)`: a GGUF checkpoint with its experts offloaded and kept
in their GGUF blocks.

transformers loads the rest of the model itself: its GGUF config, its tensor names and processors, `gguf`'s
dequantization and the cast to the model dtype. Only its tensor loop is replaced for this one call
(`_non_expert_state_dict`, which also reads llama.cpp's split files): the merged expert tensors
(`blk.N.ffn_{gate,up,down}_exps`) are left unread and the experts' parameters stay on "meta". Each expert's blocks
are then read from the file per expert into the store (quantized bytes, `GGUFSlabLayout`) and dequantized into the
model dtype as they enter a CPU cache's dense slots (`DequantizingStore`), or kept so in a CUDA cache and
dequantized when the expert computes: the values of transformers' own GGUF load, bit for bit. Every check (policy,
architecture, block types, split files present) runs before anything is allocated.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Callable

import numpy as np
import torch
from huggingface_hub import hf_hub_download
from torch import nn
from transformers import AutoConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map
from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

from .._logging import progress
from ..arch import MoELayer, get_arch
from ..layout import ExpertPiece
from ..policy.offload_policy import OffloadPolicy, PolicyError
from ..storage.checkpoint import CheckpointError
from ..storage.dequantizing_store import dense_store_for
from ..storage.gguf_blocks import supported_names
from ..storage.gguf_file import GGUFIndex, is_expert_tensor
from ..storage.gguf_layout import GGUFSlabLayout
from ..storage.store import CpuStore, DiskStore
from .finish import check_attention, finish_offloading, load_predictor
from .load import HUB_KWARGS, _attach, _meta_skeleton, _offload_kwargs, _place
from .transformers_patches import experts_left_unread

# GGUF architectures (`general.architecture`) whose merged experts are read per expert: those transformers loads
# through its GGUF tensor processors into fused gate_up_proj / down_proj experts.
SUPPORTED_GGUF_ARCHITECTURES = ("qwen2moe", "qwen3moe")
_UNSUPPORTED_WHY = {
    "llama": "transformers loads llama-architecture GGUF files (Mixtral's too) as a dense Llama, without experts",
    "qwen35moe": "transformers loads qwen35moe GGUF files through its packed GGUF modules, not per expert",
    "gpt-oss": "GPT-OSS GGUF files keep their experts in MXFP4 blocks, which transformers' GGUF loader does not "
               "map onto GptOssExperts",
}
# Dense slab parts of the fused experts, and the GGUF tensors whose rows make them up, in order.
_PART_SOURCES = {"gate_up": ("gate", "up"), "up": ("up",), "down": ("down",)}
_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def load_gguf_offloaded(model_cls: type, pretrained_model_name_or_path: str, policy: Any, *model_args,
                        gguf_file: str, original_from_pretrained: Callable[..., PreTrainedModel],
                        **kwargs) -> PreTrainedModel:
    """`from_pretrained(..., gguf_file=gguf_file)` with experts offloaded according to `policy`."""
    policy = OffloadPolicy.from_any(policy)
    if policy.quantize != "none":
        raise PolicyError(f"quantize={policy.quantize!r} cannot be combined with a GGUF checkpoint: its experts are "
                          f"already quantized, kept in their GGUF blocks; allowed: quantize='none'")
    offload_folder, user_map, max_memory = _offload_kwargs(policy, kwargs)
    del offload_folder                                 # None: quantize is "none"
    hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    index = GGUFIndex.open(resolve_gguf_file(pretrained_model_name_or_path, gguf_file, **hub_kwargs))
    check_architecture(index)
    config = kwargs.get("config")
    if config is None or isinstance(config, str):
        config = AutoConfig.from_pretrained(config or pretrained_model_name_or_path, gguf_file=gguf_file,
                                            **hub_kwargs)
    arch = get_arch(config)
    skeleton = _meta_skeleton(model_cls, config, kwargs)
    check_attention(policy, skeleton)
    layers = arch.find_layers(skeleton)
    dtype = gguf_model_dtype(kwargs)
    layouts, pieces = locate_gguf_experts(index, layers, dtype)
    predictor = load_predictor(policy, skeleton)
    placement = _place(policy, skeleton, layers, dtype, user_map, max_memory, quantized=layouts)
    del skeleton

    with experts_left_unread(), _experts_left_out(index, [lay.name for lay in layers]):
        model = original_from_pretrained(model_cls, pretrained_model_name_or_path, *model_args,
                                         gguf_file=gguf_file, device_map=placement.module_map, **kwargs)
    layers = arch.find_layers(model)
    store = DiskStore(layers, pieces, model.dtype, layouts=[_with_dtype(lay, model.dtype) for lay in layouts])
    store.read_directly(placement.resolved.policy.disk_reads == "direct")
    device = torch.device(placement.resolved.policy.device)
    if placement.resolved.policy.store == "cpu":
        store = CpuStore.from_reader(store, device=device)
    engine = _attach(model, arch, layers, dense_store_for(store, device), placement)
    return finish_offloading(model, engine, placement.resolved, predictor)


def resolve_gguf_file(name_or_path: str | os.PathLike, gguf_file: str, **hub_kwargs) -> str:
    """The local path of `gguf_file`: a file path itself, a file in the directory `name_or_path`, or the Hub
    repository's file (downloaded or from the cache, with the other files of its split)."""
    path = str(name_or_path)
    if os.path.isfile(gguf_file):
        return gguf_file
    if os.path.isdir(path):
        local = os.path.join(path, gguf_file)
        if not os.path.isfile(local):
            raise CheckpointError(f"no GGUF file {gguf_file!r} in {path!r}")
        return local
    allowed = {k: v for k, v in hub_kwargs.items() if k in ("revision", "cache_dir", "token", "local_files_only")}
    try:
        first = hf_hub_download(path, gguf_file, **allowed)
        folder = os.path.dirname(gguf_file)
        for name in _split_names(os.path.basename(gguf_file)):
            hf_hub_download(path, os.path.join(folder, name) if folder else name, **allowed)
        return first
    except Exception as err:  # noqa: BLE001 - the hub raises many types; the user needs one message
        raise CheckpointError(f"cannot find GGUF file {gguf_file!r} of {path!r}: not a local file or directory, "
                              f"and not available from the Hub ({err})") from err


def _split_names(name: str) -> list[str]:
    """The other file names of the split `name` belongs to (none for a single file)."""
    m = re.match(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", name)
    if m is None:
        return []
    return [f"{m['stem']}-{i:05d}-of-{m['count']}.gguf" for i in range(1, int(m["count"]) + 1)
            if i != int(m["no"])]


def check_architecture(index: GGUFIndex) -> None:
    """Refuse a GGUF file whose architecture is not read per expert, naming it and the supported ones."""
    name = index.architecture
    if name in SUPPORTED_GGUF_ARCHITECTURES:
        return
    why = _UNSUPPORTED_WHY.get(name, "its experts are not among the layouts read per expert")
    raise PolicyError(f"GGUF architecture {name!r} ({index.files[0]}) cannot be offloaded: {why}. Supported GGUF "
                      f"architectures: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")


def gguf_model_dtype(kwargs: dict) -> torch.dtype:
    """The dtype transformers loads a GGUF checkpoint in: the one asked for, else torch's default dtype (a GGUF
    config names none, so "auto" resolves to it as well)."""
    requested = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if isinstance(requested, torch.dtype):
        return requested
    if isinstance(requested, str) and requested != "auto":
        return getattr(torch, requested)
    return torch.get_default_dtype()


def locate_gguf_experts(index: GGUFIndex, layers: list[MoELayer], dtype: torch.dtype
                        ) -> tuple[list[GGUFSlabLayout], list[list[list[ExpertPiece]]]]:
    """Per MoE layer, the GGUF slab layout of its experts and, per expert, the byte ranges that fill it. Missing
    tensors, shapes that do not fit the model and block types that are not supported are refused here."""
    layouts, pieces = [], []
    for lay in layers:
        block = _block_number(lay.name)
        sources = {}
        for part, (rows, cols) in lay.layout.parts:
            if part not in _PART_SOURCES:
                raise PolicyError(f"{lay.name}: expert part {part!r} has no GGUF source; GGUF experts are read into "
                                  f"gate_up/up and down parts ({', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
            keys = _PART_SOURCES[part]
            sources[part] = []
            for key in keys:
                t = index.expert_tensor(block, key, lay.num_experts)
                if t.shape[1:] != (rows // len(keys), cols):
                    raise CheckpointError(f"{t.name} in {t.path} has shape {list(t.shape)}, but {lay.name} needs "
                                          f"[{lay.num_experts}, {rows // len(keys)}, {cols}]")
                sources[part].append((key, t.kind))
        layout = GGUFSlabLayout.build(lay.layout, sources, dtype)
        layouts.append(layout)
        pieces.append([[ExpertPiece(s.key, 0, index.expert_range(f"blk.{block}.ffn_{s.key}_exps.weight", e))
                        for s in layout.segments] for e in range(lay.num_experts)])
    return layouts, pieces


def _block_number(module_name: str) -> int:
    m = _LAYER_NUMBER.search(module_name)
    if m is None:
        raise PolicyError(f"cannot tell the GGUF block of the experts module {module_name!r} (no 'layers.N.' in its "
                          f"name)")
    return int(m.group(1))


def _with_dtype(layout: GGUFSlabLayout, dtype: torch.dtype) -> GGUFSlabLayout:
    """`layout` computing in the dtype transformers loaded the model in."""
    return layout if layout.compute_dtype == dtype else GGUFSlabLayout(layout.dense, dtype, layout.segments,
                                                                        layout.numel)


@contextlib.contextmanager
def _experts_left_out(index: GGUFIndex, experts_modules: list[str]):
    """For this load, transformers' GGUF state dict is `_non_expert_state_dict` (loads are serialised by the
    package's load lock, so swapping the class attribute affects no other load)."""
    original = GgufHfQuantizer.get_state_dict

    def get_state_dict(quantizer: GgufHfQuantizer, checkpoint_file: str, model: nn.Module):
        return _non_expert_state_dict(index, model, quantizer.dtype, experts_modules)

    GgufHfQuantizer.get_state_dict = get_state_dict
    try:
        yield
    finally:
        GgufHfQuantizer.get_state_dict = original


def _non_expert_state_dict(index: GGUFIndex, model: nn.Module, dtype: torch.dtype | None,
                           experts_modules: list[str]) -> dict[str, torch.Tensor]:
    """transformers' legacy GGUF tensor loop (`load_gguf_checkpoint`: its processor, name map, `gguf.dequantize`
    and cast), over every file of a split, skipping the merged expert tensors; the experts' parameters are meta
    tensors of their shape, which the load leaves on "meta"."""
    import gguf   # the optional `gguf` extra: only GGUF loads need it

    processor = TENSOR_PROCESSORS.get(index.architecture, TensorProcessor)(config=model.config.to_dict())
    mapping = get_gguf_hf_weights_map(model, processor)
    parsed: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}
    for file in index.files:
        reader = gguf.GGUFReader(file)
        for tensor in progress(reader.tensors, desc="Dequantizing GGUF tensors (experts stay in blocks)",
                               unit="tensor"):
            if is_expert_tensor(tensor.name):
                continue
            weights = gguf.dequantize(tensor.data, tensor.tensor_type)
            result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=mapping,
                                       parsed_parameters=parsed)
            if result.name not in mapping:
                continue
            value = torch.from_numpy(np.copy(result.weights))
            parsed["tensors"][mapping[result.name]] = value.to(dtype) if dtype is not None else value
    prefixes = tuple(name + "." for name in experts_modules)
    for name, param in model.named_parameters():
        if name.startswith(prefixes):
            parsed["tensors"][name] = torch.empty(param.shape, dtype=param.dtype, device="meta")
    return parsed["tensors"]


__all__ = ["load_gguf_offloaded", "SUPPORTED_GGUF_ARCHITECTURES", "supported_names"]
