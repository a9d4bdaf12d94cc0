"""Build offloaded models: `from_pretrained(..., offload_policy=...)`, `enable(model, policy)`, `disable(model)`.

Loading keeps transformers' own path for the non-expert weights (key renames, conversions, dtype handling): the
model is loaded with a device map that sends every experts module to `meta`, and for that one call "meta" means
"not read" (see `_experts_left_unread`). Expert bytes then come straight from the checkpoint files, one expert at
a time, into the store.

Every check that can fail (policy, architecture, checkpoint shards, device, cache budget) runs before anything
is allocated.

Fine-grained FP8 checkpoints (`quantization_config` with quant_method "fp8" and a `weight_block_size`): transformers
loads the non-expert part dequantized to the model dtype (its `dequantize=True` load, forced here so a GPU machine
does the same), and each expert's FP8 matrices and block scales are located per expert and dequantized by the store
as they are read: the engine sees ordinary dense slabs.

MXFP4 GPT-OSS checkpoints (openai/gpt-oss-20b, -120b: quant_method "mxfp4") go the same way: transformers loads the
non-expert part with `Mxfp4Config(dequantize=True)` (forced), and each expert's codes and exponents are read and
dequantized into the dense slab by the store. MXFP4 on any other model type stays refused.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import threading
import weakref
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedModel
import transformers.core_model_loading as core_model_loading
import transformers.modeling_utils as modeling_utils

from ..arch import MoEArch, MoELayer, get_arch
from ..planning.footprint import footprint
from ..planning.resolve import resolve
from ..storage.checkpoint import SAFETENSORS_DTYPES, CheckpointIndex, resolve_checkpoint_dir
from ..runtime.engine import OffloadEngine, get_engine, move_resident_part
from ..arch.forward import EXPERTS_IMPLEMENTATION
from ..prefetch.hash_predictor import HashPredictor
from ..prefetch.hash_runner import HashPrefetcher
from ..policy.offload_policy import AUTO, DEFAULT_INT4_GROUP_SIZE, OffloadPolicy, PolicyError
from ..storage.quantize import QuantizedSlabLayout, quantized_layouts
from ..storage.spill import (quantized_cache_root, quantized_fingerprint, remove_folder, reuse_quantized, spill_experts,
                    temporary_folder, write_quantized)
from ..storage.store import CpuStore, DiskStore, dense_expert

logger = logging.getLogger(__name__)

_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "trust_remote_code", "subfolder")


def load_offloaded(model_cls: type, pretrained_model_name_or_path: str, policy: Any, *model_args,
                   original_from_pretrained, **kwargs) -> PreTrainedModel:
    """`from_pretrained` with experts offloaded according to `policy` (see `hf_moe_offload.from_pretrained`)."""
    policy = OffloadPolicy.from_any(policy)
    # A quantized disk store writes its folder once and reuses it: offload_folder= names it.
    offload_folder = kwargs.pop("offload_folder", None) if policy.quantize != "none" else None
    if kwargs.get("offload_folder") is not None:
        raise PolicyError("offload_folder= cannot be combined with offload_policy unless quantize is 'int8' or "
                          "'int4' (it names the quantized experts' folder): the policy's store is the offload for "
                          "experts, and non-expert modules are not offloaded to disk")
    # A user's device_map / max_memory place the non-expert part and the per-device caches (devices.py).
    user_map, max_memory = kwargs.pop("device_map", None), kwargs.pop("max_memory", None)
    if max_memory is not None and user_map is None:
        raise PolicyError("max_memory= needs a device_map= next to it (e.g. device_map='auto'); without one the "
                          "policy's 'device' holds everything")
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    root = resolve_checkpoint_dir(pretrained_model_name_or_path, **hub_kwargs)
    config = kwargs.get("config")
    if config is None or isinstance(config, str):
        config = AutoConfig.from_pretrained(config or pretrained_model_name_or_path, **hub_kwargs)
    block_size = checkpoint_block_size(config)
    arch = get_arch(config)
    _warn_if_experts_implementation_requested(kwargs.get("experts_implementation")
                                              or getattr(config, "_experts_implementation", None))
    index = CheckpointIndex.open(root, block_size=block_size)

    skeleton = _meta_skeleton(model_cls, config, kwargs)
    _check_attention(policy, skeleton)
    layers = arch.find_layers(skeleton)
    pieces = _locate_experts(arch, index, layers)
    dtype = _requested_dtype(kwargs, pieces, config)
    fp = footprint(skeleton, layers, dtype, _quantized_layouts(policy, layers, dtype))
    predictor = _load_predictor(policy, skeleton)       # (before plan_devices strips the skeleton's experts)
    plan = None
    if user_map is None:
        resolved = resolve(policy, fp)
    else:
        from ..planning.device_map import plan_devices

        plan, resolved = plan_devices(skeleton, layers, user_map, max_memory, policy, fp, dtype)
    device = torch.device(resolved.policy.device)

    device_map = _device_map(skeleton, layers, device) if plan is None else plan.module_map
    del skeleton
    if block_size is not None:
        kwargs["quantization_config"] = _dequantizing_fp8_config(config, kwargs.get("quantization_config"))
    elif checkpoint_is_mxfp4(config):
        kwargs["quantization_config"] = _dequantizing_mxfp4_config(config, kwargs.get("quantization_config"))
    with _experts_left_unread():
        model = original_from_pretrained(model_cls, pretrained_model_name_or_path, *model_args,
                                         device_map=device_map, **kwargs)
    if checkpoint_is_mxfp4(config):
        _forget_mxfp4_conversions(model)
    layers = arch.find_layers(model)
    dtype = next(layers[0].module.parameters()).dtype   # what transformers chose (meta tensors keep it)
    reader = DiskStore(layers, pieces, dtype)
    if policy.quantize != "none":
        store = _quantized_store(resolved.policy, layers, dtype, device, lambda l, e: dense_expert(reader, l, e),
                                 offload_folder, source_files=reader.files)
        reader.close()
    else:
        store = CpuStore.from_reader(reader, device=device) if resolved.policy.store == "cpu" else reader
    if plan is not None and len(plan.cache_devices) == 1:   # one cache, as without a map, on that device
        engine = OffloadEngine.attach(model, resolved.policy, arch, layers, store,
                                      plan.budgets[plan.cache_devices[0]])
    else:
        engine = OffloadEngine.attach(model, resolved.policy, arch, layers, store, resolved.cache_bytes,
                                      devices=plan)
    if plan is not None and plan.hook_map is not None:
        _dispatch(model, plan.hook_map)
    if predictor is not None:
        engine.attach_prefetcher(HashPrefetcher(engine, predictor, routing=engine.policy.routing))
    _apply_attention(model, engine)
    _apply_batching(model, engine)
    return model


def _dispatch(model: PreTrainedModel, hook_map: dict[str, str]) -> None:
    """accelerate's hooks that move activations between the devices of a device_map; every block computes where
    its weights are (no weight streaming). Attached after the engine: the experts hold no parameters then."""
    from accelerate.hooks import attach_align_device_hook_on_blocks

    attach_align_device_hook_on_blocks(model, execution_device={n: torch.device(d) for n, d in hook_map.items()},
                                       offload={n: False for n in hook_map if n},
                                       skip_keys=getattr(model, "_skip_keys_device_placement", None))


def enable(model: PreTrainedModel, policy: Any = "auto", offload_folder: str | os.PathLike | None = None
           ) -> PreTrainedModel:
    """Offload the experts of a model that is already built; `disable(model)` puts everything back.

    With `store="disk"` the experts the model holds now are written to `offload_folder` (a temporary folder when
    not given, removed on `disable()` or at exit) and read from there: edits made after loading are kept.

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained(path)                        # doctest: +SKIP
        >>> hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})           # doctest: +SKIP
        >>> hf_moe_offload.disable(model)    # outputs bit-identical to before enable  # doctest: +SKIP
    """
    policy = OffloadPolicy.from_any(policy)
    if get_engine(model) is not None:
        raise PolicyError("this model is already offloaded by hf_moe_offload; call hf_moe_offload.disable(model) "
                          "first to change its policy")
    refuse_quantized_checkpoint(model.config)
    _check_attention(policy, model)
    arch = get_arch(model.config)
    layers = arch.find_layers(model)
    expert_params = [p for lay in layers for p in lay.module.parameters()]
    if any(p.device.type == "meta" for p in expert_params):
        raise PolicyError("the model's experts are on the meta device (not loaded); load it with "
                          "from_pretrained(..., offload_policy=...) instead")
    dtype = expert_params[0].dtype
    original_device = expert_params[0].device
    resident_device = next((p.device for n, p in model.named_parameters() if p.device.type != "meta"
                            and not any(n.startswith(lay.name + ".") for lay in layers)), original_device)
    # Experts already on a device count as free memory there: they are released before the cache is allocated.
    fp = dataclasses.replace(footprint(model, layers, dtype, _quantized_layouts(policy, layers, dtype)),
                             experts_device=str(original_device),
                             resident_device=str(resident_device))
    resolved = resolve(policy, fp)
    predictor = _load_predictor(policy, model)
    device = torch.device(resolved.policy.device)

    folder, own_folder = None, False
    if resolved.policy.store == "disk":
        folder, own_folder = (str(offload_folder), False) if offload_folder is not None else (temporary_folder(), True)
    try:
        if policy.quantize != "none":
            store = _quantized_store(resolved.policy, layers, dtype, device,
                                     lambda l, e: arch.expert_tensors(layers[l].module, e), folder)
        elif folder is not None:
            store = DiskStore(layers, spill_experts(layers, arch.expert_tensors, dtype, folder), dtype)
        else:
            store = CpuStore.from_modules(layers, arch.expert_tensors, dtype, device=device)
    except BaseException:
        if own_folder:
            remove_folder(folder)
        raise
    moved_from = None
    if resident_device != device:
        move_resident_part(model, layers, device)
        moved_from = resident_device
    engine = OffloadEngine.attach(model, resolved.policy, arch, layers, store, resolved.cache_bytes,
                                  restore_device=original_device, moved_resident_from=moved_from)
    if own_folder:
        # The store's files go with the engine: on disable(), or at exit for a model never disabled.
        engine.on_detach.append(weakref.finalize(engine, remove_folder, folder))
    if predictor is not None:
        engine.attach_prefetcher(HashPrefetcher(engine, predictor, routing=engine.policy.routing))
    _apply_attention(model, engine)
    _apply_batching(model, engine)
    return model


def _check_attention(policy: OffloadPolicy, model: nn.Module) -> None:
    """attention="cpu" on a model it cannot serve is refused before anything is loaded or allocated."""
    if policy.attention == "cpu":
        from ..attention.cpu import check_cpu_attention

        check_cpu_attention(model)


def _apply_attention(model: PreTrainedModel, engine: OffloadEngine) -> None:
    """attention="cpu": CPU attention against a host KV cache, undone by `disable()` (the engine's on_detach)."""
    if engine.policy.attention != "cpu":
        return
    from ..attention.cpu import cpu_attention_enabled, restore_attention, use_cpu_attention

    if cpu_attention_enabled(model):      # the user turned it on already: theirs to undo
        return
    try:
        use_cpu_attention(model)
    except BaseException:
        engine.detach()                   # a refused model is left as it was before
        raise
    engine.on_detach.append(lambda: restore_attention(model))


def _apply_batching(model: PreTrainedModel, engine: OffloadEngine) -> None:
    """`generate_batch` without a ContinuousBatchingConfig sizes its token budget for offloading (batching.py),
    undone by `disable()`."""
    from ..batching.config import install_batching_defaults

    remove = install_batching_defaults(model)
    if remove is not None:
        engine.on_detach.append(remove)


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Detach everything hf_moe_offload attached and give the experts back to the model as parameters."""
    engine = get_engine(model)
    if engine is None:
        raise PolicyError("this model is not offloaded by hf_moe_offload (nothing to disable)")
    engine.detach()
    return model


SUPPORTED_CHECKPOINT_QUANTIZATION = ("fine-grained FP8 (quant_method='fp8' with weight_block_size [rows, cols], "
                                     "fmt 'e4m3', float block scales weight_scale_inv: DeepSeek-V3, Qwen3-*-FP8), "
                                     "or MXFP4 for GPT-OSS only (quant_method='mxfp4': openai/gpt-oss-20b, -120b)")
# Model types whose MXFP4 checkpoints are read per expert (arch/gpt_oss.py; transformers quantizes no other).
MXFP4_MODEL_TYPES = ("gpt_oss",)


def _quantization_configs(config) -> list:
    """The `quantization_config`s of `config` and of its text config (a dict, or transformers' config object)."""
    cfgs = {id(c): c for c in (config, getattr(config, "get_text_config", lambda: config)())}.values()
    return [qc for qc in (getattr(c, "quantization_config", None) for c in cfgs) if qc is not None]


def _qc_get(qc, name: str):
    value = qc.get(name) if isinstance(qc, dict) else getattr(qc, name, None)
    return getattr(value, "value", value)       # enums (QuantizationMethod) as their string


def _fp8_problem(qc) -> str | None:
    """Why an fp8 `quantization_config` is not the fine-grained layout hf_moe_offload reads, or None if it is."""
    block = _qc_get(qc, "weight_block_size")
    if block is None:
        return "without weight_block_size (per-tensor scales)"
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        return f"with weight_block_size={block!r} (expected two positive ints)"
    for name, allowed in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
        value = _qc_get(qc, name)
        if value not in (None, allowed):
            return f"with {name}={value!r} (only {allowed!r} is read)"
    return None


def checkpoint_block_size(config) -> tuple[int, int] | None:
    """The FP8 `weight_block_size` of a fine-grained FP8 checkpoint, None for a float checkpoint; any other
    `quantization_config` (mxfp4, gptq, awq, bitsandbytes, fp8 without block scales, ...) is refused with a
    `PolicyError` naming its method and listing what is read. Raised before anything is allocated.

    Example:
        >>> from types import SimpleNamespace
        >>> checkpoint_block_size(SimpleNamespace(quantization_config={"quant_method": "fp8",
        ...                                                            "weight_block_size": [128, 128]}))
        (128, 128)
    """
    for qc in _quantization_configs(config):
        method = _qc_get(qc, "quant_method") or "unknown"
        problem = _fp8_problem(qc) if method == "fp8" else None
        if method == "fp8" and problem is None:
            return tuple(_qc_get(qc, "weight_block_size"))
        if method == "mxfp4":
            if _model_type(config) in MXFP4_MODEL_TYPES:
                continue                              # read per expert: `checkpoint_is_mxfp4`
            problem = f"on model type {_model_type(config)!r} (MXFP4 is read for {list(MXFP4_MODEL_TYPES)} only)"
        raise PolicyError(f"this checkpoint's weights are already quantized (quantization_config with quant_method="
                          f"{method!r}{' ' + problem if problem else ''}), which hf_moe_offload cannot read per "
                          f"expert; it reads experts stored as float tensors (float32, float16, bfloat16) or "
                          f"{SUPPORTED_CHECKPOINT_QUANTIZATION}. Use the checkpoint's unquantized weights, and "
                          f"offload_policy {{'quantize': 'int8'}} or {{'quantize': 'int4'}} to store the experts "
                          f"quantized")
    return None


def checkpoint_is_mxfp4(config) -> bool:
    """Whether `config` is an MXFP4 checkpoint whose experts hf_moe_offload reads per expert (GPT-OSS: quant_method
    "mxfp4"); MXFP4 on another model type is refused by `checkpoint_block_size`.

    Example:
        >>> from types import SimpleNamespace
        >>> checkpoint_is_mxfp4(SimpleNamespace(model_type="gpt_oss", quantization_config={"quant_method": "mxfp4"}))
        True
    """
    return _model_type(config) in MXFP4_MODEL_TYPES and any(
        _qc_get(qc, "quant_method") == "mxfp4" for qc in _quantization_configs(config))


def _model_type(config) -> str | None:
    return getattr(config, "model_type", None)


def refuse_quantized_checkpoint(config) -> None:
    """For a model already built (`enable`): refuse one whose weights are quantized in memory. A fine-grained FP8
    or MXFP4 model that transformers loaded with `dequantize=True` (its CPU default) holds float weights and is
    accepted."""
    if checkpoint_is_mxfp4(config):
        if not all(_qc_get(qc, "dequantize") for qc in _quantization_configs(config)):
            raise PolicyError("this model holds MXFP4 experts (loaded without dequantize); load it with "
                              "from_pretrained(..., offload_policy=...), which reads the MXFP4 experts per expert, "
                              "or with quantization_config=Mxfp4Config(dequantize=True) before enable()")
        return
    if checkpoint_block_size(config) is None:
        return
    if not all(_qc_get(qc, "dequantize") for qc in _quantization_configs(config)):
        raise PolicyError("this model holds FP8 weights (loaded without dequantize); load it with "
                          "from_pretrained(..., offload_policy=...), which reads the FP8 experts per expert, or with "
                          "quantization_config=FineGrainedFP8Config(dequantize=True) before enable()")


def _dequantizing_fp8_config(config, given):
    """The `quantization_config=` that makes transformers load a fine-grained FP8 checkpoint dequantized to the model
    dtype, as it does by itself without a GPU: the resident part is then dense, like the experts the store
    dequantizes."""
    from transformers import FineGrainedFP8Config

    return _dequantizing_config(config, given, FineGrainedFP8Config,
                                lambda qc: {"weight_block_size": list(_qc_get(qc, "weight_block_size"))})


def _dequantizing_mxfp4_config(config, given):
    """The `quantization_config=` that makes transformers load an MXFP4 GPT-OSS checkpoint's non-expert part as it
    does by itself without a GPU kernel (`Mxfp4Config(dequantize=True)`): dense, like the experts the store
    dequantizes."""
    from transformers import Mxfp4Config

    return _dequantizing_config(config, given, Mxfp4Config, lambda qc: {})


def _dequantizing_config(config, given, config_class: type, from_checkpoint):
    """A user's `config_class` instance with `dequantize` set (its other attributes kept), any other given config
    as is (transformers names the mismatch with the checkpoint's method), else one built from the checkpoint's
    quantization config: `from_checkpoint(qc)`'s fields and its `modules_to_not_convert`."""
    if isinstance(given, config_class):
        given = copy.copy(given)
        given.dequantize = True
        return given
    if given is not None:
        return given
    qc = _quantization_configs(config)[0]
    return config_class(**from_checkpoint(qc), modules_to_not_convert=_qc_get(qc, "modules_to_not_convert"),
                        dequantize=True)


def _forget_mxfp4_conversions(model: nn.Module) -> None:
    """Drop the MXFP4 converters (`*_blocks` + `*_scales` -> dense weight) transformers attached to `model` for its
    load: `save_pretrained` reverses them, and would write the dense experts under the `*_blocks` names (transformers'
    own dequantized MXFP4 model saves such an unloadable checkpoint). Without them it saves a dense checkpoint, the
    `quantization_config` being gone from the config after a dequantized load."""
    from transformers.integrations.mxfp4 import Mxfp4Dequantize

    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [c for c in conversions
                                     if not any(isinstance(op, Mxfp4Dequantize) for op in getattr(c, "operations", ()))]


def _quantized_layouts(policy: OffloadPolicy, layers: list[MoELayer], dtype: torch.dtype,
                       device: torch.device | None = None) -> list[QuantizedSlabLayout] | None:
    """The layers' quantized slab layouts for `policy`, packed for `device` (None: plain), or None."""
    if policy.quantize == "none":
        return None
    group = DEFAULT_INT4_GROUP_SIZE if policy.quant_group_size == AUTO else int(policy.quant_group_size)
    dense = [lay.layout for lay in layers]
    if device is None:
        return [QuantizedSlabLayout.build(d, policy.quantize, group, dtype) for d in dense]
    return quantized_layouts(dense, policy.quantize, group, dtype, device)


def _quantized_store(policy: OffloadPolicy, layers: list[MoELayer], dtype: torch.dtype, device: torch.device,
                     read_expert, folder: str | None, source_files: list[str] | None = None):
    """A store of quantized experts: host slabs (store="cpu"), or a quantized folder read per expert ("disk").

    With `source_files` (a checkpoint) the folder is `folder` or a cache folder per fingerprint, reused while the
    fingerprint matches; without (a built model's experts, `enable`) it is always written."""
    layouts = _quantized_layouts(policy, layers, dtype, device)
    num_experts = [lay.num_experts for lay in layers]
    if policy.store == "cpu":
        return CpuStore.build_quantized(read_expert, layouts, num_experts, dtype, device=device)
    fingerprint = quantized_fingerprint(source_files, layouts) if source_files else "built-model"
    if folder is None:
        folder = os.path.join(quantized_cache_root(), fingerprint)
    pieces = reuse_quantized(folder, fingerprint, layouts, num_experts) if source_files else None
    if pieces is None:
        logger.info("hf_moe_offload: quantizing experts (%s) into %s", policy.quantize, folder)
        pieces = write_quantized(folder, fingerprint, layouts, num_experts, read_expert)
    return DiskStore(layers, pieces, dtype, layouts=layouts)


def _warn_if_experts_implementation_requested(requested: str | None) -> None:
    """Auto classes fold `experts_implementation=` into the config, so both places are looked at."""
    if requested not in (None, EXPERTS_IMPLEMENTATION):
        logger.warning("hf_moe_offload: experts_implementation=%r is not used while the experts are offloaded: they "
                       "run through hf_moe_offload's own implementation (%r); disable(model) restores yours",
                       requested, EXPERTS_IMPLEMENTATION)


def _load_predictor(policy: OffloadPolicy, model: nn.Module) -> HashPredictor | None:
    """The policy's hash predictor, its files and fingerprint checked against `model` (a skeleton will do)."""
    if not policy.predictor:
        return None
    return HashPredictor.load(policy.predictor, model=model, device="cpu")


def _locate_experts(arch: MoEArch, index: CheckpointIndex, layers: list[MoELayer]):
    """`pieces[layer][expert]`: where every expert's bytes are; a missing tensor is reported here, before loading."""
    return [[arch.locate_expert(index, lay.name, e, lay.layout) for e in range(lay.num_experts)] for lay in layers]


def _meta_skeleton(model_cls: type, config, kwargs: dict) -> nn.Module:
    """The model's module tree on the meta device (no memory), to read names and shapes."""
    with torch.device("meta"):
        if hasattr(model_cls, "_model_mapping"):       # an Auto class
            return model_cls.from_config(config, trust_remote_code=kwargs.get("trust_remote_code", False))
        return model_cls(config)


def _requested_dtype(kwargs: dict, pieces, config=None) -> torch.dtype:
    """The dtype the experts will have: the one asked for, else the checkpoint's (transformers' "auto"); FP8 experts
    are dequantized into the config's dtype (bfloat16 when it names none)."""
    requested = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if isinstance(requested, torch.dtype):
        return requested
    if isinstance(requested, str) and requested != "auto":
        return getattr(torch, requested)
    source = pieces[0][0][0]
    if source.scales is None:
        return source.source.dtype
    named = getattr(config, "dtype", None)
    named = getattr(torch, named) if isinstance(named, str) else named
    return named if isinstance(named, torch.dtype) else torch.bfloat16


def _device_map(skeleton: nn.Module, layers: list[MoELayer], device: torch.device) -> dict[str, str]:
    """Every module that owns tensors goes to `device`, every experts module to "meta" (not loaded)."""
    expert_names = {lay.name for lay in layers}
    device_map: dict[str, str] = {}
    for name, module in skeleton.named_modules():
        if name in expert_names or any(name.startswith(e + ".") for e in expert_names):
            continue
        if next(module.parameters(recurse=False), None) is not None or next(module.buffers(recurse=False), None) \
                is not None:
            device_map[name] = str(device)
    device_map.update({name: "meta" for name in expert_names})
    return device_map


_in_offloaded_load = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0                 # offloaded loads in progress, across threads
_originals: dict[str, Any] = {}


@contextlib.contextmanager
def _experts_left_unread():
    """For our own `from_pretrained` call, make the experts' "meta" placement mean "do not read":

    - transformers materialises every checkpoint tensor before moving it to its device, so a tensor bound for
      "meta" would still be read from disk (all expert bytes, through the page cache): build it on meta instead;
    - safetensors' mmap backend reads ahead through whole shards (most of every file, experts included): open the
      shards with its pread backend (transformers' own choice on MPS and Windows), which reads only what is asked;
    - accelerate's dispatch would turn the resident part into offloaded hooks because the device map mixes a
      device and "meta": skip it for this thread's load.
    The patches are installed by the first offloaded load in progress and removed by the last (loads may run in
    several threads at once); the backend and dispatch patches act only in a thread whose offloaded load is in
    progress, so ordinary loads, even concurrent ones, see transformers unchanged.
    """
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            _install_load_patches()
        _patch_users += 1
    _in_offloaded_load.active = True
    try:
        yield
    finally:
        _in_offloaded_load.active = False
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                _remove_load_patches()


def _offloaded_load_in_this_thread() -> bool:
    return getattr(_in_offloaded_load, "active", False)


def _install_load_patches() -> None:
    original_dispatch = _originals["accelerate_dispatch"] = modeling_utils.accelerate_dispatch
    original_materialize = _originals["_materialize_copy"] = core_model_loading._materialize_copy
    original_safe_open = _originals["safe_open"] = modeling_utils.safe_open

    def safe_open(filename, framework, device="cpu", backend=None, **kwargs):
        if backend == "mmap" and _offloaded_load_in_this_thread():
            backend = "pread"
        if backend is not None:   # safetensors refuses backend=None; callers that omit it get its default
            kwargs["backend"] = backend
        return original_safe_open(filename, framework=framework, device=device, **kwargs)

    def dispatch(*args, **kwargs):
        if _offloaded_load_in_this_thread():
            return None
        return original_dispatch(*args, **kwargs)

    def materialize(tensor, device=None, dtype=None):
        # No thread check here: transformers materialises on worker threads. Only our device maps send checkpoint
        # tensors to "meta" (an ordinary load never asks to read a tensor onto meta).
        if device is not None and torch.device(device).type == "meta":
            shape = tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)
            src = SAFETENSORS_DTYPES.get(tensor.get_dtype()) if hasattr(tensor, "get_dtype") else tensor.dtype
            return torch.empty(shape, dtype=dtype or src, device="meta")
        return original_materialize(tensor, device, dtype)

    modeling_utils.accelerate_dispatch = dispatch
    core_model_loading._materialize_copy = materialize
    modeling_utils.safe_open = safe_open


def _remove_load_patches() -> None:
    modeling_utils.accelerate_dispatch = _originals.pop("accelerate_dispatch")
    core_model_loading._materialize_copy = _originals.pop("_materialize_copy")
    modeling_utils.safe_open = _originals.pop("safe_open")
