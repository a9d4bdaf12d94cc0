"""GGUF (ggml) block types and their dequantization in torch, bit for bit the `gguf` package's.

A GGUF tensor of a block type is rows of blocks: `elements` values packed into `nbytes` bytes (scales, codes).
`dequantize_rows(raw, type_id, rows, cols, dtype)` unpacks rows of such blocks into a [rows, cols] tensor. The
arithmetic follows `gguf.quants.<TYPE>.dequantize_blocks` operation by operation in float32 (fp16 scales widened
first, products and differences rounded once each, in the same order), then rounds once to `dtype`: the values of
transformers' GGUF load (`gguf.dequantize`, then a cast to the model dtype). Pure torch, so it runs wherever the
blocks are (CPU, CUDA).

Example:
    >>> import torch
    >>> block = torch.tensor([0, 60] + [1] * 32, dtype=torch.uint8)      # Q8_0: fp16 scale 0.5, 32 int8 codes
    >>> dequantize_rows(block, GGML_TYPES["Q8_0"].type_id, 1, 32, torch.float32)[0, :3].tolist()
    [0.5, 0.5, 0.5]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class BlockType:
    """One ggml type: its id in GGUF files, name, values per block and bytes per block."""

    type_id: int
    name: str
    elements: int
    nbytes: int

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` values (a whole number of blocks)."""
        return cols // self.elements * self.nbytes


_TYPES = (BlockType(0, "F32", 1, 4), BlockType(1, "F16", 1, 2), BlockType(30, "BF16", 1, 2),
          BlockType(2, "Q4_0", 32, 18), BlockType(3, "Q4_1", 32, 20), BlockType(6, "Q5_0", 32, 22),
          BlockType(7, "Q5_1", 32, 24), BlockType(8, "Q8_0", 32, 34), BlockType(10, "Q2_K", 256, 84),
          BlockType(11, "Q3_K", 256, 110), BlockType(12, "Q4_K", 256, 144), BlockType(13, "Q5_K", 256, 176),
          BlockType(14, "Q6_K", 256, 210))
# The types experts may be stored in (others, e.g. IQ*, TQ*, MXFP4, are refused by name).
GGML_TYPES = {t.name: t for t in _TYPES}
GGML_TYPES_BY_ID = {t.type_id: t for t in _TYPES}


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of each block, widened to float32: [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _shifted(data: torch.Tensor, shifts: tuple[int, ...], width: int) -> torch.Tensor:
    """numpy's `data.reshape(n, -1, 1, width) >> shifts.reshape(1, 1, -1, 1)`: [n, groups, len(shifts), width]."""
    shift = torch.tensor(shifts, dtype=torch.uint8, device=data.device).view(1, 1, -1, 1)
    return data.reshape(data.shape[0], -1, 1, width) >> shift


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = (_shifted(b[:, 2:18], (0, 4), 16) & 0x0F).reshape(b.shape[0], -1).to(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = (_shifted(b[:, 4:20], (0, 4), 16) & 0x0F).reshape(b.shape[0], -1).float()
    return (_f16(b, 0) * q) + _f16(b, 2)


def _fifth_bits(b: torch.Tensor, start: int) -> torch.Tensor:
    """The 32 high bits of Q5_0/Q5_1 (a little-endian uint32 at `start`), bit i for value i: [n, 32] uint8."""
    qh = b[:, start:start + 4].to(torch.int64)
    word = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
    shifts = torch.arange(32, dtype=torch.int64, device=b.device)
    return ((word[:, None] >> shifts) & 1).to(torch.uint8)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    low = (_shifted(b[:, 6:22], (0, 4), 16) & 0x0F).reshape(b.shape[0], -1)
    q = (low | (_fifth_bits(b, 2) << 4)).to(torch.int8) - 16
    return _f16(b, 0) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    low = (_shifted(b[:, 8:24], (0, 4), 16) & 0x0F).reshape(b.shape[0], -1)
    q = (low | (_fifth_bits(b, 4) << 4)).float()
    return (_f16(b, 0) * q) + _f16(b, 2)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 0:16]
    dl = (_f16(b, 80) * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = (_shifted(b[:, 16:80], (0, 2, 4, 6), 32) & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = (_shifted(b[:, 96:104], (0, 4), 8)).reshape(n, 16)
    high = (_shifted(b[:, 104:108], (0, 2, 4, 6), 4)).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (_f16(b, 108) * scales.float()).reshape(n, 16, 1)
    ql = _shifted(b[:, 32:96], (0, 2, 4, 6), 32).reshape(n, 16, 16) & 3
    qh = (_shifted(b[:, 0:32], tuple(range(8)), 32).reshape(n, 16, 16) & 1) ^ 1   # offset 4 where the bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in Q4_K/Q5_K's 12 bytes (`gguf.quants.Q4_K.get_scale_min`)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc).reshape(n, -1, 1)
    dm = (_f16(b, 2) * mn).reshape(n, -1, 1)
    q = (_shifted(b[:, 16:144], (0, 4), 32) & 0x0F).reshape(n, -1, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc).reshape(n, -1, 1)
    dm = (_f16(b, 2) * mn).reshape(n, -1, 1)
    ql = (_shifted(b[:, 48:176], (0, 4), 32) & 0x0F).reshape(n, -1, 32)
    qh = (_shifted(b[:, 16:48], tuple(range(8)), 32) & 1).reshape(n, -1, 32)
    q = (ql | (qh << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    ql = (_shifted(b[:, 0:128], (0, 4), 64) & 0x0F).reshape(n, -1, 32)
    qh = (_shifted(b[:, 128:192], (0, 2, 4, 6), 32) & 0x03).reshape(n, -1, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, -1).float()
    return (d * q).reshape(n, 256)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _half(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()      # a 16-bit shift: exact, as gguf's int32 << 16


_DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _f32, "F16": _half, "BF16": _bf16, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q8_0": _q8_0, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def dequantize_rows(raw: torch.Tensor, type_id: int, rows: int, cols: int, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """`rows` rows of `cols` values stored as ggml type `type_id` in the uint8 tensor `raw` (rows x row bytes,
    contiguous) -> [rows, cols] in `dtype` (written into `out` when given): float32 values as `gguf` computes them,
    rounded once to `dtype`.

    Example:
        >>> dequantize_rows(torch.tensor([0, 60] * 2, dtype=torch.uint8), 1, 2, 1, torch.float32).tolist()
        [[1.0], [1.0]]
    """
    kind = GGML_TYPES_BY_ID.get(type_id)
    if kind is None:
        raise ValueError(f"ggml type {type_id} cannot be dequantized here; supported: {supported_names()}")
    blocks = raw.reshape(-1, kind.nbytes)
    values = _DEQUANTIZE[kind.name](blocks).reshape(rows, cols)
    if out is None:
        return values.to(dtype)
    return out.copy_(values)


def supported_names() -> str:
    """The block types experts may be stored in, for messages."""
    return ", ".join(t.name for t in _TYPES)
