"""The slab of an expert kept packed as its checkpoint stores it (GPTQ, AWQ, compressed-tensors): the store reads,
and the cache holds, the checkpoint's own bytes; the weights are dequantized where the expert computes.

A `PackedSlabLayout` has the interface of `QuantizedSlabLayout` (`numel` bytes, `parts`, `views`, `regions`,
`dequantize`): per dense part (e.g. `gate_up` [2I, H] from the checkpoint's gate and up layers), the packed tensors
of each layer that fills it, each on a 64-byte boundary of one uint8 slab. `views(slab)` gives `PackedWeight`s, whose
`linear(x)` dequantizes the part (the format's reference arithmetic, `packed_int.dequantize_into`) and calls
`F.linear`: the same numbers as the dense model built from the dequantized checkpoint.

Example:
    >>> layout = PackedSlabLayout.build(dense_layout, fmt, torch.bfloat16, pieces_of_expert_0)   # doctest: +SKIP
    >>> layout.store_pieces(pieces_of_expert_3)                  # what a DiskStore reads into a slab  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import CompressedSlabLayout, DequantizedLinear, ExpertPiece, SlabLayout, align_segment
from .checkpoint import ByteRange, CheckpointError, tensor_nbytes
from .packed_checkpoint import PackedSource
from .packed_int import CHUNK_ELEMENTS, PackedFormat, dequantize_into


@dataclass(frozen=True)
class PackedTensor:
    """One checkpoint tensor of a packed layer inside the slab."""

    name: str                       # its suffix: "qweight", "scales", "weight_packed", ...
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int                     # bytes from the slab's start

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class PackedMatrix:
    """One packed layer: rows [row, row + shape[0]) of the dense part `part`, held by `tensors`."""

    part: str
    row: int
    shape: tuple[int, int]          # dense [out, in]
    tensors: tuple[PackedTensor, ...]


@dataclass(frozen=True)
class PackedSlabLayout(CompressedSlabLayout):
    """Byte layout of one expert kept packed (uint8 slab); see the module docstring. `parts`, `dequantize` and
    `dequantize_into` as every `CompressedSlabLayout`."""

    dense: SlabLayout
    format: PackedFormat
    compute_dtype: torch.dtype
    matrices: tuple[PackedMatrix, ...]
    numel: int                      # bytes, a multiple of SEGMENT_ALIGN

    @classmethod
    def build(cls, dense: SlabLayout, fmt: PackedFormat, compute_dtype: torch.dtype,
              pieces: list[ExpertPiece]) -> "PackedSlabLayout":
        """The layout of an expert whose located pieces (`MoEArch.locate_expert` on a `PackedCheckpointIndex`) are
        `pieces`; every piece must be packed (a `PackedSource`)."""
        matrices, offset = [], 0
        for piece in pieces:
            source = _packed(piece)
            tensors = []
            for name, rng in source.tensors:
                tensors.append(PackedTensor(name, rng.dtype, tuple(rng.shape), align_segment(offset)))
                offset = tensors[-1].offset + tensors[-1].nbytes
            matrices.append(PackedMatrix(piece.part, piece.row, tuple(source.shape), tuple(tensors)))
        return cls(dense, fmt, compute_dtype, tuple(matrices), align_segment(offset))

    @property
    def dequant_workspace_bytes(self) -> int:
        """The most bytes of temporaries one expert matmul makes: the dense part in the compute dtype, plus the
        float32 temporaries of one dequantized chunk (`packed_int.CHUNK_ELEMENTS`, a few alive at once)."""
        dense = max(shape[0] * shape[1] for _, shape in self.parts) * self.compute_dtype.itemsize
        return dense + 4 * 4 * min(CHUNK_ELEMENTS, max(m.shape[0] * m.shape[1] for m in self.matrices))

    def store_pieces(self, pieces: list[ExpertPiece]) -> list[ExpertPiece]:
        """What a store reads for the expert located as `pieces`: each packed tensor's bytes into its region
        (named `regions`), as raw bytes. An expert whose tensors differ from the layout's (another shape or dtype
        than the first expert's) is a `CheckpointError` naming the tensor."""
        if len(pieces) != len(self.matrices):
            raise CheckpointError(f"an expert has {len(pieces)} packed layers where the first expert of its layer has "
                                  f"{len(self.matrices)}")
        out = []
        for i, (piece, matrix) in enumerate(zip(pieces, self.matrices)):
            source = _packed(piece)
            for (name, rng), tensor in zip(source.tensors, matrix.tensors):
                if (name, rng.dtype, tuple(rng.shape)) != (tensor.name, tensor.dtype, tensor.shape):
                    raise CheckpointError(f"{source.module}.{name} in {rng.path} is {rng.dtype} {list(rng.shape)}, "
                                          f"but the same tensor of the layer's first expert is {tensor.dtype} "
                                          f"{list(tensor.shape)}: experts of one layer must be packed alike")
                raw = ByteRange(rng.path, rng.offset, rng.nbytes, torch.uint8, (rng.nbytes,), rng.identity)
                out.append(ExpertPiece(f"{i}.{name}", 0, raw))
        return out

    def regions(self, slab: torch.Tensor) -> dict[str, torch.Tensor]:
        """The slab's byte regions, one per packed tensor (named as `store_pieces` names them)."""
        return {f"{i}.{t.name}": slab[t.offset:t.offset + t.nbytes]
                for i, m in enumerate(self.matrices) for t in m.tensors}

    def views(self, slab: torch.Tensor) -> dict[str, "PackedWeight"]:
        """Named `PackedWeight`s over a flat uint8 slab (zero-copy)."""
        by_part: dict[str, list] = {name: [] for name, _ in self.parts}
        for m in self.matrices:
            tensors = {t.name: slab[t.offset:t.offset + t.nbytes].view(t.dtype).view(t.shape) for t in m.tensors}
            by_part[m.part].append((m, tensors))
        return {name: PackedWeight(self.format, shape, by_part[name], self.compute_dtype)
                for name, shape in self.parts}


class PackedWeight(DequantizedLinear):
    """One dense part [N, K] over packed slab memory; `linear(x)` = `F.linear(x, dequantized weight)`."""

    def __init__(self, fmt: PackedFormat, shape: tuple[int, ...], matrices: list, dtype: torch.dtype):
        self.format, self.matrices, self.dtype = fmt, matrices, dtype
        self._shape = torch.Size(shape)

    @property
    def device(self) -> torch.device:
        return next(iter(self.matrices[0][1].values())).device

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight [N, K] in the compute dtype: each layer dequantized in its scales' dtype (the reference),
        then cast; written into `out` when given (contiguous, of that shape and dtype)."""
        out = torch.empty(self._shape, dtype=self.dtype, device=self.device) if out is None else out
        for matrix, tensors in self.matrices:
            dequantize_into(self.format, tensors, out[matrix.row:matrix.row + matrix.shape[0]])
        return out

    def __repr__(self) -> str:
        return (f"PackedWeight({self.format.method} {self.format.bits}-bit, shape={tuple(self._shape)}, "
                f"dtype={self.dtype}, device={self.device})")


def _packed(piece: ExpertPiece) -> PackedSource:
    if not isinstance(piece.source, PackedSource):
        raise CheckpointError(f"{piece.source.path}: part {piece.part!r} of an expert is stored dense "
                              f"({piece.source.dtype}) in a checkpoint whose experts are packed; every expert layer "
                              f"must be packed alike")
    return piece.source
