"""The shapes the engine's parts share, with no knowledge of models or of the engine: how an expert's tensors pack
into one flat slab (`SlabLayout`; what the layouts of experts kept compressed as their checkpoint stores them share,
`CompressedSlabLayout` and `DequantizedLinear`), where its bytes are in a checkpoint (`ExpertPiece`), one MoE layer
of a built model (`MoELayer`), and how expert parameters are released from a module and given back.

Example:
    >>> import torch
    >>> layout = SlabLayout(parts=(("up", (4, 2)), ("down", (2, 4))))
    >>> {name: tuple(v.shape) for name, v in layout.views(torch.zeros(layout.numel)).items()}
    {'up': (4, 2), 'down': (2, 4)}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .storage.checkpoint import BlockScales, ByteRange

# One expert's tensors by slab part name, read from a built experts module (`MoEArch.expert_tensors`).
ExpertTensors = Callable[[nn.Module, int], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class SlabLayout:
    """How one expert's tensors sit in its contiguous slab: (name, shape) parts, back to back."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        return sum(_numel(shape) for _, shape in self.parts)

    def views(self, slab: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into a flat slab (zero-copy)."""
        out, start = {}, 0
        for name, shape in self.parts:
            n = _numel(shape)
            out[name] = slab[start:start + n].view(shape)
            start += n
        return out

    def stacked_views(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views over every row of `slots` [S, >= numel] at once: part `name` as [S, *shape] (zero-copy;
        rows S apart by the slot stride), the layout of transformers' stacked expert parameters."""
        out, start = {}, 0
        for name, shape in self.parts:
            n = _numel(shape)
            out[name] = slots[:, start:start + n].view(slots.shape[0], *shape)
            start += n
        return out


SEGMENT_ALIGN = 64         # bytes: each tensor of a compressed slab starts on a cache line (and its dtype's alignment)


def align_segment(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of `SEGMENT_ALIGN`.

    Example:
        >>> align_segment(1), align_segment(64), align_segment(65)
        (64, 64, 128)
    """
    return -(-nbytes // SEGMENT_ALIGN) * SEGMENT_ALIGN


class CompressedSlabLayout:
    """What the slab layouts of experts kept compressed as their checkpoint stores them (GGUF blocks, GPTQ / AWQ /
    compressed-tensors packing) share: a dense `SlabLayout` (attribute `dense`) they stand for, and `views(slab)`
    giving one weight per dense part whose `dequantize(out=None)` returns (or writes) that part in the compute
    dtype. A subclass is a frozen dataclass with a `dense` field and defines `views`."""

    dense: SlabLayout                      # annotation only: no dataclass field here, the subclass declares it

    @property
    def parts(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The dense parts (name, [N, K]) this slab stands for."""
        return self.dense.parts

    def views(self, slab: torch.Tensor) -> dict:
        """Named weights (one per dense part) over a flat uint8 slab, zero-copy."""
        raise NotImplementedError

    def dequantize(self, slab: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dense parts [N, K] in the compute dtype: the checkpoint's dequantized weights."""
        return {name: w.dequantize() for name, w in self.views(slab).items()}

    def dequantize_into(self, slab: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """Write the dense parts into `out` (part name -> [N, K] tensor of the compute dtype): the values of
        `dequantize`, without a temporary per part."""
        for name, w in self.views(slab).items():
            w.dequantize(out=out[name])


class DequantizedLinear:
    """What the weights of a `CompressedSlabLayout` share: `linear(x)` is `F.linear` with the dequantized weight
    (`dequantize()`, in the weight's `dtype`)."""

    dtype: torch.dtype

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight [N, K] in `dtype`, written into `out` when given."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N], as the dense weight computes it."""
        return torch.nn.functional.linear(x.to(self.dtype), self.dequantize())


@dataclass(frozen=True)
class ExpertPiece:
    """A checkpoint byte range that fills rows [row, row + n) of one slab part; with `scales`, `source` is a
    fine-grained FP8 matrix dequantized by them on the way into the slab (the slab itself stays dense); with
    `interleaved`, its rows alternate (gate 0, up 0, gate 1, ...) and are put gate rows first as they are read."""

    part: str
    row: int
    source: ByteRange
    scales: BlockScales | None = None
    interleaved: bool = False


@dataclass
class MoELayer:
    """One MoE layer of a built model: its experts module and where that module sits."""

    index: int                     # position among the model's MoE layers
    name: str                      # module path of the experts module, e.g. "model.layers.3.mlp.experts"
    module: nn.Module
    num_experts: int
    top_k: int
    layout: SlabLayout
    extra: dict = field(default_factory=dict)


def alignment_offset(t: torch.Tensor) -> int:
    """Where a CPU tensor starts within a 64-byte line. CPU matmul kernels pick their path by alignment, so a
    restored parameter must start at the same offset to give bit-identical outputs (mmap'd weights often don't)."""
    return t.data_ptr() % 64 if t.device.type == "cpu" else 0   # meta tensors: no address, offset 0


def empty_at_alignment(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, offset: int
                       ) -> torch.Tensor:
    """`torch.empty`, starting `offset` bytes past a 64-byte boundary (CPU only; elsewhere plain `empty`)."""
    if device.type != "cpu" or offset == 0 or offset % dtype.itemsize:
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = _numel(shape) * dtype.itemsize
    buf = torch.empty(nbytes + 64, dtype=torch.uint8)
    start = (offset - buf.data_ptr()) % 64
    return buf[start:start + nbytes].view(dtype).view(shape)


RELEASED_ATTR = "_hf_moe_offload_released"


def release_parameter(module: nn.Module, name: str, key=None) -> None:
    """Drop a parameter's memory: it becomes None (skipped by `.to()`, `state_dict()`, `parameters()`), and what
    is needed to give it back (shape, dtype, requires_grad, alignment) is remembered on the module."""
    p = getattr(module, name)
    released = module.__dict__.setdefault(RELEASED_ATTR, {})
    if p is not None:
        released[key or name] = (tuple(p.shape), p.dtype, p.requires_grad, alignment_offset(p))
    module.register_parameter(name, None)


def restore_parameter(module: nn.Module, name: str, value: torch.Tensor, key=None) -> None:
    """Give back a parameter released by `release_parameter`, with `value`'s contents, at its old alignment."""
    _, _, requires_grad, offset = module.__dict__[RELEASED_ATTR].pop(key or name)
    weight = empty_at_alignment(tuple(value.shape), value.dtype, value.device, offset).copy_(value)
    module.register_parameter(name, nn.Parameter(weight, requires_grad=requires_grad))
    if not module.__dict__[RELEASED_ATTR]:
        del module.__dict__[RELEASED_ATTR]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
