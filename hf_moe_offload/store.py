"""Where experts live when they are not on the device: one contiguous slab per expert.

- `DiskStore`: experts stay in the checkpoint's safetensors files; `read_into` preads one expert's bytes straight
  into a destination buffer (a pinned staging buffer or a CPU cache slot). Host memory holds no expert.
- `CpuStore`: every expert in host memory as rows of one [E, slab] tensor per layer, pinned when the device is CUDA,
  so a slab goes to the device in a single asynchronous copy.

Example:
    >>> store = CpuStore.from_reader(DiskStore(layers, pieces, torch.bfloat16), pin=False)   # doctest: +SKIP
    >>> store.host_slab(layer=0, expert=3).shape                                           # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .arch import ExpertPiece, MoEArch, MoELayer, SlabLayout
from .checkpoint import read_into


class ExpertStore:
    """Common shape of both stores: per-layer slab layouts, one dtype."""

    def __init__(self, layouts: Sequence[SlabLayout], num_experts: Sequence[int], dtype: torch.dtype):
        self.layouts = list(layouts)
        self.num_experts = list(num_experts)
        self.dtype = dtype

    def slab_bytes(self, layer: int) -> int:
        return self.layouts[layer].numel * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return sum(self.slab_bytes(i) * n for i, n in enumerate(self.num_experts))

    @property
    def in_host_memory(self) -> bool:
        """Whether every slab is in host memory (`host_slab`), rather than read on demand (`read_into`)."""
        return False

    def host_slab(self, layer: int, expert: int) -> torch.Tensor | None:
        """The expert's slab in host memory, or None when it must be read (`read_into`)."""
        return None

    def read_into(self, layer: int, expert: int, dst: torch.Tensor) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class DiskStore(ExpertStore):
    """Experts read on demand, per expert, from the checkpoint's safetensors files."""

    def __init__(self, layers: Sequence[MoELayer], pieces: list[list[list[ExpertPiece]]], dtype: torch.dtype):
        """`pieces[layer][expert]`: where each expert's bytes are (`MoEArch.locate_expert`)."""
        super().__init__([lay.layout for lay in layers], [lay.num_experts for lay in layers], dtype)
        self.pieces = pieces
        self.files = sorted({p.source.path for layer in self.pieces for exp in layer for p in exp})
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()   # several reader threads share the file descriptors

    def read_into(self, layer: int, expert: int, dst: torch.Tensor) -> None:
        """Fill the flat CPU tensor `dst` (numel >= slab) with the expert's slab."""
        parts = self.layouts[layer].views(dst[:self.layouts[layer].numel])
        for piece in self.pieces[layer][expert]:
            rows = piece.source.shape[0]
            read_into(piece.source, parts[piece.part][piece.row:piece.row + rows], self._fd(piece.source.path))

    def _fd(self, path: str) -> int:
        with self._fds_lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def close(self) -> None:
        with self._fds_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class CpuStore(ExpertStore):
    """All experts in host memory, one [E, slab] tensor per layer (pinned for fast, asynchronous copies)."""

    def __init__(self, slabs: list[torch.Tensor], layouts: Sequence[SlabLayout], dtype: torch.dtype):
        super().__init__(layouts, [s.shape[0] for s in slabs], dtype)
        self.slabs = slabs

    @classmethod
    def allocate(cls, layouts: Sequence[SlabLayout], num_experts: Sequence[int], dtype: torch.dtype,
                 pin: bool) -> "CpuStore":
        slabs = [torch.empty(n, lay.numel, dtype=dtype, pin_memory=pin) for lay, n in zip(layouts, num_experts)]
        return cls(slabs, layouts, dtype)

    @classmethod
    def from_reader(cls, reader: DiskStore, pin: bool) -> "CpuStore":
        """Read every expert from the checkpoint into host memory (progress bar over layers)."""
        store = cls.allocate(reader.layouts, reader.num_experts, reader.dtype, pin)
        try:
            for layer in tqdm(range(len(store.slabs)), desc="Loading experts into host memory", unit="layer"):
                for e in range(store.num_experts[layer]):
                    reader.read_into(layer, e, store.slabs[layer][e])
        finally:
            reader.close()
        return store

    @classmethod
    def from_modules(cls, layers: Sequence[MoELayer], arch: MoEArch, dtype: torch.dtype, pin: bool) -> "CpuStore":
        """Copy the experts of a built model into host slabs."""
        store = cls.allocate([lay.layout for lay in layers], [lay.num_experts for lay in layers], dtype, pin)
        for lay in layers:
            for e in range(lay.num_experts):
                views = lay.layout.views(store.slabs[lay.index][e])
                for part, tensor in arch.expert_tensors(lay.module, e).items():
                    views[part].copy_(tensor)
        return store

    @property
    def in_host_memory(self) -> bool:
        return True

    def host_slab(self, layer: int, expert: int) -> torch.Tensor:
        return self.slabs[layer][expert]

    def read_into(self, layer: int, expert: int, dst: torch.Tensor) -> None:
        dst[:self.layouts[layer].numel].copy_(self.slabs[layer][expert])
