"""Write a built model's experts to disk for a disk store, so `enable(model, {"store": "disk"})` serves the weights
the model has in memory now, not whatever its original checkpoint holds (a fine-tuned or edited model would
otherwise silently run, and come back from `disable()`, with the checkpoint's experts).

One safetensors file per MoE layer, one [E, ...] tensor per slab part; the folder is the user's
(`enable(..., offload_folder=...)`) or a temporary one removed when the engine detaches or the process exits.

Quantized experts (`quantize="int8"|"int4"` with `store="disk"`) go to a quantized folder instead: written once by
`write_quantized`, reused by later loads while its fingerprint matches (`reuse_quantized`).

Example:
    >>> pieces = spill_experts(layers, arch.expert_tensors, torch.float32, "/tmp/spill")    # doctest: +SKIP
    >>> store = DiskStore(layers, pieces, torch.float32)                     # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Callable

import torch
from safetensors.torch import save_file

from .._logging import progress
from ..layout import ExpertPiece, ExpertTensors, MoELayer
from .checkpoint import CheckpointError, CheckpointIndex, read_header
from .quantize import QuantizedSlabLayout, packing_signature

logger = logging.getLogger(__name__)


def spill_experts(layers: list[MoELayer], expert_tensors: ExpertTensors, dtype: torch.dtype, folder: str
                  ) -> list[list[list[ExpertPiece]]]:
    """Write every expert of `layers` (still in their modules) to `folder`; return `pieces[layer][expert]`.
    `expert_tensors(module, e)`: one expert's tensors by slab part name (`MoEArch.expert_tensors`)."""
    os.makedirs(folder, exist_ok=True)
    entries = {}
    for layer in progress(layers, desc="Writing experts to the offload folder", unit="layer"):
        tensors = {f"{layer.index}.{part}": torch.stack([expert_tensors(layer.module, e)[part].to("cpu", dtype)
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


# -- quantized experts on disk ------------------------------------------------------------------------------------
#
# A quantized folder holds one safetensors file per MoE layer with one uint8 tensor [E, slab bytes] (each row one
# expert's quantized slab, in the packing its layout computes with) and a manifest written last: its fingerprint
# says what the files were made from (source shards' names, sizes and mtimes; method, group size, dtype, shapes,
# packing), its sizes let a later load check
# the files are whole. A folder whose manifest is missing, different or disagrees with the files is rebuilt.

QUANTIZED_FORMAT = 2       # 2: slabs stored in the layout's packing (1: always plain, repacked at every read)
MANIFEST = "hf_moe_offload_quantized.json"


def quantized_cache_root() -> str:
    """Where quantized folders go when no `offload_folder=` is given: $HF_MOE_OFFLOAD_CACHE, else
    ~/.cache/hf_moe_offload (a folder per fingerprint under its "quantized/")."""
    root = os.environ.get("HF_MOE_OFFLOAD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "hf_moe_offload")
    return os.path.join(root, "quantized")


def quantized_fingerprint(source_files: list[str], layouts: list[QuantizedSlabLayout]) -> str:
    """A short hash of what a quantized folder is made from (`source_files`: the checkpoint's shards)."""
    sources = []
    for path in sorted(set(source_files)):
        st = os.stat(path)
        sources.append([os.path.basename(path), st.st_size, st.st_mtime_ns])
    first = layouts[0]
    what = {"format": QUANTIZED_FORMAT, "sources": sources, "quantize": first.method, "group_size": first.group_size,
            "dtype": str(first.compute_dtype), "shapes": [[list(map(list, lay.parts))] for lay in layouts],
            "packing": packing_signature(layouts)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def reuse_quantized(folder: str, fingerprint: str, layouts: list[QuantizedSlabLayout], num_experts: list[int]
                    ) -> list[list[list[ExpertPiece]]] | None:
    """`pieces[layer][expert]` of a complete quantized folder made for `fingerprint`, or None (with the reason
    logged) when it is missing, made for something else, partial or corrupt."""
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.exists(manifest_path):
        return None
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("fingerprint") != fingerprint:
            logger.info("hf_moe_offload: quantized folder %s was made from other weights or settings; rebuilding",
                        folder)
            return None
        entries = {}
        for name, size in manifest["files"].items():
            path = os.path.join(folder, name)
            if os.path.getsize(path) != size:
                raise CheckpointError(f"{path} has {os.path.getsize(path)} bytes, the manifest says {size}")
            entries.update(read_header(path))
        pieces = _quantized_pieces(CheckpointIndex(folder, entries), layouts, num_experts)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        logger.warning("hf_moe_offload: quantized folder %s is incomplete or corrupt (%s); rebuilding it", folder,
                       err)
        return None
    return pieces


def write_quantized(folder: str, fingerprint: str, layouts: list[QuantizedSlabLayout], num_experts: list[int],
                    read_expert: Callable[[int, int], dict[str, torch.Tensor]]) -> list[list[list[ExpertPiece]]]:
    """Quantize every expert (`read_expert(layer, expert)` -> dense parts) into `folder`, replacing what a previous
    build left there; the manifest is written last, so an interrupted build is never taken for a complete one."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if name == MANIFEST or (name.startswith("quantized-layer-") and name.endswith(".safetensors")):
            os.remove(os.path.join(folder, name))
    files = {}
    for layer in progress(range(len(layouts)), desc="Quantizing experts to disk", unit="layer"):
        layout = layouts[layer]       # stored as computed (torch's CPU int4 format for the CPU): no repack per read
        slabs = torch.empty(num_experts[layer], layout.numel, dtype=torch.uint8)   # [E, slab bytes]
        for e in range(num_experts[layer]):
            layout.quantize_into(read_expert(layer, e), slabs[e])
        name = f"quantized-layer-{layer:05d}.safetensors"
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
        save_file({str(layer): slabs}, tmp)
        os.replace(tmp, os.path.join(folder, name))
        files[name] = os.path.getsize(os.path.join(folder, name))
        del slabs
    tmp = os.path.join(folder, f".{MANIFEST}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump({"fingerprint": fingerprint, "format": QUANTIZED_FORMAT, "files": files}, f)
    os.replace(tmp, os.path.join(folder, MANIFEST))
    entries = {}
    for name in files:
        entries.update(read_header(os.path.join(folder, name)))
    return _quantized_pieces(CheckpointIndex(folder, entries), layouts, num_experts)


def _quantized_pieces(index: CheckpointIndex, layouts: list[QuantizedSlabLayout], num_experts: list[int]
                      ) -> list[list[list[ExpertPiece]]]:
    pieces = []
    for layer, (layout, n) in enumerate(zip(layouts, num_experts)):
        entry = index.entries.get(str(layer))
        if entry is None or entry.dtype != torch.uint8 or entry.shape != (n, layout.numel):
            raise CheckpointError(f"quantized folder {index.root}: layer {layer} should be a uint8 tensor "
                                  f"{[n, layout.numel]}, found {entry and (entry.dtype, list(entry.shape))}")
        pieces.append([[ExpertPiece("slab", 0, index.locate(str(layer), row=e))] for e in range(n)])
    return pieces
