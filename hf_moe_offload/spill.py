"""Write a built model's experts to disk for a disk store, so `enable(model, {"store": "disk"})` serves the weights
the model has in memory now, not whatever its original checkpoint holds (a fine-tuned or edited model would
otherwise silently run, and come back from `disable()`, with the checkpoint's experts).

One safetensors file per MoE layer, one [E, ...] tensor per slab part; the folder is the user's
(`enable(..., offload_folder=...)`) or a temporary one removed when the engine detaches or the process exits.

Example:
    >>> pieces = spill_experts(layers, arch, torch.float32, "/tmp/spill")    # doctest: +SKIP
    >>> store = DiskStore(layers, pieces, torch.float32)                     # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from ._logging import progress
from .arch import MoEArch
from .checkpoint import CheckpointIndex, read_header
from .layout import ExpertPiece, MoELayer


def spill_experts(layers: list[MoELayer], arch: MoEArch, dtype: torch.dtype, folder: str
                  ) -> list[list[list[ExpertPiece]]]:
    """Write every expert of `layers` (still in their modules) to `folder`; return `pieces[layer][expert]`."""
    os.makedirs(folder, exist_ok=True)
    entries = {}
    for layer in progress(layers, desc="Writing experts to the offload folder", unit="layer"):
        tensors = {f"{layer.index}.{part}": torch.stack([arch.expert_tensors(layer.module, e)[part].to("cpu", dtype)
                                                          for e in range(layer.num_experts)]).contiguous()
                   for part, _ in layer.layout.parts}
        path = os.path.join(folder, f"experts-layer-{layer.index:05d}.safetensors")
        save_file(tensors, path)
        del tensors
        entries.update(read_header(path))
    index = CheckpointIndex(folder, entries)
    return [[[ExpertPiece(part, 0, index.locate(f"{layer.index}.{part}", row=e)) for part, _ in layer.layout.parts]
             for e in range(layer.num_experts)] for layer in layers]


def temporary_folder() -> str:
    """A fresh folder for spilled experts (the caller removes it with `remove_folder`)."""
    return tempfile.mkdtemp(prefix="hf_moe_offload_experts_")


def remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
