"""The input embedding table read in place from the checkpoint's file (policy `embedding="mapped"`).

A decode step looks up one row of the table per token, yet transformers loads the whole table into memory: 65 MB
for a 32k x 1024 bfloat16 table, over 600 MB for a 150k-token vocabulary. Mapped from its safetensors file
instead (a private, read-only-in-effect memory map), the table costs only the pages of the rows looked up, which
the kernel reads on first use and may drop and re-read; "auto" gives the memory it saves to the expert cache. The
values are the file's bytes, so the model's outputs are unchanged.

It applies where a row lookup is all the table serves: the CPU device, no device map, a table not shared with
another module (an output layer tied to it reads every row each token), stored in the checkpoint at the model's
dtype.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

from ..policy.offload_policy import AUTO, OffloadPolicy, PolicyError
from ..storage.checkpoint import CheckpointIndex, TensorEntry
from ..storage.pages import MADV_RANDOM, advise
from .file_maps import FileMaps, file_mapping_refusal


def plan_mapped_embedding(policy: OffloadPolicy, skeleton: nn.Module, index: CheckpointIndex | None,
                          dtype: torch.dtype, device: torch.device, device_map_given: bool,
                          disable_mmap: bool = False) -> TensorEntry | None:
    """The table's entry in the checkpoint (file, offset, dtype, shape) to map, or None to keep it in memory.
    `policy.embedding="mapped"` where it cannot be mapped is refused with the reason (before anything is loaded).
    `disable_mmap`: `from_pretrained(disable_mmap=True)`, the user's word that the files are not to be mapped."""
    if policy.embedding == "memory":
        return None
    location, reason = _locate(skeleton, index, dtype, device, device_map_given)
    if reason is None:
        reason = file_mapping_refusal(location.path, disable_mmap)
        location = None if reason is not None else location
    if reason is not None and policy.embedding != AUTO:
        raise PolicyError(f"embedding='mapped' is not possible here: {reason}; use embedding='memory' or 'auto'")
    return location


def map_input_embedding(model: nn.Module, plan: TensorEntry, required: bool, maps: FileMaps) -> bool:
    """Replace the loaded table of `model` by its mapping in `maps` (the loaded copy is freed); whether it did. A
    table that transformers loaded in another dtype or shape than planned stays loaded, or is refused if
    `required`."""
    module = model.get_input_embeddings()
    weight = module.weight
    if weight.dtype != plan.dtype or tuple(weight.shape) != tuple(plan.shape):
        if required:
            raise PolicyError(f"embedding='mapped': the model's table is {weight.dtype} {tuple(weight.shape)}, the "
                              f"checkpoint's {plan.dtype} {tuple(plan.shape)} ({plan.path}); use embedding='memory' or "
                              f"'auto'")
        return False
    table = maps.tensor(plan)
    if table is None:       # planned with the same refusal rule: only if the file moved under an hf-mount since
        return False
    # Rows are looked up one by one: a page fault should read its page, not the kernel's read-ahead around it
    # (neighbouring rows, or the experts beside the table in its file, which a direct-read store keeps out of the
    # page cache).
    start = table.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE          # madvise takes whole pages
    advise(start, table.data_ptr() + table.nbytes - start, MADV_RANDOM)
    module.weight = nn.Parameter(table, requires_grad=weight.requires_grad)
    return True


def load_input_embedding(model: nn.Module) -> None:
    """Read the mapped table into memory, as transformers loads it (`disable()`: the model is its own again)."""
    module = model.get_input_embeddings()
    with torch.inference_mode(False):         # a parameter the caller may train, even if disabled under it
        table = module.weight.detach().clone()
    module.weight = nn.Parameter(table, requires_grad=module.weight.requires_grad)


def _locate(skeleton: nn.Module, index: CheckpointIndex | None, dtype: torch.dtype, device: torch.device,
            device_map_given: bool) -> tuple[TensorEntry | None, str | None]:
    """The table's place in the checkpoint, or why it cannot be mapped."""
    if device.type != "cpu":
        return None, f"the device is {device} (a mapped table is read on the CPU)"
    if device_map_given:
        return None, "a device_map places the model's modules"
    if index is None:
        return None, ("the table is not loaded from a safetensors file as stored (a GGUF file, or a GPTQ, AWQ or "
                      "compressed-tensors checkpoint, whose layers transformers loads dequantized)")
    table = skeleton.get_input_embeddings()
    weight = getattr(table, "weight", None)
    if not isinstance(table, nn.Embedding) or weight is None:
        return None, f"the input embedding is a {type(table).__name__}, not an nn.Embedding"
    names = [n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is weight]
    if len(names) > 1:       # tied to the output layer (which reads every row each token) or shared between stacks
        return None, f"the table is shared: {', '.join(names)}"
    name = names[0] if names else None
    if name is None or name not in index:
        return None, f"the checkpoint has no tensor named {name!r} for it"
    entry = index.entries[name]
    if entry.dtype != dtype or tuple(entry.shape) != tuple(weight.shape):
        return None, (f"the checkpoint stores it as {entry.dtype} {tuple(entry.shape)}, the model needs {dtype} "
                      f"{tuple(weight.shape)}")
    if entry.offset % dtype.itemsize:
        return None, f"its bytes in {entry.path} are not aligned to its {dtype}"
    return entry, None
