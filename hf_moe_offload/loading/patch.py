"""The `offload_policy=` keyword of `from_pretrained`, on every transformers model class and Auto class.

transformers has no registry for extra `from_pretrained` keywords, so `install()` wraps
`PreTrainedModel.from_pretrained` once: without `offload_policy` the call goes to transformers untouched (the
package is invisible); with it, the load goes through `hf_moe_offload.loading.load`. Auto classes forward unknown
keywords to the model class, so they are covered too.

Loads are serialised while the package is imported: transformers' `from_pretrained` swaps class-level functions
(`PreTrainedModel.tie_weights`, `init_weights`, torch's init functions) for the duration of a load, so two loads in
two threads can leave them swapped for good, and every later model loads untied (seen with transformers 5.23: a
Switch Transformers model then loads with meta embeddings). One lock around every load closes that race.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, PreTrainedModel

from .gguf import load_gguf_offloaded
from .load import HUB_KWARGS, load_offloaded

_ORIGINAL = PreTrainedModel.from_pretrained.__func__
_LOAD_LOCK = threading.RLock()   # re-entrant: a load may load sub-models
_CONFIG_KWARGS = (*HUB_KWARGS, "gguf_file")   # what says where the config is


def _from_pretrained(cls, pretrained_model_name_or_path, *model_args, offload_policy: Any = None, **kwargs):
    with _LOAD_LOCK:
        if offload_policy is None:
            return _ORIGINAL(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        return _loader(kwargs)(cls, pretrained_model_name_or_path, offload_policy, *model_args,
                               original_from_pretrained=_ORIGINAL, **kwargs)


def _loader(kwargs: dict):
    """The offloaded load for these `from_pretrained` keywords: a GGUF file's (`gguf_file=`), or safetensors'."""
    return load_gguf_offloaded if kwargs.get("gguf_file") is not None else load_offloaded


def install() -> None:
    """Add the `offload_policy` keyword to `PreTrainedModel.from_pretrained` (idempotent)."""
    if getattr(PreTrainedModel.from_pretrained, "_hf_moe_offload", False):
        return
    wrapped = functools.wraps(_ORIGINAL)(_from_pretrained)
    wrapped._hf_moe_offload = True
    PreTrainedModel.from_pretrained = classmethod(wrapped)


def uninstall() -> None:
    """Restore transformers' own `from_pretrained`."""
    PreTrainedModel.from_pretrained = classmethod(_ORIGINAL)


def from_pretrained(pretrained_model_name_or_path, offload_policy: Any = "auto", *model_args,
                    model_class: type | None = None, **kwargs) -> PreTrainedModel:
    """Load a model with its experts offloaded, without relying on the keyword patch.

    `model_class` defaults to `AutoModelForCausalLM`, or `AutoModelForSeq2SeqLM` for encoder-decoder configs.

    Example:
        >>> policy = {"device": "cpu", "store": "disk", "expert_cache": "25%"}
        >>> model = hf_moe_offload.from_pretrained(path, policy)   # doctest: +SKIP
    """
    if offload_policy is None:       # here None is the default policy; only the keyword patch reads it as "off"
        offload_policy = "auto"
    if model_class is None:
        config_kwargs = {k: kwargs[k] for k in _CONFIG_KWARGS if kwargs.get(k) is not None}
        model_class = auto_model_class(kwargs.get("config")
                                       or AutoConfig.from_pretrained(pretrained_model_name_or_path, **config_kwargs))
    if hasattr(model_class, "_model_mapping"):   # Auto class: let it pick the concrete class, then our loader runs
        return model_class.from_pretrained(pretrained_model_name_or_path, *model_args,
                                           offload_policy=offload_policy, **kwargs)
    with _LOAD_LOCK:
        return _loader(kwargs)(model_class, pretrained_model_name_or_path, offload_policy, *model_args,
                               original_from_pretrained=_ORIGINAL, **kwargs)


def auto_model_class(config) -> type:
    """The Auto class that generates with `config`'s model: `AutoModelForSeq2SeqLM` for encoder-decoders (Switch
    Transformers), else `AutoModelForCausalLM`.

    Example:
        >>> from transformers import SwitchTransformersConfig
        >>> auto_model_class(SwitchTransformersConfig()).__name__
        'AutoModelForSeq2SeqLM'
    """

    return AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
