"""Model-family adapters: where the MoE layers are, how an expert's tensors pack into one slab, where its bytes are
in the checkpoint, and how the offloaded forward is attached and detached.

One adapter serves every family with transformers' fused experts (`ExpertsInterface`); Switch Transformers,
GPT-OSS, DBRX and Llama-4 have their own. `get_arch(config)` picks one or names the closest supported model types.
This package only re-exports: the base class and registry are in `base`, the shared forward in `forward`, and
importing the adapter modules below registers them.
"""

from __future__ import annotations

# The shared shapes live in `layout`; re-exported here for the adapters' users and older imports.
from ..layout import (RELEASED_ATTR, ExpertPiece, MoELayer, SlabLayout, alignment_offset,  # noqa: F401
                      empty_at_alignment, release_parameter, restore_parameter)
from .base import (ExpertFetcher, MoEArch, StackedParams, SwappedExpertsChild, UnsupportedModelError,  # noqa: F401
                   checkpoint_key_candidates, get_arch, register_arch, registered_archs, supported_model_types,
                   weight_piece)
from . import fused, switch, gpt_oss, dbrx, llama4  # noqa: F401  (registers the adapters, fused first)
from .families import families_markdown, supported_families  # noqa: F401

FUSED_MODEL_TYPES = fused.FusedExpertsArch.model_types   # the explicit entries; supported_model_types() has all
