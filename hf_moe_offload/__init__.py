"""hf_moe_offload: run Mixture-of-Experts Hugging Face models on devices far smaller than the model.

Example:
    >>> import hf_moe_offload
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained(path, offload_policy="auto")        # doctest: +SKIP
    >>> model.generate(**inputs, max_new_tokens=64)                                       # doctest: +SKIP
    >>> hf_moe_offload.stats(model)["hits"]                                               # doctest: +SKIP
"""

from __future__ import annotations

from ._logging import follow_transformers_logging
from .arch import UnsupportedModelError, supported_model_types
from .batching.config import offload_batching_config
from .hooks import LayerHook
from .loading.enable import disable, enable
from .loading.patch import from_pretrained, install
from .policy.offload_policy import OffloadPolicy, PolicyError
from .runtime.engine import get_engine
from .stats import StatsSnapshot
from .storage.checkpoint import CheckpointError

__version__ = "0.1.0"

follow_transformers_logging()   # transformers' set_verbosity_* and its handler govern our log lines too


def stats(model) -> StatsSnapshot:
    """Counters of an offloaded model: hits, misses, evictions, bytes_to_device, peak_cache_bytes, per_layer, ...

    The returned mapping has `reset()` to zero the live counters.
    """
    engine = get_engine(model)
    if engine is None:
        raise PolicyError("this model is not offloaded by hf_moe_offload (no stats)")
    return engine.stats_snapshot()


install()

__all__ = [
    "OffloadPolicy", "PolicyError", "CheckpointError", "UnsupportedModelError", "from_pretrained", "enable",
    "disable", "stats", "supported_model_types", "get_engine", "LayerHook", "offload_batching_config",
]
