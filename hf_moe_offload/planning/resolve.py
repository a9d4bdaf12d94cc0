"""Resolve the "auto" fields of a policy against this machine and the model's footprint; the cost model
(`planner`) then picks the performance fields.

Rule: device = the first CUDA GPU, else the CPU; store = "cpu" when host RAM holds the experts with headroom,
else "disk" (and "disk" whenever an expert_cache is given for the CPU device: host-memory experts are used in
place there, so only the disk store makes a budget bound memory); expert cache = memory free on the device after
offloading (experts the model holds there now count as free, a resident part already there is not counted
twice), minus headroom = KV cache + activations for max_batch_size x max_seq_len tokens + a fixed floor on CUDA.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..policy.offload_policy import (
    AUTO,
    DEFAULT_STREAM_WINDOW,
    OffloadPolicy,
    PolicyError,
    format_bytes,
    normalize_device,
    parse_size,
)
from .auto_plan import plan_for_policy
from .footprint import (
    CUDA_HEADROOM_FLOOR,
    HOST_HEADROOM,
    Footprint,
    auto_device,
    auto_store,
    available_host_bytes,
    container_memory,
    free_bytes,
    headroom_bytes,
    workload,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedPolicy:
    """A policy with every field concrete (no "auto"), its cache budget in bytes, and the auto plan's summary
    (`stats(model)["plan"]`; None when the planner made none)."""

    policy: OffloadPolicy
    cache_bytes: int
    plan: dict[str, Any] | None = None
    # stream_window="auto" that no plan chose, on the CPU: wide passes with many rows per expert get a wider window
    widen_stream_window: bool = False


def resolve(policy: OffloadPolicy, fp: Footprint) -> ResolvedPolicy:
    """Fill the "auto" fields and check the cache budget; raise before anything is allocated.

    Example:
        >>> fp = Footprint(expert_bytes=1 << 20, slab_bytes=1 << 10, resident_bytes=1 << 10, top_k=2)
        >>> resolve(OffloadPolicy(device="cpu", store="disk", expert_cache="50%"), fp).cache_bytes
        524288
    """
    auto_fields = [f for f in ("device", "store", "expert_cache", "disk_reads") if getattr(policy, f) == AUTO]
    device = auto_device() if policy.device == AUTO else normalize_device(policy.device)
    store, why_store = _store(policy, device, fp)
    batch, seq_len = workload(policy, fp)
    zero_copy = device.type == "cpu" and store == "cpu" and fp.host_store_in_place
    given = None if policy.expert_cache == AUTO else _given_cache(policy.expert_cache, fp, zero_copy)
    attention = _attention(policy, device, fp, batch, seq_len, given)
    if given is None:
        cache = fp.expert_bytes if zero_copy else _auto_cache(device, fp, batch, seq_len,
                                                              kv_on_device=attention != "cpu")
        if device.type == "cpu" and store == "cpu" and not zero_copy:   # the host store shares the memory
            cache = max(0, cache - fp.store_bytes)
    else:
        cache = given
    cache = min(cache, fp.expert_bytes)
    if given is not None and device.type == "cpu" and not zero_copy and cache > free_bytes(device):
        logger.warning("hf_moe_offload: expert_cache=%s is more than the host memory this process can still use "
                       "(%s of %s available%s, less a %d%% headroom); the cache's slots are allocated in host memory "
                       "and the reads need page cache too: expect swapping or the out-of-memory killer. Use a "
                       "smaller expert_cache or 'auto'", format_bytes(cache), format_bytes(free_bytes(device)),
                       format_bytes(available_host_bytes()), _container_note(), round(HOST_HEADROOM * 100))
    # expert_compute and resident_layers (placement.py): the resident layers' budget; "cpu" needs no working set.
    cache = check_placement(policy, fp.layer_experts, fp.slab_bytes, fp.top_k, cache, zero_copy)
    if not zero_copy and policy.expert_compute != "cpu" and cache < fp.min_cache_bytes:
        raise PolicyError(_too_small_cache(policy, device, fp, cache, batch, seq_len, attention != "cpu"))
    window = DEFAULT_STREAM_WINDOW if policy.stream_window == AUTO else policy.stream_window
    micro_batches = resolve_micro_batches(policy, fp, store, cache, zero_copy)
    resolved = dataclasses.replace(policy, device=str(device), store=store, expert_cache=cache,
                                   max_batch_size=batch, max_seq_len=seq_len, stream_window=window,
                                   attention=attention, micro_batches=micro_batches,
                                   disk_reads=_disk_reads(policy, device, store, cache, fp, zero_copy))
    resolved, plan = plan_for_policy(policy, resolved, fp)
    if auto_fields:
        logger.info("hf_moe_offload auto policy: device=%s store=%s%s expert_cache=%s disk_reads=%s (experts %s, "
                    "resident part %s, RAM available %s%s)", device, store, why_store, format_bytes(cache),
                    resolved.disk_reads,
                    format_bytes(fp.expert_bytes), format_bytes(fp.resident_bytes),
                    format_bytes(available_host_bytes()), _container_note())
    widen = policy.stream_window == AUTO and plan is None and device.type == "cpu"
    return ResolvedPolicy(resolved, cache, plan, widen_stream_window=widen)


def resolve_micro_batches(policy: OffloadPolicy, fp: Footprint, store: str, cache_bytes: int, zero_copy: bool,
                          where: str = "") -> int:
    """`micro_batches` as a number. "auto" is 1 (off): the slices pay only where one slice's host attention
    overlaps the previous slice's device experts (a GPU with CPU attention), they cost bytes (a layer's experts
    stay in the cache until its last slice, so the resident set is smaller: docs/benchmarks.md), and the overlap
    on CUDA (each slice on its own stream, `runtime.slice_streams`) has not been measured yet. A number above 1 is
    checked: the cache must hold a whole layer's experts beside the resident layers' (`where`: the device whose
    share `cache_bytes` is, for the message).

    Example:
        >>> fp = Footprint(expert_bytes=64 << 10, slab_bytes=1 << 10, resident_bytes=0, top_k=2, layer_experts=(8,) * 8)
        >>> resolve_micro_batches(OffloadPolicy(micro_batches=2), fp, "disk", 16 << 10, False)
        2
    """
    if policy.micro_batches == AUTO:
        return 1
    count = int(policy.micro_batches)
    if count == 1 or zero_copy:
        return count
    if policy.expert_compute == "cpu" and store == "disk":
        raise PolicyError(f"micro_batches={count} with expert_compute='cpu' and store='disk' would read every expert "
                          f"once per micro-batch (experts computed on the CPU are read into reused host buffers); "
                          f"use store='cpu', expert_compute='auto' or 'device', or micro_batches=1")
    if policy.expert_compute == "cpu" and store == "cpu":     # nothing but the resident layers is copied
        return count
    slots, need = cache_bytes // max(fp.slab_bytes, 1), _layer_hold_slots(policy, fp)
    if slots < need:
        raise PolicyError(f"micro_batches={count} keeps each layer's experts on the device until its last "
                          f"micro-batch: expert_cache={format_bytes(cache_bytes)}{where} holds {slots} experts, a "
                          f"layer has up to {max(fp.layer_experts, default=0)}"
                          f"{' beside the resident layers' if int(policy.resident_layers) else ''}; use at least "
                          f"expert_cache={need * fp.slab_bytes}, or micro_batches=1")
    return count


def _layer_hold_slots(policy: OffloadPolicy, fp: Footprint) -> int:
    """Slots a micro-batched layer may pin at once: all its experts, plus the resident layers' for good."""
    layers = int(policy.resident_layers)
    return max(fp.layer_experts, default=fp.top_k) + sum(fp.layer_experts[:layers])


def _container_note() -> str:
    container = container_memory()
    return "" if container is None else f" within the container's limit of {format_bytes(container.limit)}"


def _disk_reads(policy: OffloadPolicy, device: torch.device, store: str, cache: int, fp: Footprint,
                zero_copy: bool) -> str:
    """`disk_reads`: "auto" reads around the page cache where the host memory left beside the expert cache, the host
    store and the resident part (within a container's limit, which counts the page cache) cannot hold the experts'
    file bytes: their pages would be evicted before their next use, so a buffered read only adds the kernel's copy,
    which takes CPU time from the compute beside it, and reclaim (a container's slows the reads and pushes out the
    process's own pages). Where the file bytes fit, buffered: an expert read again comes from RAM
    (docs/benchmarks.md, "Larger than RAM")."""
    if policy.disk_reads != AUTO:
        return policy.disk_reads
    file_bytes = fp.store_bytes or fp.expert_bytes
    on_host = store == "cpu" or zero_copy
    kept = (file_bytes if on_host else 0) + \
        (fp.resident_bytes + (0 if zero_copy else cache) if device.type == "cpu" else 0)
    return "direct" if available_host_bytes() - kept < file_bytes else "buffered"


def _store(policy: OffloadPolicy, device: torch.device, fp: Footprint) -> tuple[str, str]:
    """The store, and why when "auto" chose it against the RAM rule (for the log line)."""
    if policy.store != AUTO:
        return policy.store, ""
    if device.type == "cpu" and policy.expert_cache != AUTO:
        return "disk", (f" (expert_cache={_short(policy.expert_cache)} given for the CPU device: experts in host "
                        f"memory would be used in place and the budget ignored; the disk store keeps it)")
    available = available_host_bytes() * (1 - HOST_HEADROOM)
    return auto_store(fp.store_bytes or fp.expert_bytes, fp.resident_bytes, device.type == "cpu", available), ""


def _given_cache(expert_cache: int | str, fp: Footprint, zero_copy: bool) -> int:
    """An explicit budget in bytes; one the CPU-on-CPU case would silently ignore is refused, one above all
    expert bytes is capped (harmless: the cache never holds more than every expert)."""
    cache = parse_size(expert_cache, total=fp.expert_bytes)
    if zero_copy and cache < fp.expert_bytes:
        raise PolicyError(f"expert_cache={expert_cache!r} has no effect with store='cpu' on the CPU device: experts in "
                          f"host memory are used in place there, all of them stay in memory whatever the budget; "
                          f"use store='disk' to bound memory with expert_cache, or drop expert_cache")
    if cache > fp.expert_bytes:
        logger.info("hf_moe_offload: expert_cache=%s is more than all expert bytes (%s); the cache holds every "
                    "expert, capped to %s", _short(expert_cache), format_bytes(fp.expert_bytes), fp.expert_bytes)
    return cache


def _short(value: Any, limit: int = 40) -> str:
    """A value for a log line: a 400-digit size shown by its length, not its digits."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:12]}... ({len(text)} characters)"


def _too_small_cache(policy: OffloadPolicy, device: torch.device, fp: Footprint, cache: int, batch: int,
                     seq_len: int, kv_on_device: bool) -> str:
    """Why the cache cannot hold one layer's top-k: the budget the user gave, or (expert_cache="auto") the
    workload hints whose KV cache and activations took the device's memory."""
    working_set = (f"one layer's top-k working set: top_k={fp.top_k} x {format_bytes(fp.slab_bytes)} per expert = "
                   f"{format_bytes(fp.min_cache_bytes)}")
    if policy.expert_cache != AUTO:
        return (f"expert_cache={format_bytes(cache)} is smaller than {working_set}; use at least "
                f"expert_cache={fp.min_cache_bytes}")
    headroom = headroom_bytes(device, fp, batch, seq_len, kv_on_device)
    room = format_bytes(max(_room(device, fp), 0))
    return (f"max_batch_size={batch} x max_seq_len={seq_len} needs {format_bytes(headroom)} on {device} for the KV "
            f"cache and activations, which leaves {format_bytes(cache)} of its {room} for the expert cache, less "
            f"than {working_set}; lower max_batch_size or max_seq_len, or give expert_cache explicitly")


def _auto_cache(device: torch.device, fp: Footprint, batch: int, seq_len: int, kv_on_device: bool = True) -> int:
    """Memory on `device` after offloading, less the resident part still to place there and the headroom."""
    return max(0, _room(device, fp) - headroom_bytes(device, fp, batch, seq_len, kv_on_device))


def _room(device: torch.device, fp: Footprint) -> int:
    """Memory on `device` once the experts are offloaded and the resident part is placed."""
    reclaimed = fp.expert_bytes if _is(fp.experts_device, device) else 0
    to_place = 0 if _is(fp.resident_device, device) else fp.resident_bytes
    return free_bytes(device) + reclaimed - to_place


def _attention(policy: OffloadPolicy, device: torch.device, fp: Footprint, batch: int, seq_len: int,
               given_cache: int | None) -> str:
    """attention="auto": "cpu" on a GPU whose memory cannot hold the KV cache of `batch` x `seq_len` beside the
    resident part, the activations and the expert cache (the given budget, else one layer's top-k: the least that
    runs); "device" otherwise, and always on the CPU device (attention runs there already)."""
    if policy.attention != AUTO:
        return policy.attention
    if device.type != "cuda":
        return "device"
    kv = batch * seq_len * fp.kv_bytes_per_token
    left = _room(device, fp) - batch * seq_len * fp.activation_bytes_per_token - CUDA_HEADROOM_FLOOR \
        - (fp.min_cache_bytes if given_cache is None else given_cache)
    if kv <= left:
        return "device"
    if fp.cpu_attention_refusal is not None:
        logger.info("hf_moe_offload auto policy: the KV cache (%s for max_batch_size=%d x max_seq_len=%d) does not "
                    "fit %s (%s left), and CPU attention cannot serve this model (%s): attention stays on the "
                    "device", format_bytes(kv), batch, seq_len, device, format_bytes(max(left, 0)),
                    fp.cpu_attention_refusal)
        return "device"
    logger.info("hf_moe_offload auto policy: attention=cpu: the KV cache (%s for max_batch_size=%d x max_seq_len=%d) "
                "does not fit %s (%s left beside the resident part and the expert cache); keys and values live in "
                "host memory and decode attention runs on the CPU (MoE-Lightning). Set attention='device' and a "
                "smaller max_batch_size to keep it on the GPU", format_bytes(kv), batch, seq_len, device,
                format_bytes(max(left, 0)))
    return "cpu"


def _is(where: str | None, device: torch.device) -> bool:
    return where is not None and torch.device(where) == device


# -- the budget of the static split, checked before anything is allocated ------------------------------------------

def check_placement(policy: Any, layer_experts: Sequence[int], slab_bytes: int, top_k: int, cache_bytes: int,
                    zero_copy: bool) -> int:
    """The cache budget `expert_compute` and `resident_layers` need: raise a `PolicyError` naming the smallest
    budget that works, or return `cache_bytes` (with `expert_compute="cpu"`, capped to the resident layers: no
    other expert is ever copied). `layer_experts`: experts per MoE layer in forward order (empty: unknown, only
    the cross-field rules are checked).

    Example:
        >>> from hf_moe_offload.policy.offload_policy import OffloadPolicy
        >>> check_placement(OffloadPolicy(resident_layers=1), [8, 8], 100, 2, 1000, False)
        1000
        >>> check_placement(OffloadPolicy(resident_layers=1), [8, 8], 100, 2, 900, False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hf_moe_offload.policy.offload_policy.PolicyError: expert_cache=900 B cannot hold resident_layers=1 ...
    """
    compute, layers = policy.expert_compute, int(policy.resident_layers)
    if compute == "cpu" and policy.prefetch in ("hash", "lookahead"):
        raise PolicyError(f"prefetch={policy.prefetch!r} cannot work with expert_compute='cpu': a prefetch copies "
                          f"experts to the device ahead of use, while 'cpu' computes every expert that is not in "
                          f"the resident layers on the CPU from host memory; use expert_compute='auto' (copies when "
                          f"that is faster) or prefetch='none'")
    if layer_experts and layers > len(layer_experts):
        raise PolicyError(f"resident_layers={layers} is more than this model's {len(layer_experts)} MoE layers; "
                          f"allowed: 0 to {len(layer_experts)}")
    if zero_copy or not layer_experts:
        return cache_bytes
    resident = sum(layer_experts[:layers]) * slab_bytes
    others_copy = compute != "cpu" and layers < len(layer_experts)    # layers left to load on demand
    working = top_k * slab_bytes if others_copy else 0
    needed = resident + working
    if layers and cache_bytes < needed:
        what = (f" plus one layer's top-k working set ({top_k} x {format_bytes(slab_bytes)})" if others_copy
                else "")
        raise PolicyError(f"expert_cache={format_bytes(cache_bytes)} cannot hold resident_layers={layers} "
                          f"({sum(layer_experts[:layers])} experts x {format_bytes(slab_bytes)} = "
                          f"{format_bytes(resident)}){what}; use at least expert_cache={needed}, or fewer "
                          f"resident_layers")
    if compute == "cpu" and cache_bytes > resident:
        logger.info("hf_moe_offload: expert_compute='cpu': the device cache holds only the %d resident layers' "
                    "experts (%s); the rest of expert_cache=%s is not allocated", layers, format_bytes(resident),
                    format_bytes(cache_bytes))
        return resident
    return cache_bytes
