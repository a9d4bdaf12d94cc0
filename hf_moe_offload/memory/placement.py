"""Where a missing expert computes: copied into the device cache, or on the CPU from the host copy (Fiddler,
llama.cpp `--cpu-moe`, KTransformers), plus the budget rule of the static split (`resident_layers`).

`expert_compute="auto"` decides per expert per step by comparing two measured costs:

    copy:  slab bytes / host-to-device bandwidth                       (the copy engine's own loads, or calibration)
    cpu:   measured CPU time of an expert with that many tokens (an EWMA per power-of-two token bucket), or before a
           measurement exists: slab bytes / host memory bandwidth + tokens x 2 x slab elements / CPU FLOP/s

and takes the cheaper: a few tokens compute on the CPU (one pass over the weights in host memory), many tokens
are copied (the CPU's FLOP/s run out long before the link's bandwidth). A disk store pays the same read either way,
so only the copy and the compute are compared.

When the device is the CPU both sides are the same memory and the rule is fixed, not measured: experts in host
memory compute in place (copying them into a slot would only add a memcpy), experts read from disk go into the
cache (the compute costs the same, and the slot keeps the expert for later hits).

Example:
    >>> p = ExpertPlacement(same_memory=False, host_store=True, h2d_bytes_per_s=25e9, host_bytes_per_s=50e9,
    ...                     cpu_flops=1e11)
    >>> p.on_cpu(nbytes=300 << 20, numel=150 << 20, tokens=1), p.on_cpu(300 << 20, 150 << 20, tokens=64)
    (True, False)
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..policy.offload_policy import PolicyError, format_bytes
from ..planning.profile import best_rate

logger = logging.getLogger(__name__)

EWMA = 0.3                 # weight of a new measurement
CALIBRATION_BYTES = 64 << 20


def token_bucket(tokens: int) -> int:
    """The power of two at or above `tokens` (CPU time is measured per bucket, not per exact count).

    Example:
        >>> [token_bucket(t) for t in (1, 2, 3, 5, 16)]
        [1, 2, 4, 8, 16]
    """
    return 1 << max(0, int(tokens) - 1).bit_length()


class TransferMeter:
    """Bytes per second of the copies a copy engine made (an EWMA, thread-safe): `record(nbytes, seconds)`.

    Example:
        >>> meter = TransferMeter(); meter.record(1000, 0.001); round(meter.bytes_per_s)
        1000000
    """

    def __init__(self) -> None:
        self.bytes_per_s: float | None = None
        self.count = 0
        self._lock = threading.Lock()
        self._pending: deque = deque()     # CUDA (start, end, nbytes) event pairs not known to be done yet

    def record(self, nbytes: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            self.bytes_per_s = rate if self.bytes_per_s is None else (1 - EWMA) * self.bytes_per_s + EWMA * rate
            self.count += 1

    def record_events(self, start: Any, end: Any, nbytes: int) -> None:
        """A CUDA copy timed by an event pair; settled once the end event has run (`settle`)."""
        with self._lock:
            self._pending.append((start, end, nbytes))
            if len(self._pending) > 1024:      # nobody settles (no "auto" decision asked): keep the newest
                self._pending.popleft()

    def settle(self) -> None:
        """Fold in the event-timed copies that have finished (never blocks)."""
        while True:
            with self._lock:
                if not self._pending or not self._pending[0][1].query():
                    return
                start, end, nbytes = self._pending.popleft()
            self.record(nbytes, start.elapsed_time(end) / 1e3)


class ExpertPlacement:
    """The per-expert decision of `expert_compute="auto"` and the measurements it rests on.

    `same_memory`: the device is the CPU (fixed rule, see the module docstring); `host_store`: experts are in host
    memory (not read from disk). Bandwidths and FLOP/s may be injected (tests, or numbers measured elsewhere);
    `copy_meter` is the copy engine's meter, preferred over `h2d_bytes_per_s` once it has measured a copy.

    Example:
        >>> p = ExpertPlacement(same_memory=True, host_store=False)
        >>> p.on_cpu(nbytes=1 << 20, numel=1 << 18, tokens=1)   # CPU device, disk store: into the cache
        False
    """

    def __init__(self, same_memory: bool, host_store: bool, h2d_bytes_per_s: float | None = None,
                 host_bytes_per_s: float | None = None, cpu_flops: float | None = None,
                 copy_meter: TransferMeter | None = None):
        self.same_memory, self.host_store = same_memory, host_store
        self.h2d_bytes_per_s, self.host_bytes_per_s, self.cpu_flops = h2d_bytes_per_s, host_bytes_per_s, cpu_flops
        self.copy_meter = copy_meter
        self.cpu_s: dict[int, float] = {}      # token bucket -> EWMA of one expert's CPU time (s)
        self._lock = threading.Lock()
        self._logged = False

    # -- the decision ---------------------------------------------------------------------------------------------

    def on_cpu(self, nbytes: int, numel: int, tokens: int) -> bool:
        """Whether a missing expert of `nbytes` bytes (`numel` weights) with `tokens` tokens computes on the CPU."""
        if self.same_memory:
            return self.host_store
        return self.cpu_cost(nbytes, numel, tokens) < self.copy_cost(nbytes)

    def copy_cost(self, nbytes: int) -> float:
        """Seconds to copy the slab to the device."""
        return nbytes / self.h2d_rate()

    def cpu_cost(self, nbytes: int, numel: int, tokens: int) -> float:
        """Seconds to compute the expert on the CPU for `tokens` tokens: measured, else the model."""
        measured = self.cpu_s.get(token_bucket(tokens))
        if measured is not None:
            return measured
        return nbytes / (self.host_bytes_per_s or 1e10) + tokens * 2 * numel / (self.cpu_flops or 1e10)

    def h2d_rate(self) -> float:
        if self.copy_meter is not None:
            self.copy_meter.settle()
            if self.copy_meter.bytes_per_s is not None:
                return self.copy_meter.bytes_per_s
        return self.h2d_bytes_per_s or 1e10

    def record_cpu(self, tokens: int, seconds: float) -> None:
        """One expert computed on the CPU for `tokens` tokens took `seconds`."""
        bucket = token_bucket(tokens)
        with self._lock:
            old = self.cpu_s.get(bucket)
            self.cpu_s[bucket] = seconds if old is None else (1 - EWMA) * old + EWMA * seconds

    def measurements(self) -> dict[str, Any]:
        """The decision's inputs, for `stats(model)`."""
        return {"h2d_bytes_per_s": None if self.same_memory else self.h2d_rate(),
                "host_bytes_per_s": self.host_bytes_per_s, "cpu_flops": self.cpu_flops,
                "cpu_expert_s": {bucket: self.cpu_s[bucket] for bucket in sorted(self.cpu_s)}}

    def log_rule(self, nbytes: int, numel: int) -> None:
        """Say once, at INFO, how "auto" decides and where the break-even is for this model's experts."""
        if self._logged:
            return
        self._logged = True
        if self.same_memory:
            logger.info("hf_moe_offload: expert_compute='auto' on the CPU device: %s", "experts in host memory "
                        "compute in place" if self.host_store else "experts read from disk go into the cache (the "
                        "slot keeps them for later hits; the compute costs the same)")
            return
        even = next((t for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
                     if not self.on_cpu(nbytes, numel, t)), None)
        logger.info("hf_moe_offload: expert_compute='auto': a missing expert computes on the CPU when its CPU time "
                    "(measured per token count; before that %s / host %s/s + tokens x %.3g FLOP / %.3g FLOP/s) is "
                    "below its copy (%s / %s/s); now: copied from %s tokens per expert", format_bytes(nbytes),
                    format_bytes(int(self.host_bytes_per_s or 1e10)), 2.0 * numel, self.cpu_flops or 1e10,
                    format_bytes(nbytes), format_bytes(int(self.h2d_rate())),
                    even if even is not None else "more than 1024")

    # -- calibration ----------------------------------------------------------------------------------------------

    @classmethod
    def calibrated(cls, device: torch.device, dtype: torch.dtype, slab_numel: int, host_store: bool,
                   copy_meter: TransferMeter | None = None) -> "ExpertPlacement":
        """Measure host memory bandwidth, CPU FLOP/s in `dtype`, and (CUDA) host-to-device bandwidth; a few ms."""
        same = device.type == "cpu"
        placement = cls(same_memory=same, host_store=host_store, copy_meter=copy_meter)
        if same:
            return placement
        numel = max(1, min(slab_numel, CALIBRATION_BYTES // dtype.itemsize))
        with torch.inference_mode(False), torch.no_grad():
            src = torch.ones(numel, dtype=dtype)
            dst = torch.empty_like(src)
            placement.host_bytes_per_s = best_rate(src.nbytes, lambda: dst.copy_(src), seconds=0)
            a, w = torch.ones(16, 512, dtype=dtype), torch.ones(512, 512, dtype=dtype)
            placement.cpu_flops = best_rate(2 * 16 * 512 * 512, lambda: F.linear(a, w), seconds=0)
            if device.type == "cuda":
                pinned = src.pin_memory()
                on_device = torch.empty(numel, dtype=dtype, device=device)

                def copy() -> None:
                    on_device.copy_(pinned, non_blocking=True)
                    torch.cuda.synchronize(device)

                placement.h2d_bytes_per_s = best_rate(pinned.nbytes, copy, seconds=0)
                del on_device
        return placement


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
        >>> check_placement(OffloadPolicy(resident_layers=1), [8, 8], 100, 2, 900, False)
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
