"""Read a safetensors checkpoint's layout (headers only) and byte ranges of single tensors or slices.

Only headers are parsed up front, so a missing or truncated shard is reported (naming the file) before anything
is allocated; expert bytes are later read with `pread` straight into their destination, one expert at a time.

Example:
    >>> index = CheckpointIndex.open("path/to/model")          # doctest: +SKIP
    >>> index.locate("model.layers.0.mlp.experts.gate_up_proj", row=3)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """The checkpoint is missing, incomplete or not in a supported format; the message names the file."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: file, absolute byte offset, dtype and shape."""

    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
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


class CheckpointIndex:
    """Every tensor of a (possibly sharded) safetensors checkpoint, from its headers."""

    def __init__(self, root: str, entries: dict[str, TensorEntry]):
        self.root = root
        self.entries = entries

    @classmethod
    def open(cls, root: str | os.PathLike) -> "CheckpointIndex":
        root = str(root)
        files = _shard_files(root)
        entries: dict[str, TensorEntry] = {}
        for path in files:
            entries.update(read_header(path))
        return cls(root, entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def keys(self):
        return self.entries.keys()

    def locate(self, key: str, row: int | None = None) -> ByteRange:
        """Byte range of tensor `key`, or of `key[row]` (rows of the first dimension are contiguous)."""
        e = self.entries[key]
        if row is None:
            return ByteRange(e.path, e.offset, e.nbytes, e.dtype, e.shape)
        if not 0 <= row < e.shape[0]:
            raise CheckpointError(f"{key} has {e.shape[0]} rows, row {row} requested ({e.path})")
        row_bytes = e.nbytes // e.shape[0]
        return ByteRange(e.path, e.offset + row * row_bytes, row_bytes, e.dtype, e.shape[1:])


def _shard_files(root: str) -> list[str]:
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root!r} does not exist")
    index_path = os.path.join(root, "model.safetensors.index.json")
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index_path} is not a valid safetensors index: {err}") from err
        files = [os.path.join(root, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise CheckpointError(f"checkpoint shard(s) listed in {index_path} are missing: "
                                  + ", ".join(os.path.basename(m) for m in missing))
        return files
    single = os.path.join(root, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"no safetensors checkpoint in {root!r} (expected model.safetensors or "
                          f"model.safetensors.index.json; .bin checkpoints cannot be offloaded per expert)")


def read_header(path: str) -> dict[str, TensorEntry]:
    """Parse one safetensors file's header and check the file holds all the bytes it announces."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
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
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    end = data_start
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
        begin, stop = info["data_offsets"]
        entries[key] = TensorEntry(path, data_start + begin, dtype, tuple(info["shape"]))
        end = max(end, data_start + stop)
    if end > size:
        raise CheckpointError(f"checkpoint shard {path} is truncated: its header needs {end} bytes, the file has "
                              f"{size}")
    return entries


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


def _pread_exact(rng: ByteRange, buf: memoryview, fd: int) -> None:
    if len(buf) != rng.nbytes:
        raise CheckpointError(f"{rng.path}: expected {len(buf)} bytes at {rng.offset}, tensor has {rng.nbytes}")
    done = 0
    while done < rng.nbytes:
        n = os.preadv(fd, [buf[done:]], rng.offset + done)
        if n <= 0:
            raise CheckpointError(f"checkpoint shard {rng.path} ended early at byte {rng.offset + done}")
        done += n


def resolve_checkpoint_dir(name_or_path: str | os.PathLike, **hub_kwargs) -> str:
    """A local directory for `name_or_path`: the path itself, or the Hub cache snapshot (offline-friendly)."""
    path = str(name_or_path)
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    allowed = {k: v for k, v in hub_kwargs.items() if k in ("revision", "cache_dir", "token", "local_files_only")}
    try:
        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors"], **allowed)
    except Exception as err:  # noqa: BLE001 - the hub raises many types; the user needs one message
        raise CheckpointError(f"cannot find checkpoint {path!r}: not a local directory and not available from "
                              f"the Hub cache ({err})") from err
