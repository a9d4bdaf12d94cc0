"""`enable(model, policy)` and `disable(model)`: offload the experts of a model that is already built, and put
them back."""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Any

import torch
from transformers import PreTrainedModel

from ..arch import MoEArch, MoELayer, get_arch
from ..planning.footprint import footprint
from ..planning.resolve import resolve
from ..policy.offload_policy import OffloadPolicy, PolicyError
from ..runtime.engine import OffloadEngine, get_engine, move_resident_part
from ..storage.folders import remove_folder, temporary_folder
from ..storage.spill import spill_store
from ..storage.store import CpuStore, ExpertStore
from .experts_store import policy_quantized_layouts, quantized_store
from .finish import check_attention, finish_offloading, load_predictor
from .quantized_checkpoints import refuse_quantized_checkpoint


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
    if policy.embedding == "mapped":
        raise PolicyError("embedding='mapped' maps the table from the checkpoint's file while from_pretrained loads "
                          "it; enable() works on a model already loaded: use embedding='auto' or 'memory'")
    check_attention(policy, model)
    arch = get_arch(model.config)
    layers = arch.find_layers(model)
    dtype, experts_device, resident_device = _where_the_model_is(model, layers)
    # Experts already on a device count as free memory there: they are released before the cache is allocated.
    fp = dataclasses.replace(footprint(model, layers, dtype, policy_quantized_layouts(policy, layers, dtype)),
                             experts_device=str(experts_device), resident_device=str(resident_device))
    resolved = resolve(policy, fp)
    predictor = load_predictor(policy, model)
    device = torch.device(resolved.policy.device)
    store, own_folder = _store_of_built_model(resolved.policy, arch, layers, dtype, offload_folder)
    moved_from = None
    try:
        if resident_device != device:
            moved_from = resident_device      # first: a move that fails part-way is undone too
            move_resident_part(model, layers, device)
        engine = OffloadEngine.attach(model, resolved.policy, arch, layers, store, resolved.cache_bytes,
                                      restore_device=experts_device, moved_resident_from=moved_from)
    except BaseException:           # attach gave the experts back; the rest goes back too, nothing is left behind
        store.close()
        if own_folder is not None:
            remove_folder(own_folder)
        if moved_from is not None:
            move_resident_part(model, layers, moved_from)
        raise
    if own_folder is not None:
        # The store's files go with the engine: on disable(), or at exit for a model never disabled.
        engine.on_detach.append(weakref.finalize(engine, remove_folder, own_folder))
    return finish_offloading(model, engine, resolved, predictor, loaded=False)


def _where_the_model_is(model: PreTrainedModel, layers: list[MoELayer]) -> tuple[torch.dtype, torch.device,
                                                                                   torch.device]:
    """The experts' dtype and device, and the device of the rest of the model; experts not loaded are refused."""
    expert_params = [p for lay in layers for p in lay.module.parameters()]
    if any(p.device.type == "meta" for p in expert_params):
        raise PolicyError("the model's experts are on the meta device (not loaded); load it with "
                          "from_pretrained(..., offload_policy=...) instead")
    experts_device = expert_params[0].device
    resident_device = next((p.device for n, p in model.named_parameters() if p.device.type != "meta"
                            and not any(n.startswith(lay.name + ".") for lay in layers)), experts_device)
    return expert_params[0].dtype, experts_device, resident_device


def _store_of_built_model(policy: OffloadPolicy, arch: MoEArch, layers: list[MoELayer], dtype: torch.dtype,
                          offload_folder: str | os.PathLike | None) -> tuple[ExpertStore, str | None]:
    """The store of the experts the model holds now, and the temporary folder it owns (None: none), which the
    caller removes with the engine. A failed build removes its own folder."""
    folder, own_folder = None, None
    if policy.store == "disk":
        folder = str(offload_folder) if offload_folder is not None else temporary_folder()
        own_folder = None if offload_folder is not None else folder
    device = torch.device(policy.device)
    try:
        if policy.quantize != "none":
            store = quantized_store(policy, layers, dtype, device,
                                    lambda l, e: arch.expert_tensors(layers[l].module, e), folder)
        elif folder is not None:
            store = spill_store(layers, arch.expert_tensors, dtype, folder)
        else:
            store = CpuStore.from_modules(layers, arch.expert_tensors, dtype, device=device)
    except BaseException:
        if own_folder is not None:
            remove_folder(own_folder)
        raise
    return store, own_folder


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Detach everything hf_moe_offload attached and give the experts back to the model as parameters, with the
    `requires_grad` they had when offloaded (`model.requires_grad_()` while offloaded does not reach them: they are
    no parameters then). Experts offloaded with `quantize` come back dequantized."""
    engine = get_engine(model)
    if engine is None:
        raise PolicyError("this model is not offloaded by hf_moe_offload (nothing to disable)")
    engine.detach()
    return model
