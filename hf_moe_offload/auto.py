"""Resolve the "auto" fields of a policy against this machine and the model's footprint (a plain rule for now;
a cost-model planner replaces it later).

Rule: device = the first CUDA GPU, else the CPU; store = "cpu" when host RAM holds the experts with headroom,
else "disk"; expert cache = device memory left after the resident part, minus headroom for activations and KV.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import psutil
import torch

from .policy import AUTO, OffloadPolicy, PolicyError, format_bytes, normalize_device, parse_size

logger = logging.getLogger(__name__)

HOST_HEADROOM = 0.15        # share of available RAM kept free when deciding the store
DEVICE_HEADROOM = 0.10      # share of device memory kept for activations and the KV cache
MIN_DEVICE_HEADROOM = 1 << 30


@dataclass(frozen=True)
class Footprint:
    """Sizes that decide a policy: all in bytes, at the dtype the model will run in."""

    expert_bytes: int        # every expert of every MoE layer
    slab_bytes: int          # the largest single expert
    resident_bytes: int      # everything that is not an expert
    top_k: int

    @property
    def min_cache_bytes(self) -> int:
        """One layer's top-k working set: the smallest cache that can run a token."""
        return self.top_k * self.slab_bytes


@dataclass(frozen=True)
class ResolvedPolicy:
    policy: OffloadPolicy     # every field concrete (no "auto")
    cache_bytes: int


def resolve(policy: OffloadPolicy, fp: Footprint) -> ResolvedPolicy:
    """Fill the "auto" fields and check the cache budget; raise before anything is allocated."""
    auto_fields = [f for f in ("device", "store", "expert_cache") if getattr(policy, f) == AUTO]
    device = _auto_device() if policy.device == AUTO else normalize_device(policy.device)
    store = _auto_store(device, fp) if policy.store == AUTO else policy.store
    zero_copy = device.type == "cpu" and store == "cpu"
    if policy.expert_cache == AUTO:
        cache = fp.expert_bytes if zero_copy else _auto_cache(device, fp)
    else:
        cache = parse_size(policy.expert_cache, total=fp.expert_bytes)
    cache = min(cache, fp.expert_bytes)
    if not zero_copy and cache < fp.min_cache_bytes:
        raise PolicyError(f"expert_cache={format_bytes(cache)} is smaller than one layer's top-k working set: "
                          f"top_k={fp.top_k} x {format_bytes(fp.slab_bytes)} per expert = "
                          f"{format_bytes(fp.min_cache_bytes)}; use at least expert_cache={fp.min_cache_bytes}")
    resolved = dataclasses.replace(policy, device=str(device), store=store, expert_cache=cache)
    if auto_fields:
        logger.info("hf_moe_offload auto policy: device=%s store=%s expert_cache=%s (experts %s, resident part %s, "
                    "RAM available %s)", device, store, format_bytes(cache), format_bytes(fp.expert_bytes),
                    format_bytes(fp.resident_bytes), format_bytes(psutil.virtual_memory().available))
    return ResolvedPolicy(resolved, cache)


def _auto_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _auto_store(device: torch.device, fp: Footprint) -> str:
    needed = fp.expert_bytes + (fp.resident_bytes if device.type == "cpu" else 0)
    available = psutil.virtual_memory().available * (1 - HOST_HEADROOM)
    return "cpu" if needed <= available else "disk"


def _auto_cache(device: torch.device, fp: Footprint) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        headroom = max(MIN_DEVICE_HEADROOM, int(total * DEVICE_HEADROOM))
        return max(0, free - fp.resident_bytes - headroom)
    available = psutil.virtual_memory().available * (1 - HOST_HEADROOM)
    return max(0, int(available) - fp.resident_bytes)
