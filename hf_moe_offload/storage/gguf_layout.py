"""Experts kept in their GGUF blocks: the byte layout of one expert's slab (`GGUFSlabLayout`) and the weights the
experts forward computes with (`GGUFWeight`).

A slab holds, for each dense part of the model's experts (e.g. `gate_up` [2I, H], `down` [H, I]), the GGUF blocks
of its rows: `gate_up` is the gate tensor's rows then the up tensor's (each may have its own block type, as in
Q4_K_M files), each segment starting on a 64-byte boundary. The store reads a segment straight from the file into
its place, the cache holds the slab as it is, and a weight is dequantized (`gguf_blocks`, bit for bit the `gguf`
package's values, rounded once to the model dtype) when its expert computes. Same interface as
`QuantizedSlabLayout`: `numel` (bytes), `parts`, `views`, `regions`, `dequantize`.

Example:
    >>> import torch
    >>> from hf_moe_offload.layout import SlabLayout
    >>> from hf_moe_offload.storage.gguf_blocks import GGML_TYPES
    >>> dense = SlabLayout(parts=(("down", (4, 32)),))
    >>> layout = GGUFSlabLayout.build(dense, {"down": [("down", GGML_TYPES["Q8_0"])]}, torch.float32)
    >>> layout.numel, layout.segments[0].nbytes             # 4 rows of one 34-byte block, padded to 64
    (192, 136)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import CompressedSlabLayout, DequantizedLinear, SlabLayout, align_segment
from .gguf_blocks import BlockType, dequantize_rows


@dataclass(frozen=True)
class GGUFSegment:
    """Rows [row, row + rows) of dense part `part` ([N, cols]), stored as `kind` blocks at `offset` in the slab;
    `key` names the GGUF tensor they come from ("gate", "up", "down")."""

    part: str
    key: str
    row: int
    rows: int
    cols: int
    kind: BlockType
    offset: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.kind.row_bytes(self.cols)


@dataclass(frozen=True)
class GGUFSlabLayout(CompressedSlabLayout):
    """Byte layout of one expert kept in GGUF blocks (a uint8 slab of `numel` bytes); `parts`, `dequantize` and
    `dequantize_into` as every `CompressedSlabLayout`."""

    dense: SlabLayout
    compute_dtype: torch.dtype
    segments: tuple[GGUFSegment, ...]
    numel: int

    @classmethod
    def build(cls, dense: SlabLayout, sources: dict[str, list[tuple[str, BlockType]]],
              compute_dtype: torch.dtype) -> "GGUFSlabLayout":
        """The layout of `dense` whose part `p` is made of the GGUF tensors `sources[p]` ((key, block type), each
        an equal share of the part's rows, in order: `gate_up` <- [("gate", Q4_K), ("up", Q4_K)])."""
        segments, offset = [], 0
        for part, (rows, cols) in dense.parts:
            share = rows // len(sources[part])
            for i, (key, kind) in enumerate(sources[part]):
                segment = GGUFSegment(part, key, i * share, share, cols, kind, align_segment(offset))
                segments.append(segment)
                offset = segment.offset + segment.nbytes
        return cls(dense, compute_dtype, tuple(segments), align_segment(offset))

    @property
    def block_types(self) -> dict[str, str]:
        """{GGUF tensor key: block type name}, e.g. {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}."""
        return {s.key: s.kind.name for s in self.segments}

    @property
    def dequant_workspace_bytes(self) -> int:
        """The most bytes one matmul's dequantized weight takes (float32 values, then the compute dtype)."""
        return max(rows * cols * (4 + self.compute_dtype.itemsize) for _, (rows, cols) in self.dense.parts)

    def regions(self, slab: torch.Tensor) -> dict[str, torch.Tensor]:
        """{GGUF tensor key: its raw bytes in `slab`}: where a store reads each expert range to."""
        return {s.key: slab[s.offset:s.offset + s.nbytes] for s in self.segments}

    def views(self, slab: torch.Tensor) -> dict[str, "GGUFWeight"]:
        """Named `GGUFWeight`s over a flat uint8 slab (zero-copy)."""
        return {name: GGUFWeight(shape, [(s, slab[s.offset:s.offset + s.nbytes]) for s in self.segments
                                         if s.part == name], self.compute_dtype)
                for name, shape in self.dense.parts}


class GGUFWeight(DequantizedLinear):
    """A dense part [N, K] over GGUF blocks in slab memory; `linear(x)` = `F.linear(x, dequantized weight)`."""

    def __init__(self, shape: tuple[int, int], segments: list[tuple[GGUFSegment, torch.Tensor]],
                 dtype: torch.dtype):
        self.segments, self.dtype = segments, dtype
        self.shape = torch.Size(shape)

    @property
    def device(self) -> torch.device:
        return self.segments[0][1].device

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight [N, K] in the compute dtype (each segment's rows dequantized into their place), written
        into `out` when given (contiguous, of that shape and dtype)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device) if out is None else out
        for s, raw in self.segments:
            dequantize_rows(raw, s.kind.type_id, s.rows, s.cols, self.dtype, out=out[s.row:s.row + s.rows])
        return out

    def __repr__(self) -> str:
        types = "+".join(s.kind.name for s, _ in self.segments)
        return f"GGUFWeight({types}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"
