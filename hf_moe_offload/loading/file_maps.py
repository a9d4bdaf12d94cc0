"""Checkpoint tensors read in place: a private memory map of a safetensors file, and tensors that view it (advice
about their pages: `storage.pages`). The input embedding table (`mapped_embedding`) and the model's own dense weights
(`mapped_dense`) are read this way; a file transformers would not map is not mapped here either
(`file_mapping_refusal`).

A model's mapped files (`FileMaps`) are each mapped once, and each keeps a descriptor on the file it maps. Before
every forward and every `state_dict()` (`FileMaps.guard`), a file rewritten in place since (another size or mtime:
its new bytes would show through the mapping) is refused with an `IntegrityError` naming it, as a disk store
refuses a checkpoint that changed under it. A file replaced by another (a rename, a new download) leaves the
mapped one, and its bytes, as they were.
"""

from __future__ import annotations

import os
import weakref
from typing import Callable

import torch
from torch import nn

from ..storage.checkpoint import TensorEntry
from ..storage.integrity import FileIdentity, IntegrityError

try:    # transformers' own test for the file systems where it reads safetensors files instead of mapping them
    from transformers.modeling_utils import _is_on_hf_mount
except ImportError:     # a transformers without it maps everywhere, and so do we
    def _is_on_hf_mount(path) -> bool:
        return False



def file_mapping_refusal(path: str, disable_mmap: bool) -> str | None:
    """Why `path` is not to be memory-mapped, or None: the user asked `from_pretrained` not to map files, or the file
    lies where transformers itself reads files instead of mapping them (hf-mount, whose mapped reads can deadlock
    under parallel page faults)."""
    if disable_mmap:
        return "from_pretrained(disable_mmap=True) asks for no memory-mapped files"
    if _is_on_hf_mount(path):
        return f"{path} is on an hf-mount file system, where transformers does not map files either"
    return None


class MappedFile:
    """One checkpoint file mapped whole and privately (a write, none expected, would copy the page, never touch the
    file), with a descriptor on the file mapped: `check()` compares that file's identity with the one it had when
    mapped. `indexed`: its identity when the checkpoint's headers were read; a file that changed since is refused."""

    def __init__(self, path: str, indexed: FileIdentity | None):
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, fd)
        self._fd = fd
        self.identity = FileIdentity.of(os.fstat(fd))
        if indexed is not None and self.identity != indexed:
            raise IntegrityError(f"{path} changed since its header was read (then: {indexed.describe()}; now: "
                                 f"{self.identity.describe()}): what transformers loaded from it and what would be "
                                 f"read from it in place could differ. Load the model again")
        self.storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=self.identity.size)
        if os.stat(path).st_ino != self.identity.inode:       # replaced between the open and the map
            raise IntegrityError(f"{path} was replaced while it was being mapped; load the model again")

    def check(self) -> None:
        """Raise an `IntegrityError` naming the file if it was rewritten in place since it was mapped."""
        now = FileIdentity.of(os.fstat(self._fd))
        if now != self.identity:
            raise IntegrityError(f"{self.path} was rewritten in place since it was mapped (then: "
                                 f"{self.identity.describe()}; now: {now.describe()}): the weights read from it in "
                                 f"place would no longer be the ones loaded. Load the model again (from_pretrained) "
                                 f"to use the new file")

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        """The tensor `entry` locates in this file, viewing the mapping (its offset aligned to its dtype)."""
        return torch.empty(0, dtype=entry.dtype).set_(self.storage, entry.offset // entry.dtype.itemsize,
                                                       tuple(entry.shape))


class FileMaps:
    """The checkpoint files one model reads in place, each mapped once (`tensor`), and the guard that refuses one
    rewritten since (`guard`, module docstring). `disable_mmap`: `from_pretrained(disable_mmap=True)`, under which
    nothing is mapped.

    Example:
        >>> maps = FileMaps(disable_mmap=False)                                           # doctest: +SKIP
        >>> table = maps.tensor(index.entries["model.embed_tokens.weight"])              # doctest: +SKIP
        >>> remove = maps.guard(model)                                                    # doctest: +SKIP
    """

    def __init__(self, disable_mmap: bool = False):
        self.disable_mmap = disable_mmap
        self._files: dict[str, MappedFile | None] = {}      # None: a file not to be mapped

    def tensor(self, entry: TensorEntry) -> torch.Tensor | None:
        """The tensor `entry` locates, viewing its file's mapping (made at the file's first tensor); None where the
        file is not to be mapped (`file_mapping_refusal`)."""
        if entry.path not in self._files:
            refused = file_mapping_refusal(entry.path, self.disable_mmap) is not None
            self._files[entry.path] = None if refused else MappedFile(entry.path, entry.identity)
        mapped = self._files[entry.path]
        return None if mapped is None else mapped.tensor(entry)

    @property
    def mapped(self) -> bool:
        """Whether any file is mapped."""
        return any(mapped is not None for mapped in self._files.values())

    def check(self) -> None:
        """Raise an `IntegrityError` naming the first mapped file rewritten in place since it was mapped."""
        for mapped in self._files.values():
            if mapped is not None:
                mapped.check()

    def guard(self, model: nn.Module) -> Callable[[], None]:
        """Check the files before each forward and `state_dict()` of `model`; returns what removes the checks."""
        handles = [model.register_forward_pre_hook(lambda module, args: self.check()),
                   model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: self.check())]

        def remove() -> None:
            for handle in handles:
                handle.remove()
        return remove
