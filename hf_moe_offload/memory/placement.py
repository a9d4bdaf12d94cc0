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
from typing import Any

import torch
import torch.nn.functional as F

from ..policy.offload_policy import format_bytes
from .._timing import best_rate
from .copy_engine import EWMA, TransferMeter

logger = logging.getLogger(__name__)

CALIBRATION_BYTES = 64 << 20


def token_bucket(tokens: int) -> int:
    """The power of two at or above `tokens` (CPU time is measured per bucket, not per exact count).

    Example:
        >>> [token_bucket(t) for t in (1, 2, 3, 5, 16)]
        [1, 2, 4, 8, 16]
    """
    return 1 << max(0, int(tokens) - 1).bit_length()


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
