"""The model's own dense weights kept only as their packed CPU copies, their plain bytes left in the checkpoint's file.

On the CPU, the model's bias-free bfloat16 linear layers (attention projections, the head) compute through packed
oneDNN copies (`memory.cpu_kernels`), and transformers also holds each weight in memory: every such weight twice.
Here a weight whose checkpoint tensor holds exactly the loaded bytes becomes a private mapping of its file instead;
its copy is made at once, and the mapping's pages are handed back, so the copy is the weight's only memory. The
copy needs no budget of its own, also inside a container whose memory leaves none for copies. `state_dict()` reads
the file's bytes (the same bytes); `disable()` puts the weight back in memory from its copy.

It applies to weights of at least `MIN_BYTES` whose tensor has the parameter's name, dtype and shape in the
checkpoint's safetensors files and is not shared with another parameter, in a file that may be mapped
(`file_maps.file_mapping_refusal`); the bytes are compared before anything is replaced, so a weight
transformers changed on loading stays as it is.
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

from ..storage.checkpoint import CheckpointIndex
from ..storage.pages import release_pages
from .file_maps import FileMaps

logger = logging.getLogger(__name__)

MIN_BYTES = 1 << 20        # smaller weights save little, and a router's weight is held by the look-ahead as well


def map_dense_weights(model: nn.Module, layers: dict[str, nn.Linear], index: CheckpointIndex,
                      maps: FileMaps) -> list[nn.Linear]:
    """Replace the weight of each of `layers` (by module name) whose checkpoint tensor holds the same bytes by a
    private mapping of its file (in `maps`); the layers replaced. The loaded copy is freed once nothing else holds
    it."""
    shared = _shared_parameters(model)
    mapped = []
    for name, module in layers.items():
        weight = module.weight
        key = f"{name}.weight" if name else "weight"
        if id(weight) in shared or weight.numel() * weight.element_size() < MIN_BYTES or key not in index:
            continue
        entry = index.entries[key]
        if entry.dtype != weight.dtype or tuple(entry.shape) != tuple(weight.shape) or entry.offset % weight.itemsize:
            continue
        in_file = maps.tensor(entry)
        if in_file is None:
            continue
        if not torch.equal(in_file, weight.detach()):
            logger.debug("hf_moe_offload: %s differs from its checkpoint tensor; it stays in memory", key)
            release_pages(in_file)           # the comparison read them; the map stays for the file's other tensors
            continue
        module.weight = nn.Parameter(in_file, requires_grad=weight.requires_grad)
        mapped.append(module)
    return mapped


def _shared_parameters(model: nn.Module) -> set[int]:
    """The parameters reached by more than one name (tied weights)."""
    seen: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        seen[id(parameter)] = seen.get(id(parameter), 0) + 1
    return {key for key, count in seen.items() if count > 1}
