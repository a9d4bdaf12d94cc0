"""Read a GGUF checkpoint's layout (one file, or llama.cpp's split files `<name>-00001-of-0000N.gguf`): where every
tensor's bytes are, in which block type, and the byte range of one expert in a merged `ffn_*_exps` tensor.

GGUF stores a MoE layer's experts as one tensor per projection, `blk.<i>.ffn_{gate,up,down}_exps.weight` of shape
[E, rows, cols] (torch order) whose rows are whole blocks, so expert e's blocks are one contiguous byte range:
`offset + e * rows * row_bytes`. Only headers are parsed (by the `gguf` package's reader, which maps the file and
reads nothing else); an expert stored in a block type this package cannot dequantize is refused here, naming the
type and the supported ones, before anything is allocated.

Example:
    >>> index = GGUFIndex.open("model-Q4_K_M.gguf")                                  # doctest: +SKIP
    >>> index.expert_range("blk.0.ffn_down_exps.weight", expert=3).nbytes             # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

import torch

from ..policy.offload_policy import PolicyError
from .checkpoint import ByteRange, CheckpointError
from .gguf_blocks import GGML_TYPES_BY_ID, BlockType, supported_names
from .integrity import FileIdentity

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# A MoE layer's merged expert tensors, by projection.
EXPERT_TENSOR = "blk.{block}.ffn_{proj}_exps.weight"
_EXPERT_NAME = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF checkpoint: its file, absolute byte offset and size, shape (torch order) and ggml
    type (`kind` None when this package cannot dequantize it: `type_name` says which it is)."""

    name: str
    path: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    type_name: str
    kind: BlockType | None
    identity: FileIdentity | None = None


class GGUFIndex:
    """Every tensor of a GGUF checkpoint (all its split files), from their headers, and its metadata."""

    def __init__(self, files: list[str], tensors: dict[str, GGUFTensor], metadata: dict):
        self.files = files
        self.tensors = tensors
        self.metadata = metadata

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFIndex":
        """Index `path` and, when it is one of llama.cpp's split files, every file of the split (each must be
        present; a missing one is named)."""
        import gguf   # the optional `gguf` extra: only GGUF loads need it

        files = split_files(str(path))
        tensors, metadata = {}, {}
        for file in files:
            try:
                reader = gguf.GGUFReader(file)
            except (ValueError, struct.error, IndexError) as err:   # gguf's own errors on a short or damaged file
                raise CheckpointError(f"{file} is truncated or not a valid GGUF file ({err}); download it again") \
                    from None
            identity = FileIdentity.of(os.stat(file))
            size = os.path.getsize(file)
            if not metadata:
                metadata = {key: _field_value(field) for key, field in reader.fields.items()
                            if not key.startswith("tokenizer.")}
            for t in reader.tensors:
                kind = GGML_TYPES_BY_ID.get(int(t.tensor_type))
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                if int(t.data_offset) + int(t.n_bytes) > size:
                    raise CheckpointError(f"{file} is truncated: tensor {t.name} ends at byte "
                                          f"{int(t.data_offset) + int(t.n_bytes)}, the file has {size}; download "
                                          f"it again")
                tensors[t.name] = GGUFTensor(t.name, file, int(t.data_offset), int(t.n_bytes), shape,
                                             t.tensor_type.name, kind, identity)
        expected = metadata.get("split.tensors.count")
        if expected is not None and expected != len(tensors):
            raise CheckpointError(f"the split GGUF checkpoint {files[0]} announces {expected} tensors in "
                                  f"{len(files)} files, and its files hold {len(tensors)}")
        return cls(files, tensors, metadata)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def expert_tensor(self, block: int, proj: str, num_experts: int) -> GGUFTensor:
        """The merged tensor of `proj` ("gate", "up", "down") of block `block`, checked to hold `num_experts`
        experts in a block type this package dequantizes (a `PolicyError` naming the type otherwise)."""
        name = EXPERT_TENSOR.format(block=block, proj=proj)
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"GGUF checkpoint {self.files[0]} has no {name}: its experts are expected as "
                                  f"merged blk.N.ffn_{{gate,up,down}}_exps tensors [experts, rows, cols]")
        if t.kind is None:
            raise PolicyError(f"{name} in {t.path} is stored as ggml type {t.type_name}, which hf_moe_offload cannot "
                              f"dequantize per expert; supported block types: {supported_names()}. Use a GGUF "
                              f"file of another quantization (e.g. Q4_K_M, Q5_K_M, Q6_K, Q8_0)")
        if len(t.shape) != 3 or t.shape[0] != num_experts:
            raise CheckpointError(f"{name} in {t.path} has shape {list(t.shape)}; expected [{num_experts} experts, "
                                  f"rows, cols]")
        return t

    def expert_range(self, name: str, expert: int) -> ByteRange:
        """The bytes of expert `expert` of the merged tensor `name` [E, rows, cols] (contiguous: whole rows)."""
        t = self.tensors[name]
        if not 0 <= expert < t.shape[0]:
            raise CheckpointError(f"{name} has {t.shape[0]} experts, expert {expert} requested ({t.path})")
        per_expert = t.nbytes // t.shape[0]
        return ByteRange(t.path, t.offset + expert * per_expert, per_expert, torch.uint8, (per_expert,),
                         t.identity)


def is_expert_tensor(name: str) -> bool:
    """Whether `name` is a merged expert tensor (`blk.N.ffn_{gate,up,down}_exps.weight`)."""
    return _EXPERT_NAME.match(name) is not None


def split_files(path: str) -> list[str]:
    """`[path]`, or every file of the split `path` belongs to (`<stem>-0000i-of-0000N.gguf`, in order).

    Example:
        >>> split_files("/no/such/model.gguf")
        Traceback (most recent call last):
        ...
        hf_moe_offload.storage.checkpoint.CheckpointError: GGUF file '/no/such/model.gguf' does not exist
    """
    m = _SPLIT.match(path)
    files = [path] if m is None else [f"{m['stem']}-{i:05d}-of-{m['count']}.gguf"
                                      for i in range(1, int(m["count"]) + 1)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        what = "GGUF file" if m is None else f"split GGUF checkpoint ({len(files)} files): missing"
        raise CheckpointError(f"{what} {', '.join(repr(f) for f in missing)} does not exist" if m is None else
                              f"{what} {', '.join(os.path.basename(f) for f in missing)} (next to {path})")
    return files


def _field_value(field):
    """A scalar or string metadata value of the `gguf` reader (arrays are left as their length)."""
    if len(field.data) != 1:
        return len(field.data)
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8", errors="replace")
    return value.tolist()[0] if hasattr(value, "tolist") else value
