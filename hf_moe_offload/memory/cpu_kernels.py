"""The CPU kernel for bfloat16 expert matmuls: weights prepacked once for oneDNN, where they never change.

`F.linear` on a bfloat16 weight in the plain [out, in] layout makes oneDNN's matmul re-block the weight on every
call, which at a few rows costs more than reading it. `torch.ops.mkldnn._reorder_linear_weight` blocks it once;
`torch.ops.mkldnn._linear_pointwise` then reads the blocked copy straight through. Same kernel family, same
accumulation: the results equal `F.linear`'s bit for bit (tests/test_cpu_kernels.py checks the shapes the models
use, 1 to 64 rows).

The blocked copy is an opaque oneDNN tensor, a copy as large as the weight. So only memory that stays the same for
the life of the registration is packed: a CPU store's slabs (`PrepackedWeights.for_store`), which the store never
writes after loading. Copies are made at an expert's first use, within a byte budget taken from the RAM available
at registration (`prepack_budget`); past it, experts run through `F.linear` as before. `disable()` and
`state_dict()` read the store's own slabs, so they never see a packed copy. Float32 weights keep `F.linear` (MKL's
sgemm is not re-blocked per call, and the packed path rounds differently).
"""

from __future__ import annotations

import bisect
import logging
import threading

import psutil
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

RESERVE_FRACTION = 0.10          # of total RAM left free after packing (KV cache, activations, other processes)
RESERVE_MIN_BYTES = 1 << 30      # ... and never less than this

_ACTIVE: list["PrepackedWeights"] = []   # registrations live now; `linear` consults them
_ACTIVE_LOCK = threading.Lock()


def prepack_supported(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` get a prepacked oneDNN copy on this machine (bfloat16 with oneDNN's bf16)."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_budget(available: int | None = None, total: int | None = None) -> int:
    """Bytes of packed copies RAM allows now: what is available, less a reserve of 10% of RAM (at least 1 GiB).

    Example:
        >>> prepack_budget(available=8 << 30, total=16 << 30) == (8 << 30) - int(0.1 * (16 << 30))
        True
    """
    memory = psutil.virtual_memory() if available is None or total is None else None
    available = memory.available if available is None else available
    total = memory.total if total is None else total
    return max(0, available - max(RESERVE_MIN_BYTES, int(RESERVE_FRACTION * total)))


class PrepackedWeights:
    """Packed oneDNN copies of bfloat16 weights that lie inside `tensors`, made at first use within `budget_bytes`.

    The registration holds `tensors`, so while it is active an address inside them can only mean their bytes; their
    owner promises not to write them until `close()`. Thread-safe.

    Example:
        >>> slab = torch.randn(4, 64 * 32).to(torch.bfloat16)
        >>> with PrepackedWeights([slab], budget_bytes=1 << 20) as packed:              # doctest: +SKIP
        ...     y = linear(torch.randn(1, 32, dtype=torch.bfloat16), slab[0].view(64, 32))
    """

    def __init__(self, tensors: list[torch.Tensor], budget_bytes: int):
        self._tensors = [t for t in tensors if t.numel()]
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in self._tensors)
        self._starts = [s for s, _ in spans]
        self._ends = [e for _, e in spans]
        self.budget_bytes = budget_bytes
        self.packed_bytes = 0                         # what the copies hold now (counted in the stats)
        self._packed: dict[tuple[int, int, int], torch.Tensor] = {}
        self._lock = threading.Lock()
        self._full_logged = False
        with _ACTIVE_LOCK:
            _ACTIVE.append(self)

    @classmethod
    def for_store(cls, store) -> "PrepackedWeights | None":
        """A registration over a dense bfloat16 CPU store's slabs, or None where nothing would be packed."""
        if not store.in_host_memory or store.quantized or not prepack_supported(store.dtype):
            return None
        tensors = list(getattr(store, "slabs", ()))
        if not tensors:
            return None
        return cls(tensors, prepack_budget())

    def owns(self, weight: torch.Tensor) -> bool:
        """Whether `weight`'s bytes lie inside the registered tensors."""
        start = weight.data_ptr()
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and start + weight.numel() * weight.element_size() <= self._ends[i]

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of `weight` (made now if it is new and the budget allows), or None."""
        key = (weight.data_ptr(), weight.shape[0], weight.shape[1])
        found = self._packed.get(key)
        if found is not None or not self.owns(weight):
            return found
        nbytes = weight.numel() * weight.element_size()
        with self._lock:
            found = self._packed.get(key)
            if found is None and self.packed_bytes + nbytes <= self.budget_bytes:
                found = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
                self._packed[key] = found
                self.packed_bytes += nbytes
            elif found is None and not self._full_logged:
                self._full_logged = True
                logger.info("hf_moe_offload: prepacked CPU weights reached their RAM budget (%d bytes); the rest "
                            "computes through F.linear", self.budget_bytes)
        return found

    def close(self) -> None:
        """Drop every packed copy and the registration (before the tensors are freed or written)."""
        with _ACTIVE_LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
        with self._lock:
            self._packed.clear()
            self._tensors, self._starts, self._ends = [], [], []
            self.packed_bytes = 0

    def __enter__(self) -> "PrepackedWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (same bits), through the prepacked copy where `weight` lies in registered memory.

    x [..., K]; weight [N, K] -> [..., N]."""
    if _ACTIVE and weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and weight.device.type == "cpu" \
            and weight.dim() == 2 and weight.is_contiguous():
        for registration in tuple(_ACTIVE):     # a copy: another thread may register meanwhile
            packed = registration.packed(weight)
            if packed is not None:
                flat = x.reshape(-1, x.shape[-1]).contiguous()                               # [T, K]
                out = torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")   # [T, N]
                return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)
