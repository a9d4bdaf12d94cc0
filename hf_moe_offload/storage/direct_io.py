"""Reads that bypass the page cache (`O_DIRECT`): the disk writes into an aligned buffer of ours, and the bytes asked
for are copied from it into the slot.

A buffered read leaves every expert it reads in the page cache as well as in the expert cache. Where the page cache
cannot hold the experts until their next use (a container's memory limit counts it; a model larger than RAM cycles
through its layers every step), those pages are evicted before anyone reads them again, and under a limit the
reclaim takes the process's other pages with them. A direct read leaves nothing behind. Safetensors place tensors at
any byte offset, so each read covers the aligned blocks around the bytes asked for and copies them out (the same copy
a buffered read makes from the page cache).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

import torch

from .checkpoint import ByteRange, CheckpointError

ALIGN = 4096      # offsets, lengths and buffer addresses of direct reads: a multiple of any disk's logical block


def open_direct(path: str, open_fd: int | None = None) -> int | None:
    """`path` opened for direct reads, or None where the file system does not take them (tmpfs, some FUSE).
    `open_fd`: the same file open already; where the system names open files (`/proc/self/fd`), that file is opened
    again even when its name now points elsewhere or nowhere (another process rebuilt the folder meanwhile)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    if open_fd is not None and os.path.exists(f"/proc/self/fd/{open_fd}"):
        path = f"/proc/self/fd/{open_fd}"
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return None
        raise


class AlignedBuffers(threading.local):
    """One page-aligned buffer per reader thread, grown to the largest read it has made."""

    def get(self, nbytes: int) -> tuple[memoryview, int]:
        """A writable view of at least `nbytes` aligned bytes, and its address."""
        if getattr(self, "size", 0) < nbytes:
            size = _round_up(nbytes)
            self.owner = torch.empty(size + ALIGN, dtype=torch.uint8)       # owns the memory
            address = self.owner.data_ptr()
            self.address, self.size = address + (-address) % ALIGN, size
            self.view = memoryview((ctypes.c_char * size).from_address(self.address)).cast("B")
        return self.view, self.address


def pread_direct(rng: ByteRange, buf: memoryview, fd: int, buffers: AlignedBuffers) -> None:
    """Read exactly the bytes of `rng` into `buf` through the direct descriptor `fd`: the aligned blocks around them
    are read into this thread's aligned buffer, then the range is copied out (by `memmove`, which lets go of the
    interpreter lock while it copies, as the kernel's copy in a buffered read does)."""
    if len(buf) != rng.nbytes:
        raise CheckpointError(f"{rng.path}: expected {len(buf)} bytes at {rng.offset}, tensor has {rng.nbytes}")
    if not rng.nbytes:
        return
    start = rng.offset - rng.offset % ALIGN
    end = rng.offset + rng.nbytes
    aligned, address = buffers.get(_round_up(end) - start)
    done = 0
    while start + done < end:
        n = os.preadv(fd, [aligned[done:_round_up(end) - start]], start + done)
        if n <= 0:
            raise CheckpointError(f"checkpoint shard {rng.path} ended early at byte {start + done}")
        done += n
        if n % ALIGN:               # the file's end: the rest of the range cannot follow
            break
    if start + done < end:
        raise CheckpointError(f"checkpoint shard {rng.path} ended early at byte {start + done}")
    ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(buf)), address + rng.offset - start, rng.nbytes)


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
