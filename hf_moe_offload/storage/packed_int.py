"""Integer weights packed into int32 words, as GPTQ, AWQ and compressed-tensors ("pack-quantized") checkpoints store
them: what each format's tensors are, their shapes, and the dequantization each format's reference code performs.

Per linear layer of `out` x `in` weights (`pack` = 32 / bits values per int32 word, value j of a word in bits
[j * bits, (j + 1) * bits)):

| format | codes | zeros | scales | group of input k |
|---|---|---|---|---|
| GPTQ | `qweight` [in / pack, out], packed along in | `qzeros` [G, out / pack] (v1: stored minus 1) | `scales` [G, out] | `g_idx[k]` (act-order), else k // group |
| AWQ (GEMM) | `qweight` [in, out / pack], packed along out, word order 0 2 4 6 1 3 5 7 | `qzeros` [G, out / pack], same order | `scales` [G, out] | k // group |
| compressed-tensors | `weight_packed` [out, in / pack], codes + 2^(bits-1) | `weight_zero_point` [out / pack, G] packed along out (asymmetric only) | `weight_scale` [out, G] | k // group |

Every format dequantizes as `(q - z) * s` in the scales' dtype, one rounding (q and z are small integers, exact in any
float dtype). `dequantize` computes the exact product in float32 and rounds once to the scales' dtype, which gives the
same bits as the formats' own reference code (AutoGPTQ/GPTQModel's torch kernel, AutoAWQ's `dequantize_gemm`,
compressed-tensors' `PackedQuantizationCompressor.decompress`); the tests compare them bit for bit.

Example:
    >>> fmt = PackedFormat("gptq", bits=4, group_size=4, zero_offset=1)
    >>> fmt.tensor_shapes(out_features=8, in_features=8)["qweight"]
    (1, 8)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

# The word order AWQ's GEMM packer writes (output column 8c + AWQ_ORDER[j] in value j of word c), and its inverse.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
FORMATS = ("gptq", "awq", "compressed-tensors")


@dataclass(frozen=True)
class PackedFormat:
    """How one checkpoint packs its integer weights.

    `method`: "gptq" | "awq" | "compressed-tensors"; `bits`: 4 or 8 (AWQ: 4); `group_size`: input weights per scale
    (-1: one group over the whole input, per output channel); `zero_offset`: added to stored zeros (GPTQ v1 stores
    zero - 1); `symmetric`: compressed-tensors without stored zeros (zero 0); `act_order`: GPTQ whose `g_idx` (the
    group of each input, unsorted with act-order) is read; the weight is dequantized through it, so the input needs
    no permutation."""

    method: str
    bits: int
    group_size: int
    zero_offset: int = 0
    symmetric: bool = False
    act_order: bool = False

    @property
    def pack(self) -> int:
        return 32 // self.bits

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def tensor_names(self) -> tuple[str, ...]:
        """The checkpoint tensors of one packed linear layer (suffixes after `<module>.`), codes first."""
        if self.method == "compressed-tensors":
            return ("weight_packed", "weight_scale") + (() if self.symmetric else ("weight_zero_point",))
        return ("qweight", "qzeros", "scales") + (("g_idx",) if self.act_order else ())

    def tensor_shapes(self, out_features: int, in_features: int) -> dict[str, tuple[int, ...]]:
        """The shape each of `tensor_names()` has for an [out, in] layer."""
        g, p = self.groups(in_features), self.pack
        if self.method == "compressed-tensors":
            shapes = {"weight_packed": (out_features, -(-in_features // p)), "weight_scale": (out_features, g)}
            if not self.symmetric:
                shapes["weight_zero_point"] = (-(-out_features // p), g)
            return shapes
        codes = (in_features // p, out_features) if self.method == "gptq" else (in_features, out_features // p)
        shapes = {"qweight": codes, "qzeros": (g, out_features // p), "scales": (g, out_features)}
        if self.act_order:
            shapes["g_idx"] = (in_features,)
        return shapes

    def dense_shape(self, tensors: dict[str, tuple[int, ...]]) -> tuple[int, int] | None:
        """[out, in] of a layer from its tensors' shapes (None when the codes are not there). compressed-tensors'
        input width is only known to a word (`weight_shape` holds it exactly)."""
        codes = tensors.get("weight_packed" if self.method == "compressed-tensors" else "qweight")
        if codes is None or len(codes) != 2:
            return None
        if self.method == "gptq":
            return codes[1], codes[0] * self.pack
        if self.method == "awq":
            return codes[1] * self.pack, codes[0]
        return codes[0], codes[1] * self.pack


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words [R, C] -> their `32 / bits` unsigned values each (uint8), value j of a word at position
    pack * i + j along `dim` (0 or 1), which grows by that factor. Read through the words' bytes (4 and 8 bits never
    straddle one), low byte first whatever the host's byte order.

    Example:
        >>> unpack_int32(torch.tensor([[0x76543210]], dtype=torch.int32), 4, dim=1).tolist()
        [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    if bits not in (4, 8):
        raise ValueError(f"packed weights of {bits} bits are not read; supported: 4, 8")
    rows, cols = words.shape
    raw = words.contiguous().reshape(-1).view(torch.uint8).view(rows, cols, 4)
    if sys.byteorder == "big":
        raw = raw.flip(-1)
    values = torch.stack((raw & 15, raw >> 4), dim=-1).view(rows, cols, 8) if bits == 4 else raw   # [R, C, pack]
    if dim == 1:
        return values.reshape(rows, cols * values.shape[-1])
    return values.permute(0, 2, 1).reshape(rows * values.shape[-1], cols)


CHUNK_ELEMENTS = 1 << 22          # dequantized this many weights at a time: float32 temporaries stay small


def dequantize(fmt: PackedFormat, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The dense [out, in] weight of one packed linear layer in its scales' dtype (`tensors` by the names of
    `fmt.tensor_names()`, on any device): what the format's reference dequantization gives.

    Example:
        >>> fmt = PackedFormat("compressed-tensors", bits=4, group_size=8, symmetric=True)
        >>> codes = torch.tensor([[0x89ABCDEF - (1 << 32)]], dtype=torch.int32)   # q + 8: 15, 14, ..., 8
        >>> dequantize(fmt, {"weight_packed": codes, "weight_scale": torch.tensor([[0.5]])}, (1, 8)).tolist()
        [[3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0]]
    """
    out = torch.empty(shape, dtype=_scales(fmt, tensors).dtype, device=_scales(fmt, tensors).device)
    dequantize_into(fmt, tensors, out)
    return out


def dequantize_into(fmt: PackedFormat, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """Write the dense weight of one packed linear layer into `out` [out, in] (any float dtype): the reference
    dequantization in the scales' dtype, then cast to `out.dtype`, a chunk of `CHUNK_ELEMENTS` at a time."""
    if fmt.method == "compressed-tensors":
        _compressed_into(fmt, tensors, out)
    else:
        _gptq_awq_into(fmt, tensors, out)


def _scales(fmt: PackedFormat, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return tensors["weight_scale" if fmt.method == "compressed-tensors" else "scales"]


def _scaled(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q - zeros) * scales, exact in float32 (small integers times a float of at most 24 bits), rounded once to
    the scales' dtype: the formats' own arithmetic in that dtype gives these bits."""
    return ((q.to(torch.float32) - zeros) * scales.to(torch.float32)).to(scales.dtype)


def _groups(fmt: PackedFormat, tensors: dict[str, torch.Tensor], start: int, stop: int, device) -> torch.Tensor:
    """The group of inputs [start, stop): `g_idx` (GPTQ act-order), else k // group_size."""
    if "g_idx" in tensors:
        return tensors["g_idx"][start:stop].long()
    if fmt.group_size == -1:
        return torch.zeros(stop - start, dtype=torch.long, device=device)
    return torch.arange(start, stop, device=device) // fmt.group_size


def _gptq_awq_into(fmt: PackedFormat, t: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """GPTQ: codes [in / pack, out] along in; AWQ: codes [in, out / pack] along out in AWQ's word order. Zeros
    [G, out / pack] along out (AWQ order for AWQ), plus `zero_offset`."""
    out_features, in_features = out.shape
    scales, device = t["scales"], t["scales"].device
    zeros = unpack_int32(t["qzeros"], fmt.bits, dim=1)[:, :out_features]                  # [G, out]
    columns = None
    if fmt.method == "awq":
        order = torch.tensor(AWQ_REVERSE_ORDER, device=device)
        columns = (torch.arange(out_features, device=device).view(-1, fmt.pack)[:, order]).reshape(-1)
        zeros = zeros[:, columns]
    zeros = zeros.to(torch.float32) + fmt.zero_offset
    step = max(fmt.pack, CHUNK_ELEMENTS // max(out_features, 1) // fmt.pack * fmt.pack)
    for start in range(0, in_features, step):
        stop = min(start + step, in_features)
        if fmt.method == "gptq":
            q = unpack_int32(t["qweight"][start // fmt.pack:-(-stop // fmt.pack)], fmt.bits, dim=0)[:stop - start]
        else:
            q = unpack_int32(t["qweight"][start:stop], fmt.bits, dim=1)[:, columns]          # [chunk, out]
        group = _groups(fmt, t, start, stop, device)
        out[:, start:stop].copy_(_scaled(q, zeros[group], scales[group]).T)


def _compressed_into(fmt: PackedFormat, t: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """compressed-tensors: codes [out, in / pack] along in, stored + 2^(bits-1); zeros [out / pack, G] along out
    (int8 [out, G] in older checkpoints), absent when symmetric."""
    out_features, in_features = out.shape
    offset = 1 << (fmt.bits - 1)
    scales, device = t["weight_scale"], t["weight_scale"].device
    zeros = torch.zeros(out_features, scales.shape[1], device=device)
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        zeros = zp.to(torch.float32) if zp.dtype == torch.int8 else \
            unpack_int32(zp, fmt.bits, dim=0)[:out_features].to(torch.float32) - offset
    zeros = zeros + offset                             # (q_stored - offset) - zp = q_stored - (zp + offset)
    group = _groups(fmt, t, 0, in_features, device)
    step = max(1, CHUNK_ELEMENTS // max(in_features, 1))
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        q = unpack_int32(t["weight_packed"][start:stop], fmt.bits, dim=1)[:, :in_features]  # [chunk, in]
        out[start:stop].copy_(_scaled(q, zeros[start:stop][:, group], scales[start:stop][:, group]))
