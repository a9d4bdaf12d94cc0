"""Read a safetensors checkpoint's layout (headers only) and byte ranges of single tensors or slices.

Only headers are parsed up front, so a missing or truncated shard is reported (naming the file) before anything
is allocated; expert bytes are later read with `pread` straight into their destination, one expert at a time.

Example:
    >>> index = CheckpointIndex.open("path/to/model")          # doctest: +SKIP
    >>> index.locate("model.layers.0.mlp.experts.gate_up_proj", row=3)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from huggingface_hub import snapshot_download

from .integrity import FileIdentity

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}
# Fine-grained FP8 checkpoints (DeepSeek-V3, Qwen3-*-FP8): weights in these dtypes come with float block scales.
FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CheckpointError(ValueError):
    """The checkpoint is missing, incomplete or not in a supported format; the message names the file."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: file, absolute byte offset, dtype and shape."""

    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    identity: FileIdentity | None = field(default=None, compare=False)   # the file when its header was read

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


def tensor_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a contiguous tensor of `dtype` and `shape`.

    Example:
        >>> tensor_nbytes(torch.bfloat16, (3, 4))
        24
    """
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class ByteRange:
    """A contiguous piece of a file holding a tensor (or one row of its first dimension)."""

    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    identity: FileIdentity | None = field(default=None, compare=False)   # the file when its header was read


@dataclass(frozen=True)
class BlockScales:
    """The block scales of one fine-grained FP8 matrix: `source` holds `key` (one float per `block` of the weight,
    [ceil(N / block[0]), ceil(K / block[1])]); dequantized weight = fp8 value x the scale of its block."""

    key: str
    source: ByteRange
    block: tuple[int, int]


# MXFP4 (GPT-OSS checkpoints): FP4 E2M1 codes, two per byte (low nibble first), in blocks of 32 values that share
# one E8M0 exponent (uint8, bias 127; 255 is NaN in the OCP spec). The code -> value table is transformers'.
MXFP4_BLOCK = 32
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Mxfp4Scales(BlockScales):
    """The E8M0 exponents of one MXFP4 matrix: `source` holds `key` (`<name>_scales` [N, K/32] uint8 for the codes
    `<name>_blocks` [N, K/32, 16] uint8, N output rows of K inputs); weight = FP4 value x 2^(exponent - 127). The
    matrix is stored [out, in] and dequantized transposed, into the [in, out] the GPT-OSS experts compute with
    (`read_mxfp4_into`). A `BlockScales` of block (1, 32), so it travels in `ExpertPiece.scales`."""


class CheckpointIndex:
    """Every tensor of a (possibly sharded) safetensors checkpoint, from its headers.

    `block_size`: the config's FP8 `weight_block_size` when the checkpoint ships fine-grained FP8 weights (their
    scales are then found by `block_scales`), else None."""

    def __init__(self, root: str, entries: dict[str, TensorEntry], block_size: tuple[int, int] | None = None):
        self.root = root
        self.entries = entries
        self.block_size = block_size

    @classmethod
    def open(cls, root: str | os.PathLike, block_size: tuple[int, int] | None = None,
             variant: str | None = None) -> "CheckpointIndex":
        """The tensors of the safetensors checkpoint in `root`; `variant` as in `from_pretrained(variant=...)`
        (`model.<variant>.safetensors`, `model.safetensors.index.<variant>.json`)."""
        root = str(root)
        files = _shard_files(root, variant)
        entries: dict[str, TensorEntry] = {}
        for path in files:
            entries.update(read_header(path))
        return cls(root, entries, tuple(block_size) if block_size is not None else None)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def keys(self):
        return self.entries.keys()

    def locate(self, key: str, row: int | None = None) -> ByteRange:
        """Byte range of tensor `key`, or of `key[row]` (rows of the first dimension are contiguous)."""
        e = self.entries[key]
        if row is None:
            return ByteRange(e.path, e.offset, e.nbytes, e.dtype, e.shape, e.identity)
        if not 0 <= row < e.shape[0]:
            raise CheckpointError(f"{key} has {e.shape[0]} rows, row {row} requested ({e.path})")
        row_bytes = e.nbytes // e.shape[0]
        return ByteRange(e.path, e.offset + row * row_bytes, row_bytes, e.dtype, e.shape[1:], e.identity)

    def block_scales(self, key: str, row: int | None = None) -> BlockScales | None:
        """The block scales of the FP8 tensor `key` (of `key[row]`), or None when `key` is not FP8.

        The scales are `<name>.weight_scale_inv` for `<name>.weight` (per-expert and dense keys) or `<key>_scale_inv`
        (fused experts, e.g. `experts.gate_up_proj_scale_inv` [E, ...]); a missing one, or one whose dtype or grid
        does not fit the weight and the config's `weight_block_size`, is a `CheckpointError` naming it.

        Example:
            >>> index.block_scales("model.layers.0.mlp.experts.3.up_proj.weight").key   # doctest: +SKIP
            'model.layers.0.mlp.experts.3.up_proj.weight_scale_inv'
        """
        e = self.entries[key]
        if e.dtype not in FP8_DTYPES:
            return None
        scale_key = key.removesuffix("weight") + "weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"
        if self.block_size is None:
            raise CheckpointError(f"{key} is stored as {e.dtype} ({e.path}), but the config has no fine-grained FP8 "
                                  f"quantization_config (quant_method='fp8' with weight_block_size) to read it with")
        if len(e.shape) < 2:
            raise CheckpointError(f"{key} is stored as {e.dtype} with shape {list(e.shape)} ({e.path}); fine-grained "
                                  f"FP8 weights are matrices [..., N, K]")
        (bn, bk), (n, k) = self.block_size, e.shape[-2:]
        want = (*e.shape[:-2], -(-n // bn), -(-k // bk))
        if scale_key not in self.entries:
            raise CheckpointError(f"checkpoint {self.root} has no {scale_key}: the FP8 tensor {key} ({e.path}) needs "
                                  f"its block scales, a float32 tensor of shape {list(want)} (weight_block_size "
                                  f"{list(self.block_size)})")
        s = self.entries[scale_key]
        if s.dtype not in SCALE_DTYPES or s.shape != want:
            raise CheckpointError(f"{scale_key} in {s.path} is {s.dtype} {list(s.shape)}, but the FP8 tensor {key} "
                                  f"{list(e.shape)} with weight_block_size {list(self.block_size)} needs one scale per "
                                  f"block: float32 (or bfloat16/float16) {list(want)}")
        return BlockScales(scale_key, self.locate(scale_key, row), self.block_size)

    def mxfp4_scales(self, key: str, row: int | None = None) -> Mxfp4Scales:
        """The exponents of the MXFP4 codes `key` (`<name>_blocks`, of `key[row]` for fused experts [E, ...]): the
        tensor `<name>_scales`. Codes or exponents of the wrong dtype or shape, or missing exponents, are a
        `CheckpointError` naming the tensor and what is expected: raised from the headers, before any read.

        Example:
            >>> index.mxfp4_scales("model.layers.0.mlp.experts.down_proj_blocks", row=3).key   # doctest: +SKIP
            'model.layers.0.mlp.experts.down_proj_scales'
        """
        e = self.entries[key]
        half = MXFP4_BLOCK // 2
        lead = 1 if row is None else 2        # [N, K/32, 16], or [E, N, K/32, 16] with an expert row
        if not key.endswith("_blocks"):
            raise CheckpointError(f"{key} ({e.path}) is not MXFP4 codes: their tensors are named <name>_blocks")
        if e.dtype != torch.uint8 or len(e.shape) != lead + 2 or e.shape[-1] != half:
            raise CheckpointError(f"{key} in {e.path} is {e.dtype} {list(e.shape)}, but MXFP4 codes are uint8 "
                                  f"[{'experts, ' if row is not None else ''}rows, blocks, {half}] (two 4-bit "
                                  f"values per byte, {MXFP4_BLOCK} values per block)")
        scale_key = key.removesuffix("_blocks") + "_scales"
        want = list(e.shape[:-1])
        if scale_key not in self.entries:
            raise CheckpointError(f"checkpoint {self.root} has no {scale_key}: the MXFP4 codes {key} ({e.path}) need "
                                  f"their exponents, a uint8 tensor of shape {want} (one per block of "
                                  f"{MXFP4_BLOCK} values)")
        s = self.entries[scale_key]
        if s.dtype != torch.uint8 or list(s.shape) != want:
            raise CheckpointError(f"{scale_key} in {s.path} is {s.dtype} {list(s.shape)}, but the MXFP4 codes {key} "
                                  f"{list(e.shape)} need one E8M0 exponent per block of {MXFP4_BLOCK} values: "
                                  f"uint8 {want}")
        return Mxfp4Scales(scale_key, self.locate(scale_key, row), (1, MXFP4_BLOCK))


def with_variant(name: str, variant: str | None) -> str:
    """`name` with `variant` before its last suffix, as transformers names a variant's files: `model.safetensors` ->
    `model.fp16.safetensors`, `model.safetensors.index.json` -> `model.safetensors.index.fp16.json`."""
    if not variant:
        return name
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}.{variant}.{suffix}"


def _shard_files(root: str, variant: str | None = None) -> list[str]:
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root!r} does not exist")
    index_name = with_variant("model.safetensors.index.json", variant)
    single_name = with_variant("model.safetensors", variant)
    index_path = os.path.join(root, index_name)
    if os.path.exists(index_path):
        files = [os.path.join(root, name) for name in sorted(set(_weight_map(index_path).values()))]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise CheckpointError(f"checkpoint shard(s) listed in {index_path} are missing: "
                                  + ", ".join(os.path.basename(m) for m in missing))
        return files
    single = os.path.join(root, single_name)
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"no safetensors checkpoint in {root!r} (expected {single_name} or {index_name}; .bin "
                          f"checkpoints cannot be offloaded per expert)")


_INDEX_EXPECTED = ('expected a JSON object with "weight_map": {tensor name: shard file name, ...}, as '
                   'save_pretrained writes it')


def _weight_map(index_path: str) -> dict[str, str]:
    """The index's tensor name -> shard file name map, its shape checked (a hand-edited or truncated index would
    otherwise fail later with a TypeError that names no file).

    Example:
        >>> _weight_map("model/model.safetensors.index.json")["lm_head.weight"]   # doctest: +SKIP
        'model-00002-of-00002.safetensors'
    """
    try:
        with open(index_path, "rb") as f:
            index = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index_path} is not a valid safetensors index: not JSON ({err}); "
                              f"{_INDEX_EXPECTED}") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} is not a valid safetensors index: {_index_problem(index)}; "
                              f"{_INDEX_EXPECTED}")
    bad = [key for key, name in weight_map.items() if not isinstance(name, str) or not name]
    if bad:
        raise CheckpointError(f"{index_path} is not a valid safetensors index: \"weight_map\" gives "
                              f"{bad[0]!r} the value {weight_map[bad[0]]!r}"
                              + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") + f"; {_INDEX_EXPECTED}")
    return weight_map


def _index_problem(index: Any) -> str:
    """What is wrong with an index that has no usable "weight_map" object."""
    if not isinstance(index, dict):
        return f"the file holds a JSON {_json_type(index)}"
    if "weight_map" not in index:
        return f'it has no "weight_map" (keys: {sorted(index)})'
    weight_map = index["weight_map"]
    return '"weight_map" is empty' if weight_map == {} else f'"weight_map" is a JSON {_json_type(weight_map)}'


def _json_type(value: Any) -> str:
    """A parsed JSON value's type in JSON's own words (the user wrote JSON, not Python)."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def read_header(path: str) -> dict[str, TensorEntry]:
    """Parse one safetensors file's header and check the file holds all the bytes it announces. Each entry records
    the file's identity (`FileIdentity`), which a store compares when it opens the file."""
    with open(path, "rb") as f:
        identity = FileIdentity.of(os.fstat(f.fileno()))
        size = identity.size
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"checkpoint shard {path} is truncated or corrupt ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise CheckpointError(f"checkpoint shard {path} is truncated or corrupt (header of {header_len} bytes "
                                  f"announced, file has {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"checkpoint shard {path} has a corrupt header: {err}") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint shard {path} has a corrupt header: a JSON {_json_type(header)}, expected "
                              f"an object {{tensor name: {_ENTRY_EXPECTED}}}")
    data_start = 8 + header_len
    entries = {key: _entry(path, key, info, data_start, identity) for key, info in header.items()
               if key != "__metadata__"}
    end = max((e.offset + e.nbytes for e in entries.values()), default=data_start)
    if end > size:
        raise CheckpointError(f"checkpoint shard {path} is truncated: its header needs {end} bytes, the file has "
                              f"{size}")
    return entries


def header_digest(path: str) -> str:
    """A hash of a file's safetensors header (its first bytes, whatever they are): two checkpoints that agree in
    name, size and mtime but hold other tensors or offsets get other digests, without reading the weights."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        raw = f.read(8)
        h.update(raw)
        if len(raw) == 8:
            h.update(f.read(min(struct.unpack("<Q", raw)[0], 100 << 20)))   # headers are KBs; the cap bounds junk
    return h.hexdigest()


_ENTRY_EXPECTED = '{"dtype": "F32", "shape": [rows, ...], "data_offsets": [begin, end]}'


def _entry(path: str, key: str, info: Any, data_start: int, identity: FileIdentity | None = None) -> TensorEntry:
    """One header entry as a `TensorEntry`, every field checked: a malformed entry names the file and the tensor
    instead of failing with a KeyError or TypeError, and offsets that disagree with dtype x shape are caught
    before a read returns the wrong bytes.

    Example:
        >>> _entry("m.safetensors", "w", {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, 8).offset
        8
    """
    def corrupt(problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint shard {path} has a corrupt header: tensor {key!r} {problem}; expected "
                               f"{_ENTRY_EXPECTED}")

    if not isinstance(info, dict):
        raise corrupt(f"is a JSON {_json_type(info)}")
    missing = [name for name in ("dtype", "shape", "data_offsets") if name not in info]
    if missing:
        raise corrupt(f"lacks {missing}")
    dtype = SAFETENSORS_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise corrupt(f"has unsupported dtype {info['dtype']!r} (supported: {sorted(SAFETENSORS_DTYPES)})")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise corrupt(f"has shape {shape!r}, not a list of sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1]):
        raise corrupt(f"has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    entry = TensorEntry(path, data_start + offsets[0], dtype, tuple(shape), identity)
    if offsets[1] - offsets[0] != entry.nbytes:
        raise corrupt(f"spans {offsets[1] - offsets[0]} bytes, but {info['dtype']} x {shape} needs {entry.nbytes}")
    return entry


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_into(rng: ByteRange, dst: torch.Tensor, fd: int, bounce: torch.Tensor | None = None) -> None:
    """Fill the contiguous CPU tensor `dst` (same number of elements) with the bytes of `rng` read from `fd` (open
    on `rng.path`), converting dtype.

    A conversion reads the raw bytes into `bounce` first: a uint8 CPU tensor of at least `rng.nbytes` that the
    caller reuses across reads (one per reading thread); without one, a buffer is allocated for this read.

    Example:
        >>> read_into(index.locate("w1", row=3), slab_part, fd, bounce=scratch)   # doctest: +SKIP
    """
    if dst.dtype == rng.dtype:
        _pread_exact(rng, memoryview(dst.reshape(-1).view(torch.uint8).numpy()), fd)
        return
    if bounce is None or bounce.numel() < rng.nbytes:
        bounce = torch.empty(rng.nbytes, dtype=torch.uint8)
    raw = bounce[:rng.nbytes]
    _pread_exact(rng, memoryview(raw.numpy()), fd)
    dst.copy_(raw.view(rng.dtype).view(dst.shape))


def read_fp8_into(rng: ByteRange, scales: BlockScales, dst: torch.Tensor, fd: int, scale_fd: int,
                  bounce: torch.Tensor | None = None) -> None:
    """Fill `dst` ([N, K] CPU tensor in the model dtype) with the FP8 matrix at `rng` dequantized by its block
    `scales` (read from `scale_fd`): `dst = float32(fp8) x float32(scale of its block)`, rounded to `dst.dtype` —
    the arithmetic transformers' `Fp8Dequantize` uses, so the result is the same bits. A non-finite scale is a
    `CheckpointError` naming its tensor.

    Example:
        >>> read_fp8_into(w_rng, index.block_scales(key), slab_part, fd, fd, bounce=scratch)   # doctest: +SKIP
    """
    if bounce is None or bounce.numel() < rng.nbytes:
        bounce = torch.empty(rng.nbytes, dtype=torch.uint8)
    raw = bounce[:rng.nbytes]
    _pread_exact(rng, memoryview(raw.numpy()), fd)
    scale = torch.empty(scales.source.shape, dtype=scales.source.dtype)
    _pread_exact(scales.source, memoryview(scale.reshape(-1).view(torch.uint8).numpy()), scale_fd)
    if not bool(torch.isfinite(scale).all()):
        raise CheckpointError(f"{scales.key} in {scales.source.path} holds non-finite block scales (NaN or inf): "
                              f"the checkpoint is corrupt")
    dequantize_blocks(raw.view(rng.dtype).view(rng.shape), scale, scales.block, dst.view(rng.shape))


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor) -> None:
    """`out = float32(q) x scale`, each scale covering a `block` of q [N, K] (the last row/column blocks may be
    partial), one block row at a time so that no weight-sized float32 copy is made.

    Example:
        >>> out = torch.empty(3, 3)
        >>> dequantize_blocks(torch.ones(3, 3).to(torch.float8_e4m3fn), torch.tensor([[1., 2.], [3., 4.]]), (2, 2), out)
        >>> out.tolist()
        [[1.0, 1.0, 2.0], [1.0, 1.0, 2.0], [3.0, 3.0, 4.0]]
    """
    bn, bk = block
    n, k = q.shape
    cols = scale.to(torch.float32).repeat_interleave(bk, dim=1)[:, :k]     # [ceil(N/bn), K]
    for i in range(cols.shape[0]):
        rows = slice(i * bn, min((i + 1) * bn, n))
        out[rows].copy_(q[rows].to(torch.float32).mul_(cols[i]))


def read_mxfp4_into(rng: ByteRange, scales: Mxfp4Scales, dst: torch.Tensor, fd: int, scale_fd: int,
                    bounce: torch.Tensor | None = None) -> None:
    """Fill `dst` ([K, N] CPU tensor in the model dtype) with the MXFP4 matrix at `rng` (codes [N, K/32, 16])
    dequantized by its exponents `scales` (read from `scale_fd`) and transposed: the arithmetic of transformers'
    `convert_moe_packed_tensors` (its `Mxfp4Config(dequantize=True)` load), so the result is the same bits. An
    exponent of 255 (NaN in E8M0) is a `CheckpointError` naming its tensor.

    Example:
        >>> read_mxfp4_into(codes, index.mxfp4_scales(key, row=3), slab_part, fd, fd, bounce=scratch)  # doctest: +SKIP
    """
    if bounce is None or bounce.numel() < rng.nbytes:
        bounce = torch.empty(rng.nbytes, dtype=torch.uint8)
    raw = bounce[:rng.nbytes]
    _pread_exact(rng, memoryview(raw.numpy()), fd)
    exponents = torch.empty(scales.source.shape, dtype=torch.uint8)
    _pread_exact(scales.source, memoryview(exponents.reshape(-1).numpy()), scale_fd)
    if bool((exponents == 255).any()):
        raise CheckpointError(f"{scales.key} in {scales.source.path} holds the exponent 255 (NaN in MXFP4's E8M0): "
                              f"the checkpoint is corrupt")
    dequantize_mxfp4(raw.view(rng.shape), exponents, dst)


def dequantize_mxfp4(blocks: torch.Tensor, exponents: torch.Tensor, out: torch.Tensor) -> None:
    """`out` [K, N] = the transpose of the MXFP4 matrix with codes `blocks` [N, K/32, 16] (uint8, low nibble first)
    and E8M0 `exponents` [N, K/32]: FP4 value x 2^(exponent - 127), computed in `out.dtype` by the same operations
    as transformers' `_convert_moe_packed_tensors` (table lookup in that dtype, then `torch.ldexp`).

    Example:
        >>> out = torch.empty(32, 1)
        >>> dequantize_mxfp4(torch.full((1, 1, 16), 0x72, dtype=torch.uint8), torch.tensor([[128]], dtype=torch.uint8), out)
        >>> out[:2, 0].tolist()      # codes 2 (1.0) then 7 (6.0), x 2^1
        [2.0, 12.0]
    """
    n, groups, half = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=out.dtype)
    codes = blocks.reshape(n * groups, half)
    values = torch.empty(n * groups, 2 * half, dtype=out.dtype)
    values[:, 0::2] = lut[(codes & 0x0F).to(torch.int)]
    values[:, 1::2] = lut[(codes >> 4).to(torch.int)]
    torch.ldexp(values, exponents.reshape(n * groups, 1).to(torch.int32) - 127, out=values)
    out.copy_(values.view(n, groups * 2 * half).T)


def split_range(rng: ByteRange, chunk_bytes: int) -> list[tuple[ByteRange, int]]:
    """`rng` cut into consecutive pieces of at most `chunk_bytes`, each with its byte offset within `rng`: reads of
    the pieces can run in parallel (one expert read by several threads reaches the disk's parallel bandwidth).

    Example:
        >>> [(r.offset, r.nbytes, start) for r, start in split_range(ByteRange("f", 100, 10, torch.uint8, (10,)), 4)]
        [(100, 4, 0), (104, 4, 4), (108, 2, 8)]
    """
    return [(ByteRange(rng.path, rng.offset + start, min(chunk_bytes, rng.nbytes - start), torch.uint8,
                       (min(chunk_bytes, rng.nbytes - start),), rng.identity), start)
            for start in range(0, rng.nbytes, chunk_bytes)]


def pread_exact(rng: ByteRange, buf: memoryview, fd: int) -> None:
    """Read exactly the bytes of `rng` from `fd` into `buf` (its length must match)."""
    _pread_exact(rng, buf, fd)


def _pread_exact(rng: ByteRange, buf: memoryview, fd: int) -> None:
    if len(buf) != rng.nbytes:
        raise CheckpointError(f"{rng.path}: expected {len(buf)} bytes at {rng.offset}, tensor has {rng.nbytes}")
    done = 0
    while done < rng.nbytes:
        n = os.preadv(fd, [buf[done:]], rng.offset + done)
        if n <= 0:
            raise CheckpointError(f"checkpoint shard {rng.path} ended early at byte {rng.offset + done}")
        done += n


def resolve_checkpoint_dir(name_or_path: str | os.PathLike, subfolder: str = "", **hub_kwargs) -> str:
    """A local directory for `name_or_path` (and its `subfolder`, as in `from_pretrained(subfolder=...)`): the path
    itself, or the Hub cache snapshot (offline-friendly)."""
    path = str(name_or_path)
    if os.path.isdir(path):
        return os.path.join(path, subfolder) if subfolder else path

    allowed = {k: v for k, v in hub_kwargs.items() if k in ("revision", "cache_dir", "token", "local_files_only")}
    try:
        snapshot = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"], **allowed)
    except Exception as err:  # noqa: BLE001 - the hub raises many types; the user needs one message
        raise CheckpointError(f"cannot find checkpoint {path!r}: not a local directory and not available from "
                              f"the Hub cache ({err})") from err
    return os.path.join(snapshot, subfolder) if subfolder else snapshot
