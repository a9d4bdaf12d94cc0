"""`from_pretrained(..., offload_policy=...)`: load a model with its experts offloaded.

Loading keeps transformers' own path for the non-expert weights (key renames, conversions, dtype handling): the
model is loaded with a device map that sends every experts module to `meta`, and for that one call "meta" means
"not read" (`transformers_patches.experts_left_unread`). Expert bytes then come straight from the checkpoint files,
one expert at a time, into the store. Every check that can fail (policy, architecture, checkpoint shards, device,
cache budget) runs before anything is allocated.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from accelerate.hooks import attach_align_device_hook_on_blocks
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from ..arch import MoEArch, MoELayer, get_arch
from ..arch.forward import EXPERTS_IMPLEMENTATION
from ..layout import ExpertPiece
from ..memory.cache_group import DevicePlan
from ..planning.device_map import module_map, plan_devices
from ..planning.footprint import auto_device, footprint
from ..planning.resolve import ResolvedPolicy, resolve
from ..policy.offload_policy import AUTO, OffloadPolicy, PolicyError, normalize_device
from ..runtime.engine import OffloadEngine
from ..storage.checkpoint import CheckpointIndex, TensorEntry, resolve_checkpoint_dir
from ..storage.dequantizing_store import dense_slots_on
from ..storage.packed_checkpoint import PackedCheckpointIndex, PackedSource
from ..storage.store import CpuStore, DiskStore, ExpertStore, dense_expert
from .experts_store import policy_quantized_layouts, quantized_store
from .finish import check_attention, finish_offloading, load_predictor
from .file_maps import FileMaps
from .mapped_embedding import load_input_embedding, map_input_embedding, plan_mapped_embedding
from .packed_load import (
    expert_modules,
    float_config,
    packed_layers_dense,
    packed_layouts,
    packed_store,
    refuse_policy_quantize,
)
from .quantized_checkpoints import (
    checkpoint_block_size,
    checkpoint_is_mxfp4,
    checkpoint_packed_format,
    dequantizing_fp8_config,
    dequantizing_mxfp4_config,
    forget_mxfp4_conversions,
)
from .transformers_patches import experts_left_unread

logger = logging.getLogger(__name__)

# The from_pretrained keywords that say where the checkpoint is (its config, its files)
HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "trust_remote_code", "subfolder")


@dataclass
class _Placement:
    """Where an offloaded load puts things, decided before anything is read."""

    resolved: ResolvedPolicy
    module_map: dict[str, str]           # what transformers loads with: devices, experts modules on "meta"
    devices: DevicePlan | None           # a user's device_map over several devices, else None
    embedding: TensorEntry | None = None   # the input embedding table to map from its file, if any


def load_offloaded(model_cls: type, pretrained_model_name_or_path: str, policy: Any, *model_args,
                   original_from_pretrained: Callable[..., PreTrainedModel], **kwargs) -> PreTrainedModel:
    """`from_pretrained` with experts offloaded according to `policy` (see `hf_moe_offload.from_pretrained`)."""
    policy = OffloadPolicy.from_any(policy)
    if kwargs.get("use_safetensors") is False:      # transformers would read a .bin beside the files read here
        raise PolicyError("use_safetensors=False cannot be combined with offload_policy: the experts are read per "
                          "expert from the checkpoint's safetensors files (a .bin checkpoint cannot be); leave "
                          "use_safetensors unset or True")
    offload_folder, user_map, max_memory = _offload_kwargs(policy, kwargs)
    hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    root = resolve_checkpoint_dir(pretrained_model_name_or_path, **hub_kwargs)
    config = kwargs.get("config")
    if config is None or isinstance(config, str):
        config = AutoConfig.from_pretrained(config or pretrained_model_name_or_path, **hub_kwargs)
    block_size, packed = checkpoint_block_size(config), checkpoint_packed_format(config)
    if packed is not None:
        refuse_policy_quantize(policy)
    arch = get_arch(config)
    _warn_if_experts_implementation_requested(kwargs.get("experts_implementation")
                                              or getattr(config, "_experts_implementation", None))
    variant = kwargs.get("variant")
    index = (PackedCheckpointIndex.open(root, packed, variant=variant) if packed
             else CheckpointIndex.open(root, block_size=block_size, variant=variant))

    skeleton = _meta_skeleton(model_cls, config, kwargs)
    check_attention(policy, skeleton)
    layers = arch.find_layers(skeleton)
    pieces = _locate_experts(arch, index, layers)
    dtype = _requested_dtype(kwargs, pieces, config)
    layouts = packed_layouts(layers, pieces, index, dtype) if packed else None    # experts sized as stored
    predictor = load_predictor(policy, skeleton)       # (before plan_devices strips the skeleton's experts)
    no_mmap = bool(kwargs.get("disable_mmap"))        # the user asked transformers for no memory-mapped files
    placement = _place(policy, skeleton, layers, dtype, user_map, max_memory, layouts,
                       index=None if packed else index, disable_mmap=no_mmap)
    del skeleton

    if block_size is not None:
        kwargs["quantization_config"] = dequantizing_fp8_config(config, kwargs.get("quantization_config"))
    elif checkpoint_is_mxfp4(config):
        kwargs["quantization_config"] = dequantizing_mxfp4_config(config, kwargs.get("quantization_config"))
    elif packed is not None:                  # transformers loads a float model; the packed layers are fed dense
        kwargs["config"] = float_config(config)
    with experts_left_unread(), (packed_layers_dense(index, expert_modules(pieces)) if packed
                                 else contextlib.nullcontext()):
        model = original_from_pretrained(model_cls, pretrained_model_name_or_path, *model_args,
                                         device_map=placement.module_map, **kwargs)
    if checkpoint_is_mxfp4(config):
        forget_mxfp4_conversions(model)
    maps = FileMaps(disable_mmap=no_mmap)      # the checkpoint files read in place, guarded below
    mapped = placement.embedding is not None and map_input_embedding(
        model, placement.embedding, required=placement.resolved.policy.embedding == "mapped", maps=maps)
    layers = arch.find_layers(model)
    if packed is not None:
        model_dtype = next(layers[0].module.parameters()).dtype      # what transformers chose
        store = packed_store(placement.resolved.policy, layers, pieces,
                             packed_layouts(layers, pieces, index, model_dtype))
    else:
        store = _build_store(placement.resolved.policy, layers, pieces, offload_folder)
    engine = _attach(model, arch, layers, store, placement)
    if mapped:
        engine.embedding = "mapped"
        engine.on_detach.append(lambda: load_input_embedding(model))
    return finish_offloading(model, engine, placement.resolved, predictor, index=None if packed or no_mmap else index,
                             maps=maps)


def _offload_kwargs(policy: OffloadPolicy, kwargs: dict) -> tuple[Any, Any, Any]:
    """Take `offload_folder`, `device_map` and `max_memory` out of `kwargs` (they mean something else with an
    offload policy), refusing combinations that have no meaning here."""
    # A quantized disk store writes its folder once and reuses it: offload_folder= names it.
    offload_folder = kwargs.pop("offload_folder", None) if policy.quantize != "none" else None
    if kwargs.get("offload_folder") is not None:
        raise PolicyError("offload_folder= cannot be combined with offload_policy unless quantize is 'int8' or "
                          "'int4' (it names the quantized experts' folder): the policy's store is the offload for "
                          "experts, and non-expert modules are not offloaded to disk")
    # A user's device_map / max_memory place the non-expert part and the per-device caches (planning.device_map).
    user_map, max_memory = kwargs.pop("device_map", None), kwargs.pop("max_memory", None)
    if max_memory is not None and user_map is None:
        raise PolicyError("max_memory= needs a device_map= next to it (e.g. device_map='auto'); without one the "
                          "policy's 'device' holds everything")
    return offload_folder, user_map, max_memory


def _place(policy: OffloadPolicy, skeleton: nn.Module, layers: list[MoELayer], dtype: torch.dtype, user_map: Any,
           max_memory: Any, quantized: list | None = None, index: CheckpointIndex | None = None,
           disable_mmap: bool = False) -> _Placement:
    """Resolve the policy for this model's footprint, and where transformers loads each module. `quantized`: the
    slab layouts of experts the checkpoint stores quantized (GGUF blocks), else the policy's own quantization; a
    CPU cache holds the checkpoint's experts dequantized (`dense_slots_on`), so its budget counts dense slabs.
    `index`: the checkpoint's safetensors tensors, where the input embedding table can be mapped from, unless
    `disable_mmap` (the user's `from_pretrained(disable_mmap=True)`)."""
    device = auto_device() if policy.device == AUTO else normalize_device(policy.device)
    dense = quantized is not None and dense_slots_on(device)
    fp = footprint(skeleton, layers, dtype, quantized or policy_quantized_layouts(policy, layers, dtype), dense)
    embedding = plan_mapped_embedding(policy, skeleton, index, dtype, device, user_map is not None, disable_mmap)
    if embedding is not None:            # its memory is not the resident part's: "auto" gives it to the cache
        fp = dataclasses.replace(fp, resident_bytes=fp.resident_bytes - embedding.nbytes, mapped_bytes=embedding.nbytes)
    if user_map is None:
        resolved = resolve(policy, fp)
        return _Placement(resolved, _device_map(skeleton, layers, torch.device(resolved.policy.device)), None,
                          embedding)
    devices, resolved = plan_devices(skeleton, layers, user_map, max_memory, policy, fp, dtype)
    return _Placement(resolved, devices.module_map, devices)


def _build_store(policy: OffloadPolicy, layers: list[MoELayer], pieces: list[list[list[ExpertPiece]]],
                 offload_folder: Any) -> ExpertStore:
    """The experts' store: the checkpoint read in place (disk), copied into host memory, or quantized."""
    dtype = next(layers[0].module.parameters()).dtype   # what transformers chose (meta tensors keep it)
    device = torch.device(policy.device)
    reader = DiskStore(layers, pieces, dtype)
    reader.read_directly(policy.disk_reads == "direct")
    if policy.quantize != "none":
        store = quantized_store(policy, layers, dtype, device, lambda l, e: dense_expert(reader, l, e),
                                offload_folder, source_files=reader.files)
        reader.close()
        return store
    # On the CPU the store keeps its reader: its experts may then keep only their packed copies (loading.finish).
    return CpuStore.from_reader(reader, device=device, keep_reader=device.type == "cpu") if policy.store == "cpu" \
        else reader


def _attach(model: PreTrainedModel, arch: MoEArch, layers: list[MoELayer], store: ExpertStore,
            placement: _Placement) -> OffloadEngine:
    """The engine over `store`: one cache, or one per device of a device map (then accelerate's hooks move the
    activations between devices)."""
    resolved, devices = placement.resolved, placement.devices
    if devices is not None and len(devices.cache_devices) == 1:   # one cache, as without a map, on that device
        engine = OffloadEngine.attach(model, resolved.policy, arch, layers, store,
                                      devices.budgets[devices.cache_devices[0]])
    else:
        engine = OffloadEngine.attach(model, resolved.policy, arch, layers, store, resolved.cache_bytes,
                                      devices=devices)
    if devices is not None and devices.hook_map is not None:
        _dispatch(model, devices.hook_map)
    return engine


def _dispatch(model: PreTrainedModel, hook_map: dict[str, str]) -> None:
    """accelerate's hooks that move activations between the devices of a device_map; every block computes where
    its weights are (no weight streaming). Attached after the engine: the experts hold no parameters then."""

    attach_align_device_hook_on_blocks(model, execution_device={n: torch.device(d) for n, d in hook_map.items()},
                                       offload={n: False for n in hook_map if n},
                                       skip_keys=getattr(model, "_skip_keys_device_placement", None))

def _warn_if_experts_implementation_requested(requested: str | None) -> None:
    """Auto classes fold `experts_implementation=` into the config, so both places are looked at."""
    if requested not in (None, EXPERTS_IMPLEMENTATION):
        logger.warning("hf_moe_offload: experts_implementation=%r is not used while the experts are offloaded: they "
                       "run through hf_moe_offload's own implementation (%r); disable(model) restores yours",
                       requested, EXPERTS_IMPLEMENTATION)

def _locate_experts(arch: MoEArch, index: CheckpointIndex, layers: list[MoELayer]):
    """`pieces[layer][expert]`: where every expert's bytes are; a missing tensor is reported here, before loading."""
    return [[arch.locate_expert(index, lay.name, e, lay.layout) for e in range(lay.num_experts)] for lay in layers]

def _meta_skeleton(model_cls: type, config, kwargs: dict) -> nn.Module:
    """The model's module tree on the meta device (no memory), to read names and shapes."""
    # Built from a copy: a model's __init__ writes into its config (the experts implementation it resolved), and
    # the caller's config object is theirs (transformers' own from_pretrained copies it too).
    config = copy.deepcopy(config)
    with torch.device("meta"):
        if hasattr(model_cls, "_model_mapping"):       # an Auto class
            return model_cls.from_config(config, trust_remote_code=kwargs.get("trust_remote_code", False))
        return model_cls(config)

def _requested_dtype(kwargs: dict, pieces, config=None) -> torch.dtype:
    """The dtype the experts will have, chosen as transformers chooses the model's: the one asked for, else (its
    "auto") the config's `dtype`, else the checkpoint's. FP8 and packed (GPTQ, AWQ, compressed-tensors) experts
    compute in the config's dtype, bfloat16 when it names none."""
    requested = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if isinstance(requested, dict):                 # per-module dtypes: the model's own is under ""
        requested = requested.get("")
    if isinstance(requested, torch.dtype):
        return requested
    if isinstance(requested, str) and requested != "auto":
        return getattr(torch, requested)
    named = getattr(config, "dtype", None)
    named = getattr(torch, named, None) if isinstance(named, str) else named
    if isinstance(named, torch.dtype):
        return named
    source = pieces[0][0][0]
    if source.scales is None and not isinstance(source.source, PackedSource):
        return source.source.dtype
    return torch.bfloat16


def _device_map(skeleton: nn.Module, layers: list[MoELayer], device: torch.device) -> dict[str, str]:
    """Without a user's device_map: everything on the policy's device, the experts modules not loaded."""
    return module_map(skeleton, [lay.name for lay in layers], lambda name: str(device))
