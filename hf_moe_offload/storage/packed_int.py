"""Integer weights packed into int32 words, as GPTQ, AWQ and compressed-tensors ("pack-quantized") checkpoints store
them: what each format's tensors are, their shapes, and the dequantization each format's reference code performs.

Per linear layer of `out` x `in` weights (`pack` = 32 / bits values per int32 word, value j of a word in bits
[j * bits, (j + 1) * bits)):

| format | codes | zeros | scales | group of input k |
|---|---|---|---|---|
| GPTQ | `qweight` [in / pack, out], packed along in | `qzeros` [G, out / pack] (v1: stored minus 1) | `scales` [G, out] | `g_idx[k]` (act-order), else k // group |
| AWQ (GEMM) | `qweight` [in, out / pack], packed along out, word order 0 2 4 6 1 3 5 7 | `qzeros` [G, out / pack], same order | `scales` [G, out] | k // group |
| compressed-tensors | `weight_packed` [out, in / pack], codes + 2^(bits-1) | `weight_zero_point` int32 [out / pack, G] packed along out, or int8 [out, G] (asymmetric only) | `weight_scale` [out, G] | k // group |

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

import functools
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .checkpoint import CheckpointError

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


CHUNK_ELEMENTS = 1 << 21          # dequantized this many weights at a time: float32 temporaries stay small


def dequantize(fmt: PackedFormat, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The dense [out, in] weight of one packed linear layer in its scales' dtype (`tensors` by the names of
    `fmt.tensor_names()`, on any device): what the format's reference dequantization gives.

    Example:
        >>> fmt = PackedFormat("compressed-tensors", bits=4, group_size=8, symmetric=True)
        >>> codes = torch.tensor([[0x89ABCDEF - (1 << 32)]], dtype=torch.int32)   # q + 8: 15, 14, ..., 8
        >>> dequantize(fmt, {"weight_packed": codes, "weight_scale": torch.tensor([[0.5]])}, (1, 8)).tolist()
        [[3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0]]
    """
    scales = tensors["weight_scale" if fmt.method == "compressed-tensors" else "scales"]
    out = torch.empty(shape, dtype=scales.dtype, device=scales.device)
    dequantize_into(fmt, tensors, out)
    return out


def dequantize_into(fmt: PackedFormat, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """Write the dense weight of one packed linear layer into `out` [out, in] (any float dtype): the reference
    dequantization in the scales' dtype, then cast to `out.dtype`, `CHUNK_ELEMENTS` weights at a time.

    Every format computes (q - z) * s per weight with q, z small integers (exact in float32) and s a float: the
    float32 product is exact too, so rounding it once to the scales' dtype gives the bits of the formats' own
    arithmetic in that dtype."""
    if fmt.method == "awq":
        _awq_into(fmt, tensors, out)
        return
    out_features, in_features = out.shape
    if fmt.method == "gptq":
        codes = tensors["qweight"].T                                           # [out, in / pack] words
        zeros = unpack_int32(tensors["qzeros"], fmt.bits, dim=1)[:, :out_features].T.float() + fmt.zero_offset
        scales = tensors["scales"].T                                           # [out, G]
    else:
        codes, scales = tensors["weight_packed"], tensors["weight_scale"]
        offset = 1 << (fmt.bits - 1)                   # codes stored unsigned: q + 2^(bits-1)
        zeros = torch.full(scales.shape, float(offset), device=scales.device)
        if "weight_zero_point" in tensors:             # (q_stored - offset) - zp = q_stored - (zp + offset)
            zp = tensors["weight_zero_point"]
            zeros += zp.float() if zp.dtype == torch.int8 else \
                unpack_int32(zp, fmt.bits, dim=0)[:out_features].float() - offset
    groups = _group_of_inputs(fmt, tensors, in_features, scales.device, scales.shape[1])
    step = max(1, CHUNK_ELEMENTS // max(in_features, 1))
    for start in range(0, out_features, step):
        rows = slice(start, min(start + step, out_features))
        q = _float_codes(codes[rows].contiguous(), fmt.bits)[:, :in_features]    # [chunk, in] float32
        _scale_into(q, zeros[rows], scales[rows], groups, out[rows])


def _awq_into(fmt: PackedFormat, t: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """AWQ: codes [in, out / pack] and zeros [G, out / pack] packed along out in AWQ's word order; computed per
    chunk of inputs as [in, out] (the words' orientation) and written transposed."""
    out_features, in_features = out.shape
    scales, device = t["scales"], t["scales"].device
    order = torch.tensor(AWQ_REVERSE_ORDER, device=device)
    columns = (torch.arange(out_features, device=device).view(-1, fmt.pack)[:, order]).reshape(-1)
    zeros = unpack_int32(t["qzeros"], fmt.bits, dim=1)[:, columns].float()                # [G, out]
    size = in_features if fmt.group_size == -1 else fmt.group_size
    step = max(size, CHUNK_ELEMENTS // max(out_features, 1) // size * size)               # whole groups
    for start in range(0, in_features, step):
        stop = min(start + step, in_features)
        q = _float_codes(t["qweight"][start:stop], fmt.bits)[:, columns]                  # [chunk, out]
        g = slice(start // size, -(-stop // size))
        grouped = q.view(-1, size, out_features) if (stop - start) % size == 0 else None
        if grouped is None:
            index = torch.arange(start, stop, device=device) // size
            q.sub_(zeros[index]).mul_(scales[index].float())
        else:
            grouped.sub_(zeros[g, None]).mul_(scales[g, None].float())
        out[:, start:stop].copy_(q.to(scales.dtype).T)


def _group_of_inputs(fmt: PackedFormat, tensors: dict[str, torch.Tensor], in_features: int, device,
                     num_groups: int) -> torch.Tensor | int:
    """The group of every input: `g_idx` (GPTQ act-order) or k // group_size as an index tensor, or the group size
    itself when the groups are whole and in order (then scales broadcast over them, no gather)."""
    if "g_idx" in tensors:
        groups = tensors["g_idx"].long()
        if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= num_groups):
            raise CheckpointError(f"a GPTQ g_idx names group {int(groups.min())}..{int(groups.max())}, and its "
                                  f"scales have {num_groups} groups: the checkpoint is damaged")
        return groups
    size = in_features if fmt.group_size == -1 else fmt.group_size
    if in_features % size == 0:
        return size
    return torch.arange(in_features, device=device) // size


def _scale_into(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor | int,
                out: torch.Tensor) -> None:
    """out = ((q - zeros) * scales) rounded to the scales' dtype, then to out's; q [n, in] float32 (overwritten),
    zeros and scales [n, G]."""
    if isinstance(groups, int):
        grouped = q.view(q.shape[0], -1, groups)
        grouped.sub_(zeros[:, :, None]).mul_(scales[:, :, None].float())
    else:
        q.sub_(zeros[:, groups]).mul_(scales[:, groups].float())
    out.copy_(q if out.dtype == scales.dtype else q.to(scales.dtype))


def _float_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [R, C] -> their values as float32 [R, C * pack], value j of a word at column pack * c + j
    (`unpack_int32` along dim 1): each byte looked up in a table of its two nibbles, one pass."""
    rows, cols = words.shape
    raw = words.contiguous().reshape(-1).view(torch.uint8).view(rows, cols, 4)
    if sys.byteorder == "big":
        raw = raw.flip(-1)
    if bits == 8:
        return raw.reshape(rows, cols * 4).float()
    return F.embedding(raw.reshape(rows, cols * 4).long(), _nibble_table(words.device)).view(rows, cols * 8)


@functools.lru_cache(maxsize=None)
def _nibble_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: a byte's low and high nibble."""
    byte = torch.arange(256)
    return torch.stack((byte & 15, byte >> 4), dim=1).float().to(device)
