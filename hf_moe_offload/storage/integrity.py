"""Checks that the bytes read back are the bytes that were meant: file identities and per-expert checksums.

- A file's identity (device, inode, size, mtime) is recorded when its header is read (`CheckpointIndex`) and
  compared when a store opens it and before each read: a checkpoint replaced or rewritten after loading is
  refused, naming the file, instead of serving its new experts next to the old file's other weights.
- Every file the library writes (quantized folders, spilled experts) carries one checksum per expert in its
  manifest (`ExpertChecksums`); a store checks an expert the first time this process reads it, so later reads
  cost nothing.

Example:
    >>> checksums = ExpertChecksums([[expert_digest([b"abc"])]], "/tmp/q", "delete it and load again")
    >>> checksums.verify(0, 0, [memoryview(b"abc")], "/tmp/q/layer.safetensors", None)
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

# sha256 runs on the CPU's SHA instructions through OpenSSL (several times faster than blake2b here); 16 bytes of
# it are plenty to tell a damaged expert from a whole one.
DIGEST_BYTES = 16


class IntegrityError(ValueError):
    """Bytes read back differ from what was written, or a file changed since it was indexed; the message names the
    file and what to do."""


@dataclass(frozen=True)
class FileIdentity:
    """Which file a path named when it was indexed: a replaced file has another inode, a rewritten one another
    size or mtime."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def describe(self) -> str:
        return f"inode {self.inode}, {self.size} bytes, mtime {self.mtime_ns} ns"


def check_identity(path: str, fd: int, expected: FileIdentity | None) -> FileIdentity:
    """The identity of the open file `fd`; an `IntegrityError` naming `path` when it is not `expected`."""
    now = FileIdentity.of(os.fstat(fd))
    if expected is not None and now != expected:
        raise IntegrityError(f"{path} changed since it was indexed (then: {expected.describe()}; now: "
                             f"{now.describe()}): its experts would not match the weights loaded with it. Load "
                             f"the model again (from_pretrained / enable) to use the new file")
    return now


def expert_digest(buffers: Sequence[memoryview | bytes]) -> str:
    """The checksum of one expert: its byte pieces, in order."""
    h = hashlib.sha256()
    for buf in buffers:
        h.update(buf)
    return h.hexdigest()[:2 * DIGEST_BYTES]


# (file identity, layer, expert) already checked in this process: each expert is hashed at its first read only.
_VERIFIED: set[tuple] = set()
_VERIFIED_LOCK = threading.Lock()


class ExpertChecksums:
    """The expected checksum of every expert of a folder the library wrote (`digests[layer][expert]`).

    `rebuild`: what the user does about a mismatch (put in the error); `on_mismatch(path)`: called once before the
    error is raised, e.g. to drop a cache folder's manifest so that the next load rebuilds it."""

    def __init__(self, digests: list[list[str]], folder: str, rebuild: str,
                 on_mismatch: Callable[[str], None] | None = None):
        self.digests = digests
        self.folder = folder
        self.rebuild = rebuild
        self.on_mismatch = on_mismatch

    def verify(self, layer: int, expert: int, buffers: Sequence[memoryview], path: str,
               identity: FileIdentity | None) -> None:
        """Check one expert's bytes (as read, piece by piece) the first time this process reads them."""
        key = (identity, self.folder, layer, expert)
        if identity is not None and key in _VERIFIED:
            return
        found = expert_digest(buffers)
        if found != self.digests[layer][expert]:
            if self.on_mismatch is not None:
                self.on_mismatch(path)
            raise IntegrityError(f"{path}: expert {expert} of MoE layer {layer} does not match the checksum written "
                                 f"with it (the file was damaged or modified after it was written); {self.rebuild}")
        if identity is not None:
            with _VERIFIED_LOCK:
                _VERIFIED.add(key)
