"""Write a built model's experts to disk for a disk store, so `enable(model, {"store": "disk"})` serves the weights
the model has in memory now, not whatever its original checkpoint holds (a fine-tuned or edited model would
otherwise silently run, and come back from `disable()`, with the checkpoint's experts).

One safetensors file per MoE layer, one [E, ...] tensor per slab part; the folder is the user's
(`enable(..., offload_folder=...)`) or a temporary one removed when the engine detaches, the process exits, or
(after a kill) the next process makes one (`folders.temporary_folder`).

Quantized experts (`quantize="int8"|"int4"` with `store="disk"`) go to a quantized folder instead: written once by
`write_quantized`, reused by later loads while its fingerprint matches (`reuse_quantized`).

Both kinds of folder are built under the folder's exclusive lock into files with a new generation tag, then a
manifest naming them and every expert's checksum is swapped in atomically; files of older generations are removed
afterwards (a store that has them open keeps reading them: nothing in use is ever rewritten).

Example:
    >>> store = spill_store(layers, arch.expert_tensors, torch.float32, "/tmp/spill")    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .._logging import progress
from ..layout import ExpertPiece, ExpertTensors, MoELayer
from .checkpoint import CheckpointError, CheckpointIndex, header_digest, read_header
from .folders import (
    check_free_space,
    folder_lock,
    new_generation,
    remove_stale_temps,
    write_json,
    write_safetensors,
)
from .integrity import ExpertChecksums, expert_digest
from .quantize import QuantizedSlabLayout, packing_signature
from .store import DiskStore

logger = logging.getLogger(__name__)

SPILL_MANIFEST = "hf_moe_offload_experts.json"
_SPILL_FILE = re.compile(r"experts-layer-\d{5}(-[0-9a-f]+)?\.safetensors")
_HEADER_SLACK = 1 << 16      # bytes per file beyond its tensors (header), for the free-space check


@dataclass
class FolderContents:
    """What a folder's manifest names: each expert's pieces, their checksums, and the files holding them."""

    pieces: list[list[list[ExpertPiece]]]
    checksums: ExpertChecksums
    files: list[str]


def spill_store(layers: list[MoELayer], expert_tensors: ExpertTensors, dtype: torch.dtype, folder: str
                ) -> DiskStore:
    """Write every expert of `layers` (still in their modules) to `folder` and open a store on them.
    `expert_tensors(module, e)`: one expert's tensors by slab part name (`MoEArch.expert_tensors`)."""
    os.makedirs(folder, exist_ok=True)
    needed = sum(lay.layout.numel * dtype.itemsize * lay.num_experts + _HEADER_SLACK for lay in layers)
    with folder_lock(folder):
        remove_stale_temps(folder)
        check_free_space(folder, needed)
        generation, written, digests, files = new_generation(), [], [], {}
        try:
            for layer in progress(layers, desc="Writing experts to the offload folder", unit="layer"):
                tensors = {f"{layer.index}.{part}": torch.stack([expert_tensors(layer.module, e)[part].to("cpu", dtype)
                                                                  for e in range(layer.num_experts)]).contiguous()
                           for part, _ in layer.layout.parts}
                name = f"experts-layer-{layer.index:05d}-{generation}.safetensors"
                written.append(write_safetensors(folder, name, tensors, needed))
                digests.append([expert_digest([_bytes(t[e]) for t in tensors.values()])
                                for e in range(layer.num_experts)])
                files[name] = {"size": os.path.getsize(written[-1]), "experts": digests[-1]}
                del tensors
            write_json(folder, SPILL_MANIFEST, {"format": 1, "generation": generation, "files": files})
            index = _index(folder, list(files))
            pieces = [[[ExpertPiece(part, 0, index.locate(f"{layer.index}.{part}", row=e))
                        for part, _ in layer.layout.parts] for e in range(layer.num_experts)] for layer in layers]
            rebuild = ("the model's experts cannot be read back from it: load the model again (and enable it again "
                       "to write a fresh copy)")
            store = DiskStore(layers, pieces, dtype, checksums=ExpertChecksums(digests, folder, rebuild))
        except BaseException:
            _unlink_all(written)
            raise
        _remove_other_generations(folder, _SPILL_FILE, keep=files)
    return store


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _index(folder: str, names: Sequence[str]) -> CheckpointIndex:
    entries = {}
    for name in names:
        entries.update(read_header(os.path.join(folder, name)))
    return CheckpointIndex(folder, entries)


def _unlink_all(paths: Sequence[str]) -> None:
    """Remove the files a failed build finished (they are named by no manifest)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _remove_other_generations(folder: str, pattern: re.Pattern, keep) -> None:
    """Remove the library's files in `folder` that the new manifest does not name (with the exclusive lock held;
    a store that has one open keeps reading it until it closes)."""
    for name in os.listdir(folder):
        if pattern.fullmatch(name) and name not in keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))


# -- quantized experts on disk ------------------------------------------------------------------------------------
#
# A quantized folder holds one safetensors file per MoE layer with one uint8 tensor [E, slab bytes] (each row one
# expert's quantized slab, in the packing its layout computes with) and a manifest written last: its fingerprint
# says what the files were made from (source shards' resolved paths, identities and header digests; method, group
# size, dtype, shapes, packing), its sizes let a later load check the files are whole, and its checksums (one per
# expert) are checked at each expert's first read. A folder whose manifest is missing, different or disagrees
# with the files is rebuilt.

QUANTIZED_FORMAT = 3       # 3: generation-tagged files, per-expert checksums (2: no checksums; 1: plain packing)
MANIFEST = "hf_moe_offload_quantized.json"
_QUANTIZED_FILE = re.compile(r"quantized-layer-\d{5}(-[0-9a-f]+)?\.safetensors")


def quantized_cache_root() -> str:
    """Where quantized folders go when no `offload_folder=` is given: $HF_MOE_OFFLOAD_CACHE, else
    ~/.cache/hf_moe_offload (a folder per fingerprint under its "quantized/")."""
    root = os.environ.get("HF_MOE_OFFLOAD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "hf_moe_offload")
    return os.path.join(root, "quantized")


def quantized_fingerprint(source_files: list[str], layouts: list[QuantizedSlabLayout]) -> str:
    """A short hash of what a quantized folder is made from (`source_files`: the checkpoint's shards, each by its
    resolved path, device, inode, size, mtime and header digest: two checkpoints alike in name, size and mtime
    still differ)."""
    sources = []
    for path in sorted(set(source_files)):
        st = os.stat(path)
        sources.append([os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                        header_digest(path)])
    first = layouts[0]
    what = {"format": QUANTIZED_FORMAT, "sources": sources, "quantize": first.method, "group_size": first.group_size,
            "dtype": str(first.compute_dtype), "shapes": [[list(map(list, lay.parts))] for lay in layouts],
            "packing": packing_signature(layouts)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def quantized_folder_store(folder: str, fingerprint: str, layouts: list[QuantizedSlabLayout],
                           layers: list[MoELayer], dtype: torch.dtype,
                           read_expert: Callable[[int, int], dict[str, torch.Tensor]], reuse: bool = True
                           ) -> DiskStore:
    """A store over the quantized folder `folder`: reused when it was made for `fingerprint` (and `reuse`), else
    built (under the folder's lock: a concurrent builder of the same folder waits, then reuses this build)."""
    num_experts = [lay.num_experts for lay in layers]
    os.makedirs(folder, exist_ok=True)
    if reuse:
        with folder_lock(folder, shared=True):     # no build swaps the files between the manifest and the opens
            found = reuse_quantized(folder, fingerprint, layouts, num_experts)
            if found is not None:
                return DiskStore(layers, found.pieces, dtype, layouts=layouts, checksums=found.checksums)
    with folder_lock(folder):
        found = reuse_quantized(folder, fingerprint, layouts, num_experts, quiet=True) if reuse else None
        if found is None:                          # (else another process built it while this one waited)
            remove_stale_temps(folder)
            logger.info("hf_moe_offload: quantizing experts (%s) into %s", layouts[0].method, folder)
            found = write_quantized(folder, fingerprint, layouts, num_experts, read_expert)
        store = DiskStore(layers, found.pieces, dtype, layouts=layouts, checksums=found.checksums)
        _remove_other_generations(folder, _QUANTIZED_FILE, keep=found.files)
    return store


def reuse_quantized(folder: str, fingerprint: str, layouts: list[QuantizedSlabLayout], num_experts: list[int],
                    quiet: bool = False) -> FolderContents | None:
    """The contents of a complete quantized folder made for `fingerprint`, or None (with the reason logged unless
    `quiet`) when it is missing, made for something else or by an older version, partial or corrupt."""
    log = (lambda *args: None) if quiet else logger.info
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.exists(manifest_path):
        return None
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("format") != QUANTIZED_FORMAT:
            log("hf_moe_offload: quantized folder %s was written by an older version of hf_moe_offload (without "
                "checksums); rebuilding it", folder)
            return None
        if manifest.get("fingerprint") != fingerprint:
            log("hf_moe_offload: quantized folder %s was made from other weights or settings; rebuilding", folder)
            return None
        for name, info in manifest["files"].items():
            path = os.path.join(folder, name)
            if os.path.getsize(path) != info["size"]:
                raise CheckpointError(f"{path} has {os.path.getsize(path)} bytes, the manifest says {info['size']}")
        digests = [list(info["experts"]) for info in manifest["files"].values()]
        if [len(d) for d in digests] != list(num_experts):
            raise CheckpointError(f"the manifest lists {[len(d) for d in digests]} checksums per layer")
        pieces = _quantized_pieces(_index(folder, list(manifest["files"])), layouts, num_experts)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        if not quiet:
            logger.warning("hf_moe_offload: quantized folder %s is incomplete or corrupt (%s); rebuilding it",
                           folder, err)
        return None
    return FolderContents(pieces, _quantized_checksums(folder, digests, manifest["generation"]),
                          list(manifest["files"]))


def _quantized_checksums(folder: str, digests: list[list[str]], generation: str) -> ExpertChecksums:
    def forget(path: str) -> None:
        """A damaged file: drop the manifest naming it, so that the next load rebuilds the folder."""
        with contextlib.suppress(OSError, ValueError), open(os.path.join(folder, MANIFEST)) as f:
            if json.load(f).get("generation") == generation:
                os.unlink(os.path.join(folder, MANIFEST))
                logger.warning("hf_moe_offload: %s is damaged; removed the manifest of %s so that the next load "
                               "rebuilds it", path, folder)

    return ExpertChecksums(digests, folder, f"load the model again to rebuild {folder} (or delete that folder)",
                           on_mismatch=forget)


def write_quantized(folder: str, fingerprint: str, layouts: list[QuantizedSlabLayout], num_experts: list[int],
                    read_expert: Callable[[int, int], dict[str, torch.Tensor]]) -> FolderContents:
    """Quantize every expert (`read_expert(layer, expert)` -> dense parts) into new files in `folder` and swap in a
    manifest naming them (written last: an interrupted build is never taken for a complete one). Call it with the
    folder's exclusive lock held (`quantized_folder_store` does); a failed build removes the files it wrote."""
    os.makedirs(folder, exist_ok=True)
    needed = sum(lay.numel * n + _HEADER_SLACK for lay, n in zip(layouts, num_experts))
    check_free_space(folder, needed)
    generation, written, digests, files = new_generation(), [], [], {}
    try:
        for layer in progress(range(len(layouts)), desc="Quantizing experts to disk", unit="layer"):
            layout = layouts[layer]    # stored as computed (torch's CPU int4 format for the CPU): no repack per read
            slabs = torch.empty(num_experts[layer], layout.numel, dtype=torch.uint8)   # [E, slab bytes]
            for e in range(num_experts[layer]):
                layout.quantize_into(read_expert(layer, e), slabs[e])
            name = f"quantized-layer-{layer:05d}-{generation}.safetensors"
            written.append(write_safetensors(folder, name, {str(layer): slabs}, needed))
            digests.append([expert_digest([_bytes(slabs[e])]) for e in range(num_experts[layer])])
            files[name] = {"size": os.path.getsize(written[-1]), "experts": digests[-1]}
            del slabs
        write_json(folder, MANIFEST, {"fingerprint": fingerprint, "format": QUANTIZED_FORMAT,
                                      "generation": generation, "files": files})
        pieces = _quantized_pieces(_index(folder, list(files)), layouts, num_experts)
    except BaseException:
        _unlink_all(written)
        raise
    return FolderContents(pieces, _quantized_checksums(folder, digests, generation), list(files))


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
