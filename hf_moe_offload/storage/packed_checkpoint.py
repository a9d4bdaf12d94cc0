"""Find the packed linear layers of a GPTQ, AWQ or compressed-tensors checkpoint from its safetensors headers.

`PackedCheckpointIndex` is a `CheckpointIndex` in which every packed layer `<module>` (tensors `<module>.qweight`,
`.qzeros`, `.scales` [, `.g_idx`], or `<module>.weight_packed`, `.weight_scale` [, `.weight_zero_point`],
`.weight_shape`) also appears as the dense weight `<module>.weight` [out, in] it stands for, in its scales' dtype.
The model families' own checkpoint lookups (`MoEArch.locate_expert`) therefore find a packed expert as they find a
dense one; `locate` returns a `PackedSource` for it, which names the packed tensors' byte ranges. Every packed
layer's tensors are checked (present, dtypes, shapes for the format) when the index is opened, before anything is
allocated; a problem is a `CheckpointError` naming the tensor and what is expected.

Example:
    >>> index = PackedCheckpointIndex.open("path/to/gptq-model", PackedFormat("gptq", 4, 128, zero_offset=1))  # doctest: +SKIP
    >>> index.locate("model.layers.0.block_sparse_moe.experts.3.w1.weight").module                             # doctest: +SKIP
    'model.layers.0.block_sparse_moe.experts.3.w1'
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from .checkpoint import SCALE_DTYPES, ByteRange, CheckpointError, CheckpointIndex, TensorEntry, pread_exact
from .packed_int import PackedFormat

_CODE_SUFFIX = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}
_INT_TENSORS = {"qweight": (torch.int32,), "qzeros": (torch.int32,), "g_idx": (torch.int32,),
                "weight_packed": (torch.int32,), "weight_zero_point": (torch.int32, torch.int8)}


@dataclass(frozen=True)
class PackedSource(ByteRange):
    """The dense weight [out, in] a packed linear layer stands for (`shape`, `dtype`: its scales' dtype; `path`,
    `offset`: where its codes are), with the byte ranges of the packed tensors (`tensors`, by suffix) that hold it."""

    module: str = ""
    tensors: tuple[tuple[str, ByteRange], ...] = ()


class PackedCheckpointIndex(CheckpointIndex):
    """A `CheckpointIndex` over a checkpoint of packed integer weights in `fmt` (see the module docstring).

    `packed`: `<module>` -> its `PackedSource`, for every packed layer (experts and the rest of the model)."""

    def __init__(self, root: str, entries: dict[str, TensorEntry], fmt: PackedFormat,
                 packed: dict[str, PackedSource]):
        super().__init__(root, entries)
        self.format = fmt
        self.packed = packed

    @classmethod
    def open(cls, root: str | os.PathLike, fmt: PackedFormat,   # type: ignore[override]
             variant: str | None = None) -> "PackedCheckpointIndex":
        plain = CheckpointIndex.open(root, variant=variant)
        entries = dict(plain.entries)
        suffix = "." + _CODE_SUFFIX[fmt.method]
        modules = [key.removesuffix(suffix) for key in plain.entries if key.endswith(suffix)]
        if not modules:
            raise CheckpointError(f"checkpoint {plain.root} has no {fmt.method} packed weights (no tensor named "
                                  f"<module>{suffix}), but its config's quantization_config says quant_method="
                                  f"{fmt.method!r}")
        if fmt.method == "gptq" and any(f"{m}.g_idx" in entries for m in modules):
            fmt = dataclasses.replace(fmt, act_order=True)     # read the group of every input from g_idx
        widths = _compressed_widths(plain, modules) if fmt.method == "compressed-tensors" else {}
        packed = {}
        for module in modules:
            source = _packed_source(plain, module, fmt, widths.get(module))
            packed[module] = source
            if f"{module}.weight" in entries:
                raise CheckpointError(f"checkpoint {plain.root} holds both {module}.weight and the packed "
                                      f"{module}{suffix}: one layer stored twice")
            entries[f"{module}.weight"] = TensorEntry(source.path, source.offset, source.dtype, source.shape,
                                                      source.identity)
        return cls(plain.root, entries, fmt, packed)

    def locate(self, key: str, row: int | None = None) -> ByteRange:
        """`CheckpointIndex.locate`; for a packed layer's dense weight `<module>.weight`, its `PackedSource`."""
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module in self.packed:
            if row is not None:
                raise CheckpointError(f"{key} is a packed {self.format.method} layer ({self.packed[module].path}); "
                                      f"packed experts are read from per-expert layers, not rows of a fused tensor")
            return self.packed[module]
        return super().locate(key, row)


def _packed_source(index: CheckpointIndex, module: str, fmt: PackedFormat, width: int | None) -> PackedSource:
    """The `PackedSource` of `module`, every tensor checked against `fmt`."""
    names = fmt.tensor_names()
    missing = [f"{module}.{n}" for n in names if f"{module}.{n}" not in index.entries]
    if missing:
        raise CheckpointError(f"checkpoint {index.root} has no {', '.join(missing)}: a {_describe(fmt)} layer is "
                              f"stored as {', '.join(f'{module}.{n}' for n in names)}")
    entries = {n: index.entries[f"{module}.{n}"] for n in names}
    dense = fmt.dense_shape({n: e.shape for n, e in entries.items()})
    if dense is None:
        raise CheckpointError(f"{module}.{names[0]} in {entries[names[0]].path} has shape "
                              f"{list(entries[names[0]].shape)}; packed codes are int32 matrices")
    if width is not None:
        dense = (dense[0], width)
    want = fmt.tensor_shapes(*dense)
    zero_points = entries.get("weight_zero_point")
    if zero_points is not None and zero_points.dtype == torch.int8:     # one int8 per output row, not packed
        want["weight_zero_point"] = (dense[0], want["weight_scale"][1])
    for name, entry in entries.items():
        dtypes = _INT_TENSORS.get(name, SCALE_DTYPES)
        if entry.dtype not in dtypes or tuple(entry.shape) != want[name]:
            raise CheckpointError(
                f"{module}.{name} in {entry.path} is {entry.dtype} {list(entry.shape)}, but a {_describe(fmt)} "
                f"layer of {dense[0]} outputs x {dense[1]} inputs (the size {names[0]} "
                f"{list(entries[names[0]].shape)} gives) needs {' or '.join(map(str, dtypes))} {list(want[name])}; "
                f"one of the two is damaged, or the layer was quantized with other settings than the config's")
    scales = entries["weight_scale" if fmt.method == "compressed-tensors" else "scales"]
    codes = entries[names[0]]
    ranges = tuple((name, index.locate(f"{module}.{name}")) for name in names)
    return PackedSource(codes.path, codes.offset, codes.nbytes, scales.dtype, dense, codes.identity, module=module,
                        tensors=ranges)


def _describe(fmt: PackedFormat) -> str:
    group = "per channel" if fmt.group_size == -1 else f"group_size {fmt.group_size}"
    return f"{fmt.method} {fmt.bits}-bit ({group})"


def _compressed_widths(index: CheckpointIndex, modules: list[str]) -> dict[str, int]:
    """compressed-tensors' exact input width of each packed layer: the second value of `<module>.weight_shape`
    (int64 [2]), read from the files (a few bytes per layer, one open file at a time)."""
    widths, by_file = {}, {}
    for module in modules:
        key = f"{module}.weight_shape"
        if key not in index.entries:
            raise CheckpointError(f"checkpoint {index.root} has no {key}: compressed-tensors packed layers store "
                                  f"their dense shape there (int64 [2])")
        entry = index.entries[key]
        if entry.shape != (2,) or entry.dtype not in (torch.int64, torch.int32):
            raise CheckpointError(f"{key} in {entry.path} is {entry.dtype} {list(entry.shape)}; expected int64 [2]")
        by_file.setdefault(entry.path, []).append((module, index.locate(key)))
    for path, ranges in by_file.items():
        fd = os.open(path, os.O_RDONLY)
        try:
            for module, rng in ranges:
                value = torch.empty(2, dtype=rng.dtype)
                pread_exact(rng, memoryview(value.view(torch.uint8).numpy()), fd)
                widths[module] = int(value[1])
        finally:
            os.close(fd)
    return widths


def read_packed(source: PackedSource) -> dict[str, torch.Tensor]:
    """The packed tensors of one layer, read from its files (by suffix, each as its checkpoint dtype and shape)."""
    out, fds = {}, {}
    try:
        for name, rng in source.tensors:
            if rng.path not in fds:
                fds[rng.path] = os.open(rng.path, os.O_RDONLY)
            tensor = torch.empty(rng.shape, dtype=rng.dtype)
            pread_exact(rng, memoryview(tensor.reshape(-1).view(torch.uint8).numpy()), fds[rng.path])
            out[name] = tensor
    finally:
        for fd in fds.values():
            os.close(fd)
    return out
