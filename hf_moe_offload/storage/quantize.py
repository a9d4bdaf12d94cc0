"""Quantized experts (opt-in, approximate): stored, moved and cached as int8 or int4, computed where they run.

- int8: one scale per output channel; w ~= q * scale, q in [-128, 127].
- int4: one scale and zero per group of `group_size` input weights (gpt-fast's / torch's convention):
  w ~= (q - 8) * scale + zero, q in [0, 15]. An input dim that is not a multiple of the group is zero-padded.

A `QuantizedSlabLayout` is the byte layout of one quantized expert: for each dense part (name, [N, K]) its quantized
data and then its scales, each starting on a 64-byte boundary, back to back in one uint8 slab. `views(slab)` gives
`QuantizedWeight`s, which the experts forward calls through `weight.linear(x)` (see `execute.expert_linear`).

Rounding bound (tested): |w - dequantize(q)| <= scale / 2 per row (int8) or per group (int4), up to the rounding of
the stored scale/zero in the model dtype.

Where they compute: on the CPU, torch's own kernels (`torch._weight_int8pack_mm`, and
`torch._weight_int4pack_mm_for_cpu` on weights repacked by `torch._convert_weight_to_int4pack_for_cpu`); elsewhere
(CUDA, or with `fast_kernels(False)`) a generic path that dequantizes and calls `F.linear`. Files and host copies
for another device hold the device-neutral "plain" format (two 4-bit values per byte, even input index in the low
nibble). torch's CPU int4 format depends on the CPU's vector width: a quantized folder made for the CPU holds it
as this machine makes it (`packing_signature` is part of the folder's fingerprint), so reads need no repacking.
torch's own ops rather than torchao/hqq: no dependency, and their CPU path is what those libraries call anyway.

Example:
    >>> import torch
    >>> from hf_moe_offload.layout import SlabLayout
    >>> dense = SlabLayout(parts=(("up", (32, 64)),))
    >>> q = QuantizedSlabLayout.build(dense, "int4", 32, torch.float32)
    >>> w = torch.randn(32, 64)
    >>> slab = torch.empty(q.numel, dtype=torch.uint8)
    >>> q.quantize_into({"up": w}, slab)
    >>> bool((q.dequantize(slab)["up"] - w).abs().max() < 0.5)
    True
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layout import SlabLayout
from ..policy.offload_policy import PolicyError

METHODS = ("int8", "int4")
ALIGN = 64                 # every region starts on a cache line (scales are viewed as the model dtype)
INT4_KERNEL_GROUPS = (32, 64, 128, 256)
INT4_KERNEL_N_MULTIPLE = 16

_fast = threading.local()


def fast_kernels_enabled() -> bool:
    """Whether torch's CPU int8/int4 kernels are used where they apply (default True)."""
    return getattr(_fast, "enabled", True)


@contextlib.contextmanager
def fast_kernels(enabled: bool):
    """Force (False) the generic dequantize-then-`F.linear` path in this thread, e.g. to compare the two.

    Example:
        >>> with fast_kernels(False):
        ...     fast_kernels_enabled()
        False
    """
    before = fast_kernels_enabled()
    _fast.enabled = enabled
    try:
        yield
    finally:
        _fast.enabled = before


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class QuantizedPart:
    """One dense part [N, K] in a quantized slab: its data bytes, then its scales (byte offsets in the slab)."""
    name: str
    shape: tuple[int, int]          # dense [N, K] (F.linear weight: out, in)
    method: str                     # "int8" | "int4"
    group: int                      # int4 group along K (int8: K)
    padded_k: int                   # K rounded up to a whole number of groups (int4)
    packing: str                    # "plain" (device-neutral) | "cpu" (torch's CPU int4 kernel format)
    data_offset: int
    data_bytes: int
    scale_offset: int
    scale_bytes: int

    @property
    def groups(self) -> int:
        return self.padded_k // self.group


@dataclass(frozen=True)
class QuantizedSlabLayout:
    """Byte layout of one quantized expert (uint8 slab). Same interface as `SlabLayout`: `numel`, `parts`,
    `views(slab)`; plus `quantize_into` (in the layout's packing) and `dequantize`."""

    dense: SlabLayout
    method: str
    group_size: int
    compute_dtype: torch.dtype
    qparts: tuple[QuantizedPart, ...]
    numel: int                      # bytes, a multiple of ALIGN

    @classmethod
    def build(cls, dense: SlabLayout, method: str, group_size: int, compute_dtype: torch.dtype,
              packing: str = "plain") -> "QuantizedSlabLayout":
        """The layout for `dense` quantized with `method`; `packing="cpu"` uses torch's CPU int4 format for every
        int4 part its kernel accepts (N a multiple of 16), plain for the others."""
        if method not in METHODS:
            raise ValueError(f"quantize={method!r} is not a quantization method; allowed: {list(METHODS)}")
        if getattr(dense, "quantize_refusal", ""):   # experts computing x @ W (+ bias): GPT-OSS, DBRX, Llama-4
            raise PolicyError(dense.quantize_refusal)
        itemsize = compute_dtype.itemsize
        parts, offset = [], 0
        for name, shape in dense.parts:
            if len(shape) != 2:
                raise ValueError(f"expert part {name!r} has shape {shape}; only 2-D [out, in] weights quantize")
            n, k = shape
            if method == "int8":
                group, padded, data, scales, pack = k, k, n * k, n * itemsize, "plain"
            else:
                group, padded = group_size, -(-k // group_size) * group_size
                data, scales = n * padded // 2, (padded // group_size) * n * 2 * itemsize
                pack = "cpu" if packing == "cpu" and n % INT4_KERNEL_N_MULTIPLE == 0 else "plain"
            data_offset = _align(offset)
            scale_offset = _align(data_offset + data)
            offset = scale_offset + scales
            parts.append(QuantizedPart(name, (n, k), method, group, padded, pack, data_offset, data, scale_offset,
                                       scales))
        return cls(dense, method, group_size, compute_dtype, tuple(parts), _align(offset))

    @property
    def dequant_workspace_bytes(self) -> int:
        """The most bytes of temporaries one matmul over these weights makes on a device without a packed kernel
        (`QuantizedWeight.linear`): the int8 weight in the compute dtype, or one int4 row chunk in float32 (three
        alive at once) and in the compute dtype."""
        itemsize = self.compute_dtype.itemsize
        most = 0
        for p in self.qparts:
            if p.method == "int8":
                most = max(most, p.shape[0] * p.shape[1] * itemsize)
            else:
                rows = min(p.shape[0], _int4_chunk_rows(p))
                most = max(most, rows * p.padded_k * (3 * 4 + itemsize))
        return most

    def with_packing(self, packing: str) -> "QuantizedSlabLayout":
        return QuantizedSlabLayout.build(self.dense, self.method, self.group_size, self.compute_dtype, packing)

    @property
    def parts(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The dense parts (name, [N, K]) this slab holds."""
        return self.dense.parts

    def views(self, slab: torch.Tensor) -> dict[str, "QuantizedWeight"]:
        """Named `QuantizedWeight`s over a flat uint8 slab (zero-copy)."""
        return {p.name: QuantizedWeight(p, *self._regions(p, slab), self.compute_dtype) for p in self.qparts}

    def regions(self, slab: torch.Tensor) -> dict[str, torch.Tensor]:
        """The whole slab as one raw region ("slab"): how a disk store fills it from a quantized folder."""
        return {"slab": slab[:self.numel]}

    def _regions(self, p: QuantizedPart, slab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, _ = p.shape
        data = slab[p.data_offset:p.data_offset + p.data_bytes]
        scales = slab[p.scale_offset:p.scale_offset + p.scale_bytes].view(self.compute_dtype)
        if p.method == "int8":
            return data.view(torch.int8).view(n, p.padded_k), scales                 # [N, K], [N]
        return data.view(n, p.padded_k // 2), scales.view(p.groups, n, 2)            # [N, K/2], [G, N, 2]

    def quantize_into(self, dense: dict[str, torch.Tensor], slab: torch.Tensor) -> None:
        """Quantize one expert's dense parts ({name: [N, K]}) into `slab`, in the layout's packing (plain nibbles,
        or torch's CPU int4 format)."""
        slab[:self.numel].zero_()     # padding bytes are deterministic: identical inputs give identical files
        for p in self.qparts:
            data, scales = self._regions(p, slab)
            w = dense[p.name].to(torch.float32)
            if p.method == "int8":
                q, s = quantize_int8(w, self.compute_dtype)
                data.copy_(q)
                scales.copy_(s)
            else:
                q, sz = quantize_int4(w, p.group, self.compute_dtype)
                data.copy_(to_cpu_int4(q) if p.packing == "cpu" else pack_nibbles(q))
                scales.copy_(sz)

    def dequantize(self, slab: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dense parts [N, K] in the compute dtype (approximate weights) from a slab in this layout's packing."""
        return {name: w.dequantize() for name, w in self.views(slab).items()}


class QuantizedWeight:
    """A quantized [N, K] weight over slab memory; `linear(x)` = `F.linear(x, dequantized weight)`."""
    def __init__(self, part: QuantizedPart, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        self.part, self.data, self.scales = part, data, scales
        self.dtype = dtype          # the compute dtype (inputs are cast to it)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.part.shape)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]; torch's CPU kernel where it applies, else dequantize + F.linear."""
        p = self.part
        x = x.to(self.dtype)
        if self.device.type == "cpu" and fast_kernels_enabled():
            flat = x.reshape(-1, x.shape[-1]).contiguous()                              # [T, K]
            if p.method == "int8" and int8_kernel_applies(self.dtype, p.shape[1]):
                out = torch._weight_int8pack_mm(flat, self.data, self.scales)           # [T, N]
                return out.view(*x.shape[:-1], p.shape[0])
            if p.packing == "cpu":
                if p.padded_k != p.shape[1]:
                    flat = F.pad(flat, (0, p.padded_k - p.shape[1]))                     # zero columns: no effect
                out = torch._weight_int4pack_mm_for_cpu(flat, self.data, p.group, self.scales)
                return out.view(*x.shape[:-1], p.shape[0])
        if self.device.type == "cuda":
            return self._device_linear(x)
        return F.linear(x, self.dequantize())

    def _device_linear(self, x: torch.Tensor) -> torch.Tensor:
        """No float32 copy of the whole weight: int8 converts to the compute dtype exactly and scales the output
        per channel; int4 dequantizes a chunk of output rows at a time (`dequant_workspace_bytes` bounds both)."""
        p = self.part
        if p.method == "int8":
            return F.linear(x, self.data.to(self.dtype)) * self.scales
        if p.packing != "plain":                 # torch's CPU int4 format is unpacked on the host only
            return F.linear(x, self.dequantize())
        rows = _int4_chunk_rows(p)
        outs = []
        for start in range(0, p.shape[0], rows):
            q = unpack_nibbles(self.data[start:start + rows])                              # [n, Kp] uint8
            w = dequantize_int4(q, self.scales[:, start:start + rows], p.group)[:, :p.shape[1]].to(self.dtype)
            outs.append(F.linear(x, w))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def dequantize(self) -> torch.Tensor:
        """The approximate dense weight [N, K] in the compute dtype."""
        p = self.part
        if p.method == "int8":
            return (self.data.to(torch.float32) * self.scales.to(torch.float32)[:, None]).to(self.dtype)
        q = from_cpu_int4(self.data) if p.packing == "cpu" else unpack_nibbles(self.data)   # [N, Kp] uint8
        return dequantize_int4(q, self.scales, p.group)[:, :p.shape[1]].to(self.dtype)

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.part.method}, shape={tuple(self.part.shape)}, group={self.part.group}, "
                f"packing={self.part.packing}, dtype={self.dtype}, device={self.device})")


# -- the arithmetic -------------------------------------------------------------------------------------------------

INT4_CHUNK_ELEMENTS = 1 << 24     # int4 weights dequantized on a device this many entries at a time (64 MiB fp32)


def int8_kernel_applies(dtype: torch.dtype, in_features: int) -> bool:
    """Whether torch's CPU int8 kernel computes `x @ W.T` right for this input width: in bfloat16 it reads rows in
    blocks of 16 and gives wrong values (or crashes) for a width that is not a multiple of 16."""
    return dtype != torch.bfloat16 or in_features % 16 == 0


def _int4_chunk_rows(p: QuantizedPart) -> int:
    return max(1, INT4_CHUNK_ELEMENTS // p.padded_k)


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float32 -> (q int8 [N, K], scale [N] in `scale_dtype`), symmetric per output channel."""
    scale = (w.abs().amax(dim=1) / 127).to(scale_dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)             # an all-zero row: any scale works
    q = torch.round(w / scale.to(torch.float32)[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float32 -> (q uint8 [N, Kp] in 0..15, scales_and_zeros [Kp/group, N, 2] in `scale_dtype`), with
    w ~= (q - 8) * scale + zero per group (min/max asymmetric); K is zero-padded to Kp = groups x group."""
    n, k = w.shape
    padded = -(-k // group) * group
    grouped = F.pad(w, (0, padded - k)).view(n, padded // group, group)       # [N, G, g]
    lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)                        # [N, G]
    scale = (hi - lo) / 15
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)             # a constant group: q = 0 is exact
    scale = scale.to(scale_dtype)
    zero = (lo + 8 * scale.to(torch.float32)).to(scale_dtype)
    s32, z32 = scale.to(torch.float32)[..., None], zero.to(torch.float32)[..., None]
    q = torch.round((grouped - z32) / s32 + 8).clamp(0, 15).to(torch.uint8).view(n, padded)
    return q, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """q [N, Kp] (0..15) -> float32 [N, Kp]."""
    n, padded = q.shape
    sz = scales_and_zeros.to(torch.float32).transpose(0, 1)                    # [N, G, 2]
    grouped = q.to(torch.float32).view(n, padded // group, group)
    return ((grouped - 8) * sz[..., :1] + sz[..., 1:]).view(n, padded)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] uint8 in 0..15 (K even) -> [N, K/2]: the even input index in the low nibble (plain format)."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] plain nibbles -> q [N, K] uint8."""
    n, half = packed.shape
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(n, 2 * half)


def to_cpu_int4(q: torch.Tensor, rows_per_call: int = 1024) -> torch.Tensor:
    """q [N, K] uint8 -> torch's CPU int4 kernel format [N, K/2] (machine-dependent), converted in row chunks to
    bound the int32 temporary (blocks of rows are packed independently; chunks are multiples of every block)."""
    n, k = q.shape
    out = torch.empty(n, k // 2, dtype=torch.uint8)
    for start in range(0, n, rows_per_call):
        rows = q[start:start + rows_per_call].to(torch.int32)
        out[start:start + rows.shape[0]] = torch._convert_weight_to_int4pack_for_cpu(rows, 1)
    return out


def from_cpu_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_cpu_int4`: torch's CPU int4 format [N, K/2] -> q [N, K] uint8.

    torch packs N in blocks of BLOCK_N rows (64 with AVX-512, else 32; the last block holds the rest); block b's
    bytes are [K, nb/2], byte j of column k pairs two of the block's rows (which two depends on nb and the CPU).
    Both are read off torch's own converter on small probes (`_cpu_int4_scheme`), so this follows the machine."""
    n, half = packed.shape
    k = 2 * half
    block, pairing = _cpu_int4_scheme()
    flat = packed.reshape(-1)
    q = torch.empty(n, k, dtype=torch.uint8)
    start, offset = 0, 0
    while start < n:
        nb = min(block, n - start)
        full = (n - start) // nb if nb == block else 1          # whole blocks at once, then the remainder
        lo_rows, hi_rows = pairing(nb)
        region = flat[offset:offset + full * k * nb // 2].view(full, k, nb // 2)   # [B, K, nb/2]
        rows = q[start:start + full * nb].view(full, nb, k)                        # [B, nb, K]
        rows[:, lo_rows, :] = (region & 15).transpose(1, 2)
        rows[:, hi_rows, :] = (region >> 4).transpose(1, 2)
        start += full * nb
        offset += full * k * nb // 2
    return q


@functools.lru_cache(maxsize=1)
def _cpu_int4_scheme():
    """(BLOCK_N, pairing(nb) -> (rows in low nibbles, rows in high nibbles)) of this machine's CPU int4 format."""
    @functools.lru_cache(maxsize=None)
    def pairing(nb: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(nb, dtype=torch.int32)[:, None].expand(nb, 2)        # K = 2 columns, same per k
        digits = [torch._convert_weight_to_int4pack_for_cpu(((rows >> s) & 15).contiguous(), 1).reshape(-1)
                  for s in (0, 4)]
        first_k = [d[:nb // 2] for d in digits]                                  # column k = 0 of the block
        lo = (first_k[0] & 15).long() | ((first_k[1] & 15).long() << 4)
        hi = (first_k[0] >> 4).long() | ((first_k[1] >> 4).long() << 4)
        return lo, hi

    for block in (64, 32, 16):
        probe = torch.randint(0, 16, (2 * block + 16, 4), dtype=torch.int32, generator=torch.Generator()
                              .manual_seed(block))
        packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
        try:
            if torch.equal(_unpack_with(packed, block, pairing), probe.to(torch.uint8)):
                return block, pairing
        except RuntimeError:
            continue
    raise RuntimeError("torch's CPU int4 weight format is not one hf_moe_offload can read back; run with "
                       "hf_moe_offload.storage.quantize.fast_kernels(False) or a device other than the CPU")


def _unpack_with(packed: torch.Tensor, block: int, pairing) -> torch.Tensor:
    n, half = packed.shape
    k, flat = 2 * half, packed.reshape(-1)
    q = torch.empty(n, k, dtype=torch.uint8)
    start = offset = 0
    while start < n:
        nb = min(block, n - start)
        lo_rows, hi_rows = pairing(nb)
        region = flat[offset:offset + k * nb // 2].view(k, nb // 2)
        q[start + lo_rows] = (region & 15).t()
        q[start + hi_rows] = (region >> 4).t()
        start, offset = start + nb, offset + k * nb // 2
    return q


def packing_signature(layouts: list["QuantizedSlabLayout"]) -> str:
    """What a slab's bytes mean beyond method and shapes: "plain", or torch's CPU int4 format as this machine's
    converter makes it (its row block and pairing, which follow the CPU's vector width). Files packed for one
    machine are then never read as another's."""
    if not any(p.packing == "cpu" for lay in layouts for p in lay.qparts):
        return "plain"
    block, pairing = _cpu_int4_scheme()
    lo, hi = pairing(block)
    return f"cpu-int4-block{block}-" + "".join(f"{int(r):x}." for r in torch.cat([lo, hi]))


def cpu_int4_available() -> bool:
    """Whether torch's CPU int4 kernel and its format are usable here."""
    try:
        _cpu_int4_scheme()
        return True
    except (RuntimeError, AttributeError):
        return False


def quantized_layouts(dense: list[SlabLayout], method: str, group_size: int, compute_dtype: torch.dtype,
                      device: torch.device) -> list[QuantizedSlabLayout]:
    """One layout per MoE layer, packed for where the experts compute: torch's CPU int4 format on the CPU."""
    packing = "cpu" if device.type == "cpu" and method == "int4" and cpu_int4_available() else "plain"
    return [QuantizedSlabLayout.build(d, method, group_size, compute_dtype, packing) for d in dense]


def bytes_per_weight(method: str, group_size: int, dtype: torch.dtype) -> float:
    """Stored bytes per weight, scales included (slab alignment aside).

    Example:
        >>> bytes_per_weight("int4", 64, torch.bfloat16)    # 0.5 + 2 x 2 bytes / 64
        0.5625
    """
    if method == "int8":
        return 1.0
    return 0.5 + 2 * dtype.itemsize / group_size


__all__ = ["QuantizedSlabLayout", "QuantizedWeight", "QuantizedPart", "fast_kernels", "fast_kernels_enabled",
           "quantize_int8", "quantize_int4", "dequantize_int4", "quantized_layouts", "bytes_per_weight"]
