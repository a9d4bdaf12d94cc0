"""Model-family adapters: where the MoE layers are, how an expert's tensors pack into one slab, where its bytes are
in the checkpoint, and how the offloaded forward is attached and detached.

One adapter serves every family with transformers' fused experts (`ExpertsInterface`); Switch Transformers has its
own. `get_arch(config)` picks one or lists the supported model types.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..checkpoint import ByteRange, CheckpointError, CheckpointIndex

if TYPE_CHECKING:
    from ..engine import LayerRuntime


class UnsupportedModelError(ValueError):
    """The model has no MoE layers, or its architecture is not supported; the message lists the supported ones."""


@dataclass(frozen=True)
class SlabLayout:
    """How one expert's tensors sit in its contiguous slab: (name, shape) parts, back to back."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        return sum(_numel(shape) for _, shape in self.parts)

    def views(self, slab: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into a flat slab (zero-copy)."""
        out, start = {}, 0
        for name, shape in self.parts:
            n = _numel(shape)
            out[name] = slab[start:start + n].view(shape)
            start += n
        return out


@dataclass(frozen=True)
class ExpertPiece:
    """A checkpoint byte range that fills rows [row, row + n) of one slab part."""

    part: str
    row: int
    source: ByteRange


@dataclass
class MoELayer:
    """One MoE layer of a built model: its experts module and where that module sits."""

    index: int                     # position among the model's MoE layers
    name: str                      # module path of the experts module, e.g. "model.layers.3.mlp.experts"
    module: nn.Module
    num_experts: int
    top_k: int
    layout: SlabLayout
    extra: dict = field(default_factory=dict)


class MoEArch(ABC):
    """What the engine needs to know about one model family."""

    model_types: tuple[str, ...] = ()

    @abstractmethod
    def is_experts_module(self, module: nn.Module) -> bool: ...

    @abstractmethod
    def layout(self, module: nn.Module) -> SlabLayout: ...

    @abstractmethod
    def top_k(self, config) -> int: ...

    @abstractmethod
    def expert_pieces(self, index: CheckpointIndex, name: str, expert: int, layout: SlabLayout
                      ) -> list[ExpertPiece]:
        """Where expert `expert` of the experts module `name` is in the checkpoint."""

    @abstractmethod
    def expert_tensors(self, module: nn.Module, expert: int) -> dict[str, torch.Tensor]:
        """The expert's tensors as they are in a built (not offloaded) module, by slab part name."""

    @abstractmethod
    def set_expert_params(self, module: nn.Module, stacked: dict[str, torch.Tensor]) -> None:
        """Give the module real parameters again from per-part tensors stacked over experts [E, ...]."""

    @abstractmethod
    def release_expert_params(self, module: nn.Module) -> None:
        """Release the module's expert parameters (`release_parameter`): their bytes now live in the store."""

    @abstractmethod
    def attach(self, model: nn.Module, layer: MoELayer, runtime: "LayerRuntime") -> None: ...

    @abstractmethod
    def detach(self, model: nn.Module, layer: MoELayer) -> None: ...

    # -- routing: what prefetchers and predictors hook into ----------------------------------------------------

    @abstractmethod
    def router_module(self, model: nn.Module, layer: MoELayer) -> nn.Module:
        """The module that routes tokens to `layer`'s experts (a forward hook on it sees every decision)."""

    @abstractmethod
    def router_logits(self, output) -> torch.Tensor:
        """Router logits [tokens, E] from the router module's forward output."""

    @abstractmethod
    def routing_from_logits(self, router: nn.Module, logits: torch.Tensor, output):
        """A replacement for the router's forward `output` in which `logits` [tokens, E] decide, computed the way
        the router computes its own (softmax, top-k, renormalisation): used by predicted routing."""

    def routes_input_ids(self, layer: MoELayer) -> bool:
        """Whether `layer` routes the tokens of the model's `input_ids` (not, e.g., an encoder-decoder's decoder)."""
        return True

    def find_layers(self, model: nn.Module) -> list[MoELayer]:
        engine = getattr(model, "_hf_moe_offload_engine", None)
        if engine is not None:     # offloaded: some experts modules (Switch) are no longer in the module tree
            return list(engine.layers)
        layers = []
        for name, module in model.named_modules():
            if not self.is_experts_module(module):
                continue
            layers.append(MoELayer(index=len(layers), name=name, module=module,
                                   num_experts=_num_experts(module), top_k=self.top_k(model.config),
                                   layout=self.layout(module)))
        if not layers:
            raise UnsupportedModelError(f"{type(model).__name__} has no MoE layers that hf_moe_offload can offload; "
                                        f"supported model types: {supported_model_types()}")
        return layers

    def locate_expert(self, index: CheckpointIndex, name: str, expert: int, layout: SlabLayout
                      ) -> list[ExpertPiece]:
        """`expert_pieces`, checked to fill the whole slab with matching shapes."""
        pieces = self.expert_pieces(index, name, expert, layout)
        shapes = dict(layout.parts)
        filled = {part: 0 for part in shapes}
        for p in pieces:
            want = shapes[p.part][1:]
            if tuple(p.source.shape[1:]) != tuple(want):
                raise CheckpointError(f"{p.source.path}: expert {expert} of {name} has shape {p.source.shape}, "
                                      f"the model expects rows of {want} for {p.part}")
            filled[p.part] += p.source.shape[0]
        for part, shape in shapes.items():
            if filled[part] != shape[0]:
                raise CheckpointError(f"checkpoint {index.root} does not hold expert {expert} of {name} "
                                      f"({part}: {filled[part]} of {shape[0]} rows found)")
        return pieces


def alignment_offset(t: torch.Tensor) -> int:
    """Where a CPU tensor starts within a 64-byte line. CPU matmul kernels pick their path by alignment, so a
    restored parameter must start at the same offset to give bit-identical outputs (mmap'd weights often don't)."""
    return t.data_ptr() % 64 if t.device.type == "cpu" else 0   # meta tensors: no address, offset 0


def empty_at_alignment(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, offset: int
                       ) -> torch.Tensor:
    """`torch.empty`, starting `offset` bytes past a 64-byte boundary (CPU only; elsewhere plain `empty`)."""
    if device.type != "cpu" or offset == 0 or offset % dtype.itemsize:
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = _numel(shape) * dtype.itemsize
    buf = torch.empty(nbytes + 64, dtype=torch.uint8)
    start = (offset - buf.data_ptr()) % 64
    return buf[start:start + nbytes].view(dtype).view(shape)


RELEASED_ATTR = "_hf_moe_offload_released"


def release_parameter(module: nn.Module, name: str, key=None) -> None:
    """Drop a parameter's memory: it becomes None (skipped by `.to()`, `state_dict()`, `parameters()`), and what
    is needed to give it back (shape, dtype, requires_grad, alignment) is remembered on the module."""
    p = getattr(module, name)
    released = module.__dict__.setdefault(RELEASED_ATTR, {})
    if p is not None:
        released[key or name] = (tuple(p.shape), p.dtype, p.requires_grad, alignment_offset(p))
    module.register_parameter(name, None)


def restore_parameter(module: nn.Module, name: str, value: torch.Tensor, key=None) -> None:
    """Give back a parameter released by `release_parameter`, with `value`'s contents, at its old alignment."""
    _, _, requires_grad, offset = module.__dict__[RELEASED_ATTR].pop(key or name)
    weight = empty_at_alignment(tuple(value.shape), value.dtype, value.device, offset).copy_(value)
    module.register_parameter(name, nn.Parameter(weight, requires_grad=requires_grad))
    if not module.__dict__[RELEASED_ATTR]:
        del module.__dict__[RELEASED_ATTR]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _num_experts(module: nn.Module) -> int:
    return int(getattr(module, "num_experts"))


def checkpoint_key_candidates(name: str, renames: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """Checkpoint prefixes that may hold the module `name`: itself, its legacy renames, with or without "model."."""
    names = [name] + [name.replace(new, old) for old, new in renames if new in name]
    out: list[str] = []
    for n in names:
        for cand in (n, n.removeprefix("model."), "model." + n):
            if cand not in out:
                out.append(cand)
    return out


_REGISTRY: list[MoEArch] = []


def register_arch(arch: MoEArch) -> MoEArch:
    _REGISTRY.append(arch)
    return arch


def supported_model_types() -> list[str]:
    return sorted(t for arch in _REGISTRY for t in arch.model_types)


def get_arch(config) -> MoEArch:
    """The adapter for `config.model_type`, or a clear error listing the supported model types."""
    model_type = getattr(config, "model_type", None)
    for arch in _REGISTRY:
        if model_type in arch.model_types:
            return arch
    raise UnsupportedModelError(f"model type {model_type!r} is not supported by hf_moe_offload; supported model "
                                f"types: {supported_model_types()}")


from . import fused, switch  # noqa: E402,F401  (registers the adapters)
