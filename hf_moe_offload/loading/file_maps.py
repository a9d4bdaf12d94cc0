"""Checkpoint tensors read in place: a private memory map of a safetensors file, tensors that view it, and advice
to the kernel about their pages. The input embedding table (`mapped_embedding`) and the model's own dense weights
(`mapped_dense`) are read this way; a file transformers would not map is not mapped here either
(`file_mapping_refusal`)."""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from ..storage.checkpoint import TensorEntry

try:    # transformers' own test for the file systems where it reads safetensors files instead of mapping them
    from transformers.modeling_utils import _is_on_hf_mount
except ImportError:     # a transformers without it maps everywhere, and so do we
    def _is_on_hf_mount(path) -> bool:
        return False

MADV_RANDOM = getattr(mmap, "MADV_RANDOM", 1)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def file_mapping_refusal(path: str, disable_mmap: bool) -> str | None:
    """Why `path` is not to be memory-mapped, or None: the user asked `from_pretrained` not to map files, or the file
    lies where transformers itself reads files instead of mapping them (hf-mount, whose mapped reads can deadlock
    under parallel page faults)."""
    if disable_mmap:
        return "from_pretrained(disable_mmap=True) asks for no memory-mapped files"
    if _is_on_hf_mount(path):
        return f"{path} is on an hf-mount file system, where transformers does not map files either"
    return None


def map_file(path: str) -> torch.UntypedStorage:
    """The whole file, mapped privately: a write (none is expected) would copy the page, never touch the file."""
    return torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))


def tensor_at(storage: torch.UntypedStorage, entry: TensorEntry) -> torch.Tensor:
    """The tensor `entry` locates, viewing the mapped `storage` of its file (its offset aligned to its dtype)."""
    return torch.empty(0, dtype=entry.dtype).set_(storage, entry.offset // entry.dtype.itemsize, tuple(entry.shape))


def advise(address: int, length: int, advice: int) -> None:
    """`madvise` over [address, address + length). Best effort: where madvise is missing the mapping works as it is,
    only without the advice."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice)
    except (OSError, AttributeError):
        pass
