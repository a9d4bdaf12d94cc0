"""Folders the library writes: locked while built, files written under unpredictable temporary names and renamed
into place once whole, a disk that fills up named as such, and temporary folders of killed processes removed.

- `folder_lock(folder)`: an `fcntl.flock` on the folder itself; builders hold it exclusively (a second builder
  waits for the first), readers hold it shared while they read the manifest and open the files it names.
- `write_safetensors`, `write_json`: one file written through a temporary file opened with O_EXCL | O_NOFOLLOW (a
  planted symlink is never followed), synced, then renamed; ENOSPC becomes a `DiskFullError` naming the folder.
- `temporary_folder()`: a private folder in the system temp dir whose owner holds a lock on it while alive; the next
  call removes the folders whose owner is gone (killed before it could clean up).

Example:
    >>> with folder_lock("/tmp/q"):                                     # doctest: +SKIP
    ...     write_safetensors("/tmp/q", "layer.safetensors", {"0": slabs}, needed=slabs.nbytes)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import tempfile
from typing import Iterator

import torch

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".hf_moe_offload-"
TEMP_SUFFIX = ".tmp"
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}


class DiskFullError(OSError):
    """The disk holding a folder the library writes ran out of space (or quota); the message names the folder and
    how many bytes the build needs."""


@contextlib.contextmanager
def folder_lock(folder: str, shared: bool = False) -> Iterator[None]:
    """Hold an `fcntl.flock` on `folder` (exclusive for a build, shared for reading), waiting for another holder."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("hf_moe_offload: waiting for another process using %s to finish building it", folder)
            fcntl.flock(fd, mode)
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                raise
            # Some network filesystems have no flock: the build still goes to new files and an atomic manifest.
            logger.warning("hf_moe_offload: cannot lock %s (%s); two processes must not build it at once", folder,
                           err.strerror)
        yield
    finally:
        os.close(fd)          # releases the lock


def remove_stale_temps(folder: str) -> None:
    """Remove temporary files a killed build left in `folder` (call with the folder's exclusive lock held: no live
    build writes there then)."""
    for name in os.listdir(folder):
        if name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))       # unlink does not follow a symlink
                logger.info("hf_moe_offload: removed %s, left by an interrupted build", os.path.join(folder, name))


def _open_temp(folder: str) -> tuple[int, str]:
    """A new file in `folder` under an unpredictable name, created exclusively and never through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    path = os.path.join(folder, f"{TEMP_PREFIX}{secrets.token_hex(8)}{TEMP_SUFFIX}")
    return os.open(path, flags, 0o644), path


def _write_all(fd: int, data: memoryview) -> None:
    """Write every byte of `data` to `fd` (os.write may write less than asked)."""
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def _disk_full(folder: str, needed: int, err: OSError | None = None) -> DiskFullError:
    free = shutil.disk_usage(folder).free
    cause = f" ({err.strerror})" if err is not None else ""
    return DiskFullError(errno.ENOSPC, f"not enough space on the disk holding {folder}{cause}: writing the experts "
                                       f"needs {needed} bytes, {free} are free. Free some space, or pass another "
                                       f"offload_folder= (or set $HF_MOE_OFFLOAD_CACHE) on a disk with room")


def check_free_space(folder: str, needed: int) -> None:
    """A `DiskFullError` before anything is written when the disk holding `folder` has less than `needed` bytes."""
    if shutil.disk_usage(folder).free < needed:
        raise _disk_full(folder, needed)


def _header(tensors: dict[str, torch.Tensor]) -> bytes:
    """The safetensors header of `tensors` (written in this order), padded so that the data starts 8-aligned."""
    entries, offset = {}, 0
    for key, t in tensors.items():
        entries[key] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.numel() * t.element_size()]}
        offset += t.numel() * t.element_size()
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(folder: str, name: str, tensors: dict[str, torch.Tensor], needed: int) -> str:
    """Write contiguous CPU `tensors` as the safetensors file `folder/name`; a crash or a full disk leaves no file
    under `name` (`needed`: the whole build's bytes, for the message). Returns the path."""
    data = [memoryview(_header(tensors)), *(memoryview(t.reshape(-1).view(torch.uint8).numpy())
                                           for t in tensors.values())]
    return _write_atomically(folder, name, data, needed)


def write_json(folder: str, name: str, data: dict, indent: int | None = None) -> str:
    """Replace `folder/name` with `data` as JSON, atomically (temporary file, fsync, rename, directory fsync).
    Returns the path."""
    path = _write_atomically(folder, name, [memoryview((json.dumps(data, indent=indent) + "\n").encode())], 0)
    sync_folder(folder)
    return path


def _write_atomically(folder: str, name: str, chunks: list[memoryview], needed: int) -> str:
    """Write `chunks` to a new temporary file in `folder`, sync it and rename it to `name`: a crash, an interrupt or
    a full disk leaves no file under `name` and no temporary file. ENOSPC becomes a `DiskFullError`."""
    fd, tmp = _open_temp(folder)
    try:
        try:
            for chunk in chunks:
                _write_all(fd, chunk)
            os.fsync(fd)           # on disk before the name (and later a manifest) says it is whole
        finally:
            os.close(fd)
        path = os.path.join(folder, name)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(folder, needed, err) from err
        raise
    return path


def sync_folder(folder: str) -> None:
    """fsync the directory, so that renames into it survive a crash."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_generation() -> str:
    """An unpredictable tag for one build's files: a new build never writes over a file a store may have open."""
    return secrets.token_hex(6)


# -- temporary folders ---------------------------------------------------------------------------------------------

TEMP_FOLDER_PREFIX = "hf_moe_offload_experts_"
OWNER_FILE = ".owner"
_owner_fds: dict[str, int] = {}        # folder -> the open, locked owner file (the lock lives as long as the fd)


def temporary_folder() -> str:
    """A fresh folder for spilled experts in the system temp dir (removed by `remove_folder`). Its owner file stays
    locked while this process lives, so that a later call can tell a killed owner's folder and remove it."""
    remove_orphaned_folders()
    base = tempfile.gettempdir()
    # Made under another prefix and renamed once locked: a concurrent scan never sees it unlocked.
    staging_prefix = f".{TEMP_FOLDER_PREFIX}new_"
    staging = tempfile.mkdtemp(prefix=staging_prefix, dir=base)
    fd = os.open(os.path.join(staging, OWNER_FILE), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())
    # The random part whole: it may itself hold "_" (mkdtemp draws letters, digits and "_").
    folder = os.path.join(base, TEMP_FOLDER_PREFIX + os.path.basename(staging)[len(staging_prefix):])
    os.rename(staging, folder)
    _owner_fds[folder] = fd
    return folder


def remove_folder(folder: str) -> None:
    """Remove a folder made by `temporary_folder` (and release its owner lock)."""
    shutil.rmtree(folder, ignore_errors=True)
    fd = _owner_fds.pop(folder, None)
    if fd is not None:
        os.close(fd)


def remove_orphaned_folders() -> None:
    """Remove the temporary folders whose owner process is gone (its lock on the owner file went with it)."""
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        folder = os.path.join(base, name)
        if not name.startswith(TEMP_FOLDER_PREFIX) or folder in _owner_fds or os.path.islink(folder):
            continue
        try:
            fd = os.open(os.path.join(folder, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue              # not ours, or not readable by this user
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue              # its owner is alive
        finally:
            os.close(fd)
        logger.info("hf_moe_offload: removing %s, the offload folder of a process that ended without removing it",
                    folder)
        shutil.rmtree(folder, ignore_errors=True)
