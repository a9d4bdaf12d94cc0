"""The store an offloaded model's experts live in, for the policy's `quantize`: quantized host slabs, or a
quantized folder read per expert (written once, reused while its fingerprint matches)."""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from ..layout import MoELayer
from ..policy.offload_policy import AUTO, DEFAULT_INT4_GROUP_SIZE, OffloadPolicy
from ..storage.quantize import QuantizedSlabLayout, quantized_layouts
from ..storage.spill import (
    quantized_cache_root,
    quantized_fingerprint,
    quantized_folder_store,
)
from ..storage.store import CpuStore, DiskStore

logger = logging.getLogger(__name__)


def policy_quantized_layouts(policy: OffloadPolicy, layers: list[MoELayer], dtype: torch.dtype,
                       device: torch.device | None = None) -> list[QuantizedSlabLayout] | None:
    """The layers' quantized slab layouts for `policy`, packed for `device` (None: plain), or None."""
    if policy.quantize == "none":
        return None
    group = DEFAULT_INT4_GROUP_SIZE if policy.quant_group_size == AUTO else int(policy.quant_group_size)
    dense = [lay.layout for lay in layers]
    if device is None:
        return [QuantizedSlabLayout.build(d, policy.quantize, group, dtype) for d in dense]
    return quantized_layouts(dense, policy.quantize, group, dtype, device)

def quantized_store(policy: OffloadPolicy, layers: list[MoELayer], dtype: torch.dtype, device: torch.device,
                     read_expert: Callable[[int, int], dict[str, torch.Tensor]], folder: str | None,
                     source_files: list[str] | None = None) -> CpuStore | DiskStore:
    """A store of quantized experts: host slabs (store="cpu"), or a quantized folder read per expert ("disk").

    With `source_files` (a checkpoint) the folder is `folder` or a cache folder per fingerprint, reused while the
    fingerprint matches; without (a built model's experts, `enable`) it is always written. Either way it is built
    under the folder's lock and never rewritten under a store that reads it (`quantized_folder_store`)."""
    layouts = policy_quantized_layouts(policy, layers, dtype, device)
    num_experts = [lay.num_experts for lay in layers]
    if policy.store == "cpu":
        return CpuStore.build_quantized(read_expert, layouts, num_experts, dtype, device=device)
    fingerprint = quantized_fingerprint(source_files, layouts) if source_files else "built-model"
    if folder is None:
        folder = os.path.join(quantized_cache_root(), fingerprint)
    return quantized_folder_store(folder, fingerprint, layouts, layers, dtype, read_expert,
                                  reuse=bool(source_files))
