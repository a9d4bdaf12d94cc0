"""How an offloaded model selects its experts implementation without changing anything the caller holds.

transformers dispatches a fused experts module's forward on `module.config._experts_implementation`, and that
config is usually the very object the caller built the model from (and may build other models from). So the config
is left alone: each offloaded experts module gets its own shallow copy naming the offloaded implementation, and its
own config back on detach. While offloaded, the model's `get_experts_implementation()` reports the implementation
its experts run through, and `set_experts_implementation()` to another one is refused: the experts hold no weights
that transformers' own implementations could compute with.
"""

from __future__ import annotations

import copy
import functools

from torch import nn

from ..layout import MoELayer
from ..policy.offload_policy import PolicyError
from .base import ExpertFetcher
from .forward import attach_runtime, detach_runtime

# On an experts module: its own config, given back on detach.
_OWN_CONFIG = "_hf_moe_offload_own_config"
# On the model: (offloaded implementation, ids of the configs its offloaded experts modules had).
_SELECTED = "_hf_moe_offload_experts_implementation"
_GUARDED = ("get_experts_implementation", "set_experts_implementation")


def select_experts_implementation(model: nn.Module, layer: MoELayer, runtime: ExpertFetcher,
                                  implementation: str) -> None:
    """Attach `layer` through transformers' `ExpertsInterface`: its experts module gets its runtime and a config of
    its own that selects the offloaded `implementation`; the model's own config is not touched."""
    module = layer.module
    attach_runtime(module, runtime)
    if _OWN_CONFIG not in module.__dict__:
        own = module.config
        view = copy.copy(own)
        # The internal attribute: the public setter would also write the (shared) sub-configs.
        view._experts_implementation_internal = implementation
        object.__setattr__(module, _OWN_CONFIG, own)
        module.config = view
    if _SELECTED not in model.__dict__:
        object.__setattr__(model, _SELECTED, (implementation, set()))
        # Instance attributes shadow the class's methods for this model only; detach removes them.
        for name, guard in zip(_GUARDED, (_reported_implementation, _refuse_other_implementation)):
            object.__setattr__(model, name, functools.partial(guard, model))
    model.__dict__[_SELECTED][1].add(id(module.__dict__[_OWN_CONFIG]))


def restore_experts_implementation(model: nn.Module, layer: MoELayer) -> None:
    """Undo `select_experts_implementation` for `layer` (and the model's methods, once)."""
    module = layer.module
    detach_runtime(module)
    if _OWN_CONFIG in module.__dict__:
        module.config = module.__dict__.pop(_OWN_CONFIG)
    if model.__dict__.pop(_SELECTED, None) is not None:
        for name in _GUARDED:
            model.__dict__.pop(name, None)


def _configs(model: nn.Module) -> dict:
    """The configs `get_experts_implementation` reports on, by its keys ("" the model's, then its sub-configs)."""
    return {"": model.config, **{key: getattr(model.config, key, None) for key in model.config.sub_configs}}


def _reported_implementation(model: nn.Module) -> dict[str, str | None]:
    """`get_experts_implementation()` of an offloaded model: the offloaded implementation where its experts are."""
    implementation, offloaded = model.__dict__[_SELECTED]
    configs = _configs(model)
    return {key: implementation if id(configs.get(key)) in offloaded else value
            for key, value in type(model).get_experts_implementation(model).items()}


def _refuse_other_implementation(model: nn.Module, experts_implementation: str | dict) -> None:
    """`set_experts_implementation()` of an offloaded model: asking for the offloaded implementation is a no-op, and
    another one for the offloaded experts is refused before anything changes; sub-models without offloaded experts
    (a vision tower) take a dict's entries for them as usual."""
    implementation, offloaded = model.__dict__[_SELECTED]
    configs = _configs(model)
    if isinstance(experts_implementation, dict):
        wrong = any(id(configs.get(key)) in offloaded and value != implementation
                    for key, value in experts_implementation.items())
    else:       # a name applies to the model and all its sub-models
        wrong = experts_implementation != implementation
    if wrong:
        raise PolicyError(f"this model's experts are offloaded by hf_moe_offload and run through its experts "
                          f"implementation {implementation!r}; set_experts_implementation({experts_implementation!r}) "
                          f"would leave them without weights to compute with. Call hf_moe_offload.disable(model) "
                          f"first, then set_experts_implementation")
    if isinstance(experts_implementation, dict):
        rest = {key: value for key, value in experts_implementation.items() if id(configs.get(key)) not in offloaded}
        if rest:
            type(model).set_experts_implementation(model, {"": model.config._experts_implementation, **rest})
