"""Advice to the kernel about pages of memory the library holds: how a mapped file's pages will be read, and pages
handed back once their bytes live elsewhere (a weight's packed copy, the checkpoint's file)."""

from __future__ import annotations

import ctypes
import mmap

import torch

MADV_RANDOM = getattr(mmap, "MADV_RANDOM", 1)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def advise(address: int, length: int, advice: int) -> None:
    """`madvise` over [address, address + length). Best effort: where madvise is missing the memory works as it is,
    only without the advice."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice)
    except (OSError, AttributeError):
        pass


def release_pages(tensor: torch.Tensor) -> None:
    """Hand back the pages that lie wholly inside `tensor` (a neighbour's stay): a file mapping's are read from the
    file again at the next touch, anonymous memory's read as zeros. Best effort: where madvise is missing nothing
    changes."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        advise(first, last - first, MADV_DONTNEED)
