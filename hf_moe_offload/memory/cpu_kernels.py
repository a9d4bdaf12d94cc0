"""The CPU kernels for bfloat16 matmuls of few rows, where a decode step spends its time reading weights.

`F.linear` on a bfloat16 weight in the plain [out, in] layout makes oneDNN's matmul re-block the weight on every
call, which at a few rows costs more than reading it. `torch.ops.mkldnn._reorder_linear_weight` blocks it once;
`torch.ops.mkldnn._linear_pointwise` then reads the blocked copy: the same kernel family and accumulation, the same
bits as `F.linear` (tests/test_cpu_kernels.py), so exact modes stay exact.

The blocked copy is an opaque oneDNN tensor as large as the weight, made at a weight's first use within a byte
budget taken from the memory available at registration, RAM or a container's limit (`prepack_budget`); past it,
`F.linear` as before. Registered memory (`PrepackedWeights`): a CPU store's slabs (`for_store`), which the store
never writes after loading, and the model's own bias-free linear layers on the CPU (`DenseLinears`: attention
projections, routers, the head; a layer whose weight is left in the checkpoint's file, `loading.mapped_dense`, is
packed at once whatever the budget, its copy being the weight's only memory). A CPU store served in place on the
CPU goes further (`pack_and_release`, `loading.finish`): every expert is packed at load and the slabs' pages are
handed back, so the copies are the experts' only memory; a weight there without a current copy is refused rather
than read (its bytes would read as zeros). A copy is remade if its weight was written in place since (the tensor's
version counter; a write through `.data` bumps none and is not seen: `disable()` then `enable()` after one).
`state_dict()` and `disable()` read the store (the checkpoint again, for slabs handed back) and the parameters,
never a packed copy, but for a weight left in the file, which `disable()` puts back in memory from its copy (the
same bytes).

Opt-in, approximate (`HF_MOE_OFFLOAD_CPU_GEMV=1`): one-row products as a float32 reduction compiled by
`torch.compile` (inductor's C++ backend, dynamic shapes: one compile for every weight shape), which reads the plain
weight once with no copy and runs faster than oneDNN's kernel at one row, but sums in another order: within a
rounding of `F.linear`, not equal to it, so greedy tokens may differ from the unpatched model's.

Float32 weights keep `F.linear` (MKL's sgemm does not re-block per call).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import weakref
from typing import Callable

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from ..planning.footprint import available_host_bytes, container_memory

logger = logging.getLogger(__name__)

RESERVE_FRACTION = 0.10          # of total RAM left free after packing (KV cache, activations, other processes)
RESERVE_MIN_BYTES = 1 << 30      # ... and never less than this

GEMV_ENV = "HF_MOE_OFFLOAD_CPU_GEMV"   # "1": the compiled one-row product (approximate)

# Registrations live now; `linear` consults them. Weak: a registration lives as long as its owner (the engine's
# cache and stats) and goes with a model that is dropped without `disable()`, slabs and copies included. A tuple
# replaced whole at every change, so `linear` reads it without a lock or a copy.
_ACTIVE: "tuple[weakref.ref[PrepackedWeights], ...]" = ()
_ACTIVE_LOCK = threading.Lock()


def active_registrations() -> list["PrepackedWeights"]:
    """The registrations `linear` consults now."""
    return [registration for registration in (ref() for ref in _ACTIVE) if registration is not None]


def _set_active(add: "PrepackedWeights | None" = None, remove: "PrepackedWeights | None" = None) -> None:
    """Replace `_ACTIVE` with `add` registered, `remove` and collected registrations left out."""
    global _ACTIVE
    with _ACTIVE_LOCK:
        kept = tuple(ref for ref in _ACTIVE if ref() is not None and ref() is not remove)
        _ACTIVE = kept + ((weakref.ref(add),) if add is not None else ())


def prepack_supported(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` get a prepacked oneDNN copy on this machine: bfloat16, where the CPU computes bf16
    itself (avx512_bf16 or AMX). oneDNN emulates bf16 on other AVX-512 CPUs, and there the packed kernel and
    `F.linear` may sum in different orders with several threads: the copy would not give the same bits."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))


def prepack_budget(available: int | None = None, total: int | None = None) -> int:
    """Bytes of packed copies memory allows now: what is available, less a reserve of 10% of the memory (at least
    1 GiB). Both within the process's container limit, when it has one: a container's memory is its limit, not
    the machine's RAM.

    Example:
        >>> prepack_budget(available=8 << 30, total=16 << 30) == (8 << 30) - int(0.1 * (16 << 30))
        True
    """
    if available is None:
        available = available_host_bytes()
    if total is None:
        total, container = psutil.virtual_memory().total, container_memory()
        if container is not None:
            total = min(total, container.limit)
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
        self._packed: dict[tuple[int, int, int], tuple[torch.Tensor, int]] = {}   # key -> (copy, weight version)
        self._lock = threading.Lock()
        self._full_logged = False
        # Tensors (by their place in the sorted spans) whose pages the owner handed back (`pack_and_release`):
        # their bytes are gone, so a weight inside them computes through its copy or not at all.
        self._released: set[int] = set()
        _set_active(add=self)

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
        return self._span(weight) is not None

    def released(self, weight: torch.Tensor) -> bool:
        """Whether `weight` lies in a tensor whose pages were handed back (`pack_and_release`)."""
        return bool(self._released) and self._span(weight) in self._released

    def _span(self, weight: torch.Tensor) -> int | None:
        start = weight.data_ptr()
        i = bisect.bisect_right(self._starts, start) - 1
        return i if i >= 0 and start + weight.numel() * weight.element_size() <= self._ends[i] else None

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of `weight` (made now if it is new or was written since, and the budget allows), or
        None."""
        key = _key(weight)
        found = self._packed.get(key)
        version = _version(weight)
        if found is not None and found[1] == version:
            return found[0]
        span = self._span(weight)
        if span is None or span in self._released:      # not ours, or bytes handed back: never packed from them
            return None
        nbytes = weight.numel() * weight.element_size()
        with self._lock:
            stale = self._packed.pop(key, None)
            if stale is not None:
                self.packed_bytes -= nbytes
            if self.packed_bytes + nbytes > self.budget_bytes:
                if not self._full_logged:
                    self._full_logged = True
                    logger.info("hf_moe_offload: prepacked CPU weights reached their RAM budget (%d bytes); the "
                                "rest computes through F.linear", self.budget_bytes)
                return None
            copy = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            self._packed[key] = (copy, version)
            self.packed_bytes += nbytes
        return copy

    def pack_and_release(self, tensor: torch.Tensor, weights: list[torch.Tensor],
                         release: Callable[[], None]) -> None:
        """Pack every one of `weights` (views inside the registered `tensor`) whatever the budget, then call
        `release`, which hands `tensor`'s pages back: from then on the copies are these weights' only memory, and a
        weight inside `tensor` without a current copy is refused (`linear`) rather than read."""
        span = self._span(tensor)
        if span is None or self._ends[span] - self._starts[span] != tensor.numel() * tensor.element_size():
            raise ValueError("pack_and_release: the tensor is not one of the registered tensors")
        with self._lock:
            self.budget_bytes = max(self.budget_bytes, self.packed_bytes + sum(w.numel() * w.element_size()
                                                                               for w in weights))
        for weight in weights:
            if self._span(weight) != span or self.packed(weight) is None:
                raise RuntimeError(f"hf_moe_offload: a {tuple(weight.shape)} weight could not be packed for the CPU "
                                   f"kernels; its bytes are kept")
        self._released.add(span)
        release()

    def copy_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of `weight` made already and still current, or None (never packs)."""
        found = self._packed.get(_key(weight))
        return found[0] if found is not None and found[1] == _version(weight) else None

    def close(self) -> None:
        """Drop every packed copy and the registration (before the tensors are freed or written)."""
        _set_active(remove=self)
        with self._lock:
            self._packed.clear()
            self._tensors, self._starts, self._ends = [], [], []
            self._released.clear()
            self.packed_bytes = 0

    def __enter__(self) -> "PrepackedWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key(weight: torch.Tensor) -> tuple[int, int, int]:
    """What identifies a weight's packed copy: where its bytes start and its [N, K] shape."""
    return weight.data_ptr(), weight.shape[0], weight.shape[1]


def _version(weight: torch.Tensor) -> int:
    """How often `weight`'s memory was written in place; -1 for an inference tensor, which keeps no count (made
    under `torch.inference_mode`, it cannot be written outside it)."""
    return -1 if weight.is_inference() else weight._version


def _gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] bf16, weight [N, K] bf16 -> [1, N] bf16, accumulated in float32: one pass over the weight."""
    return (x[:, None, :].float() * weight[None, :, :].float()).sum(-1).to(x.dtype)


class _CompiledGemv:
    """`_gemv` compiled at its first call; off for good, with one warning, if compiling fails."""

    def __init__(self) -> None:
        self.fn = torch.compile(_gemv, dynamic=True, fullgraph=True) if os.environ.get(GEMV_ENV) == "1" else None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        if self.fn is None:
            return None
        try:
            return self.fn(x, weight)
        except Exception as err:   # inductor needs a C++ compiler at run time; anything it raises means "not here"
            self.fn = None
            logger.warning("hf_moe_offload: the compiled one-row CPU product is unavailable (%s: %s); using "
                           "oneDNN's kernels", type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            return None


_COMPILED_GEMV = _CompiledGemv()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for a bfloat16 CPU weight through the fastest kernel for its row count (module
    docstring); anything else through `F.linear` itself.

    x [..., K]; weight [N, K] -> [..., N]."""
    if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or weight.device.type != "cpu" \
            or weight.dim() != 2 or not weight.is_contiguous() or x.numel() == 0 \
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):   # training: autograd's
        _refuse_released(x, weight)
        return F.linear(x, weight)
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])                             # [T, K]
    compiled = flat.shape[0] == 1 and _COMPILED_GEMV.fn is not None and _released_owner(weight) is None
    out = _COMPILED_GEMV(flat, weight) if compiled else None                             # [1, N]
    if out is None:
        for ref in _ACTIVE:
            registration = ref()
            packed = None if registration is None else registration.packed(weight)
            if packed is not None:
                out = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), packed, None, "none", [], "")  # [T, N]
                break
        else:
            _refuse_released(x, weight)
            return F.linear(x, weight)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


def _released_owner(weight: torch.Tensor) -> PrepackedWeights | None:
    """The registration whose tensor holding `weight` was handed back, if any."""
    for ref in _ACTIVE:
        registration = ref()
        if registration is not None and registration.released(weight):
            return registration
    return None


def _refuse_released(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise where `weight`'s bytes were handed back and its copy cannot serve `x`: reading it would give zeros."""
    if weight.device.type == "cpu" and _released_owner(weight) is not None:
        raise RuntimeError(f"hf_moe_offload: this expert weight {tuple(weight.shape)} is held only as its packed "
                           f"CPU copy, which computes bfloat16 inputs without autograd; got a {x.dtype} input"
                           f"{' that requires grad' if x.requires_grad and torch.is_grad_enabled() else ''}. Run "
                           f"the model in bfloat16 under torch.no_grad(), or call hf_moe_offload.disable(model) to "
                           f"get the experts back as parameters")


class DenseLinears:
    """The model's own bias-free `nn.Linear` layers outside its offloaded experts (attention projections, routers,
    the head) through `linear` while they hold bfloat16 weights on the CPU, their weights registered for prepacked
    copies (`packed`, within `budget_bytes`). Each layer's `forward` is overridden on the instance, as accelerate's
    hooks do, so parameters, `state_dict()` and the module tree stay as they were; `remove()` (run by `disable()`)
    drops the copies and puts the class's forward back. transformers has no kernel hook for a plain linear layer
    (its hub kernels replace only layers declared for them, none of them projections), hence the override.

    Layers given as `packed_only` hold a weight that is a mapping of the checkpoint's file (`loading.mapped_dense`):
    their copies are made at once whatever the budget (the copy replaces the weight's memory rather than adding to
    it), `release(weight)` then hands the mapping's pages back, and `remove()` puts the weight back in memory from
    its copy (`in_place`).

    Example:
        >>> layers = DenseLinears.attach(model, skip=("model.layers.0.mlp.experts",))           # doctest: +SKIP
        >>> layers.remove()                                                                        # doctest: +SKIP
    """

    def __init__(self, modules: list[nn.Linear], packed: PrepackedWeights | None,
                 in_place: PrepackedWeights | None = None, packed_only: list[nn.Linear] | None = None):
        self.modules, self.packed, self.in_place = modules, packed, in_place
        self.packed_only = packed_only or []

    @staticmethod
    def eligible(model: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, nn.Linear]:
        """The layers `attach` would take, by name: every bfloat16 CPU `nn.Linear` without bias of `model` outside
        the module names `skip` whose forward is not overridden already (an accelerate hook keeps it). None where
        oneDNN has no bf16."""
        if not prepack_supported(torch.bfloat16):
            return {}
        prefixes = tuple(name + "." for name in skip)
        return {name: m for name, m in model.named_modules()
                if type(m) is nn.Linear and not (name + ".").startswith(prefixes) and m.bias is None
                and "forward" not in m.__dict__
                and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"}

    @classmethod
    def attach(cls, model: nn.Module, skip: tuple[str, ...] = (), budget_bytes: int | None = None,
               packed_only: list[nn.Linear] | None = None,
               release: Callable[[torch.Tensor], None] | None = None) -> "DenseLinears":
        """Override the forward of every layer `eligible` names. `budget_bytes`: default `prepack_budget()`, for
        the copies of the layers not in `packed_only`."""
        modules = list(cls.eligible(model, skip).values())
        if not modules:
            return cls([], None)
        own = {id(m) for m in packed_only or ()}
        packed_only = [m for m in modules if id(m) in own]
        rest = [m for m in modules if id(m) not in own]
        packed = PrepackedWeights([m.weight.detach() for m in rest],
                                  prepack_budget() if budget_bytes is None else budget_bytes)
        in_place = None
        if packed_only:
            weights = [m.weight.detach() for m in packed_only]
            in_place = PrepackedWeights(weights, sum(w.numel() * w.element_size() for w in weights))
            for weight in weights:
                in_place.packed(weight)
                if release is not None:
                    release(weight)
        for module in modules:
            module.forward = _linear_forward.__get__(module)
        return cls(modules, packed, in_place, packed_only)

    @property
    def registrations(self) -> list[PrepackedWeights]:
        """The registrations whose copies count in the stats' `prepacked_bytes`."""
        return [r for r in (self.packed, self.in_place) if r is not None]

    def remove(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
        for module in self.packed_only:       # back in memory, from the copy (the same bytes): no file read
            weight = module.weight
            copy = self.in_place.copy_of(weight.detach())
            with torch.inference_mode(False):   # a parameter the caller may train, even if disabled under it
                dense = copy.to_dense() if copy is not None else weight.detach().clone()
            module.weight = nn.Parameter(dense, requires_grad=weight.requires_grad)
        self.modules, self.packed_only = [], []
        for registration in self.registrations:
            registration.close()


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` of a layer without bias, through `linear`."""
    return linear(x, self.weight)
