"""What every model-family adapter is: the `MoEArch` base class, its mixins and checkpoint helpers, the
`ExpertFetcher` an offloaded forward calls, and the registry `get_arch` picks an adapter from.

An adapter module subclasses `MoEArch` and calls `register_arch` on an instance; `hf_moe_offload.arch` imports
every adapter module, so importing the package registers them all.
"""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from typing import Iterator, Protocol, Sequence

import torch
from torch import nn

from ..storage.checkpoint import FP8_DTYPES, CheckpointError, CheckpointIndex
from ..layout import ExpertPiece, MoELayer, SlabLayout, release_parameter, restore_parameter


class ExpertFetcher(Protocol):
    """What an offloaded experts forward calls (the engine's per-layer runtime implements it)."""

    def fetch(self, experts: Sequence[int], hidden_states: torch.Tensor | None = None,
              tokens: Sequence[int] | None = None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield (expert, its named weights where they compute), resident experts first."""


class UnsupportedModelError(ValueError):
    """The model has no MoE layers, or its architecture is not supported; the message says why, names the closest
    supported model types and where all are listed."""


class MoEArch(ABC):
    """What the engine needs to know about one model family."""

    model_types: tuple[str, ...] = ()
    # Named as where fine-grained FP8 experts are read when another adapter refuses them (`locate_expert`).
    reads_fp8_block_scales = False

    def supports(self, model_type: str | None) -> bool:
        """Whether this adapter offloads models of `model_type`."""
        return model_type in self.model_types

    def refusal(self, model_type: str | None) -> str | None:
        """Why `model_type`, a family this adapter recognises, cannot be offloaded; None if it can or is unknown."""
        return None

    def supported_types(self) -> tuple[str, ...]:
        """Every model type this adapter offloads."""
        return self.model_types

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
    def expert_state(self, layer: MoELayer, stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The experts module's `state_dict` entries (names relative to the module) from per-part tensors stacked
        over experts: what an offloaded model's `state_dict()` and `save_pretrained` write."""

    @abstractmethod
    def release_expert_params(self, module: nn.Module) -> None:
        """Release the module's expert parameters (`release_parameter`): their bytes now live in the store."""

    @abstractmethod
    def attach(self, model: nn.Module, layer: MoELayer, runtime: ExpertFetcher) -> None: ...

    @abstractmethod
    def detach(self, model: nn.Module, layer: MoELayer) -> None: ...

    # -- routing: what prefetchers and predictors hook into ----------------------------------------------------

    @abstractmethod
    def router_module(self, model: nn.Module, layer: MoELayer) -> nn.Module:
        """The module that routes tokens to `layer`'s experts (a forward hook on it sees every decision)."""

    @abstractmethod
    def router_logits(self, output, router: nn.Module | None = None) -> torch.Tensor:
        """Router logits [tokens, E] from the router module's forward output (`router`: the module that produced
        it, whose kind says where its logits are: Gemma-4's router returns probabilities)."""

    @abstractmethod
    def routing_from_logits(self, router: nn.Module, logits: torch.Tensor, output):
        """A replacement for the router's forward `output` in which `logits` [tokens, E] decide, computed the way
        the router computes its own (`routing.RouterKind.select`): used by predicted routing. Raises
        `routing.RoutingUnsupportedError` for a router whose routing cannot be rebuilt."""

    def router_kind(self, model: nn.Module, layer: MoELayer):
        """The `routing.RouterKind` of `layer`'s router (how logits become experts and weights), or None if this
        adapter has none (then look-ahead applies `router_weight`).

        Example:
            >>> get_arch(model.config).router_kind(model, layer).describe()           # doctest: +SKIP
            'sigmoid, correction bias on scores, renormalised, x2.5'
        """
        return None

    def router_weight(self, model: nn.Module, layer: MoELayer) -> torch.Tensor | None:
        """The router's linear weight [E, hidden] (logits = hidden @ weight.T), or None if it has none: look-ahead
        applies it to an earlier layer's hidden states to guess this layer's experts."""
        weight = getattr(self.router_module(model, layer), "weight", None)
        return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None

    def routes_input_ids(self, layer: MoELayer) -> bool:
        """Whether `layer` routes the tokens of the model's `input_ids` (not, e.g., an encoder-decoder's decoder)."""
        return True

    def find_layers(self, model: nn.Module) -> list[MoELayer]:
        """The model's MoE layers, in module order (an offloaded model's, as its engine keeps them)."""
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
            raise UnsupportedModelError(no_moe_layers_message(model))
        return layers

    def locate_expert(self, index: CheckpointIndex, name: str, expert: int, layout: SlabLayout
                      ) -> list[ExpertPiece]:
        """`expert_pieces`, checked to fill the whole slab with matching shapes."""
        pieces = self.expert_pieces(index, name, expert, layout)
        shapes = dict(layout.parts)
        filled = {part: 0 for part in shapes}
        for p in pieces:
            if p.source.dtype in FP8_DTYPES and p.scales is None:
                # A plain dtype conversion would drop the block scales and give wrong weights silently.
                raise CheckpointError(f"{p.source.path}: expert {expert} of {name} is stored as {p.source.dtype}, "
                                      f"and {type(self).__name__} reads no block scales for it; fine-grained FP8 "
                                      f"experts are read for the model types of {_fp8_readers()}")
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


def weight_piece(index: CheckpointIndex, part: str, row: int, key: str, expert: int | None = None) -> ExpertPiece:
    """The piece of slab `part` from row `row` held by tensor `key` (by `key[expert]` for a fused [E, ...] key),
    with its FP8 block scales when the tensor is fine-grained FP8.

    Example:
        >>> weight_piece(index, "gate_up", 0, "model.layers.0.mlp.experts.3.gate_proj.weight")   # doctest: +SKIP
    """
    return ExpertPiece(part, row, index.locate(key, row=expert), index.block_scales(key, row=expert))


def _num_experts(module: nn.Module) -> int:
    return int(getattr(module, "num_experts"))


def checkpoint_key_candidates(name: str, renames: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """Checkpoint prefixes that may hold the module `name`: itself, its legacy renames, with or without "model.";
    for a vision + text model's language model, also without "language_model." (checkpoints that store the text
    model at the top, which transformers renames by the model's class: Dots3-Note)."""
    names = [name] + [name.replace(new, old) for old, new in renames if new in name]
    names += [n.replace("language_model.", "", 1) for n in names if "language_model." in n]
    out: list[str] = []
    for n in names:
        for cand in (n, n.removeprefix("model."), "model." + n):
            if cand not in out:
                out.append(cand)
    return out


class StackedParams:
    """The four parameter methods of `MoEArch` for an experts module that holds each slab part as one parameter
    stacked over experts (`params`: slab part -> parameter name; GPT-OSS, Llama-4). Mixed in before `MoEArch`."""

    params: dict[str, str]

    def expert_tensors(self, module: nn.Module, expert: int) -> dict[str, torch.Tensor]:
        return {part: getattr(module, param).data[expert] for part, param in self.params.items()}

    def set_expert_params(self, module: nn.Module, stacked: dict[str, torch.Tensor]) -> None:
        for part, param in self.params.items():
            restore_parameter(module, param, stacked[part])

    def expert_state(self, layer: MoELayer, stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {param: stacked[part] for part, param in self.params.items()}

    def release_expert_params(self, module: nn.Module) -> None:
        for param in self.params.values():
            release_parameter(module, param)


class SwappedExpertsChild:
    """`attach`/`detach` for adapters whose offloaded forward replaces the block's `experts` child with
    `offloaded_class(original experts module, runtime)` (Switch, DBRX, Llama-4); detaching puts the original back.
    Mixed in before `MoEArch`."""

    offloaded_class: type

    def attach(self, model: nn.Module, layer: MoELayer, runtime: ExpertFetcher) -> None:
        model.get_submodule(layer.name.rsplit(".", 1)[0]).experts = self.offloaded_class(layer.module, runtime)

    def detach(self, model: nn.Module, layer: MoELayer) -> None:
        parent = model.get_submodule(layer.name.rsplit(".", 1)[0])
        if isinstance(parent.experts, self.offloaded_class):
            parent.experts = layer.module


_REGISTRY: list[MoEArch] = []


def register_arch(arch: MoEArch) -> MoEArch:
    """Add an adapter to those `get_arch` chooses from (each adapter module registers its own at import)."""
    _REGISTRY.append(arch)
    return arch


def registered_archs() -> tuple[MoEArch, ...]:
    """Every registered adapter, in registration order (the fused one first)."""
    return tuple(_REGISTRY)


def _fp8_readers() -> str:
    """The adapters that read fine-grained FP8 experts, with their model types: for a refusal's message."""
    return "; ".join(f"{type(arch).__name__} ({', '.join(arch.supported_types())})"
                     for arch in _REGISTRY if arch.reads_fp8_block_scales)


def supported_model_types() -> list[str]:
    """Every model type hf_moe_offload can offload (the fused families are discovered from the installed
    transformers on the first call: seconds).

    Example:
        >>> "mixtral" in hf_moe_offload.supported_model_types()
        True
    """
    return sorted({t for arch in _REGISTRY for t in arch.supported_types()})


def get_arch(config) -> MoEArch:
    """The adapter for `config.model_type`, or a clear error saying why it is refused and naming the closest
    supported model types.

    Example:
        >>> get_arch(MixtralConfig()).top_k(MixtralConfig())   # doctest: +SKIP
        2
    """
    model_type = getattr(config, "model_type", None)
    for arch in _REGISTRY:
        if arch.supports(model_type):
            return arch
    for arch in _REGISTRY:
        if (why := arch.refusal(model_type)) is not None:
            raise UnsupportedModelError(f"model type {model_type!r} is not supported by hf_moe_offload: {why}; "
                                        f"{closest_supported(model_type)}")
    raise UnsupportedModelError(f"model type {model_type!r} is not supported by hf_moe_offload (it offloads the "
                                f"families whose experts use transformers' fused experts interface, and Switch "
                                f"Transformers); {closest_supported(model_type)}")


def closest_supported(model_type: str | None) -> str:
    """The supported model types closest to `model_type`, and where all of them are listed: for a refusal.

    Example:
        >>> closest_supported("mistral")                                   # doctest: +SKIP
        "closest supported model types: ['mixtral']; all ... docs/models.md ..."
    """
    close = difflib.get_close_matches(str(model_type), supported_model_types(), n=5, cutoff=0.6)
    found = f"closest supported model types: {close}" if close else \
        f"no supported model type is close to {model_type!r}"
    return f"{found}; all are listed in docs/models.md and by hf_moe_offload.supported_model_types()"


def no_moe_layers_message(model: nn.Module) -> str:
    """Why `model` has no MoE layers to offload, and what to do: a supported family loaded as remote code is told
    to use transformers' own class, whose experts modules hf_moe_offload knows."""
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    module = type(model).__module__
    if model_type in supported_model_types():
        if not module.startswith("transformers."):
            return (f"{name} has no MoE layers that hf_moe_offload can offload: it is remote code ({module}.{name}, "
                    f"loaded with trust_remote_code=True), not transformers' own class for model type "
                    f"{model_type!r}, which is the one hf_moe_offload offloads. Load the model without "
                    f"trust_remote_code=True (or with trust_remote_code=False) to get transformers' class")
        return (f"{name} has no MoE layers that hf_moe_offload can offload: model type {model_type!r} is supported, "
                f"but none of this model's modules is one of that family's experts modules (a config with no "
                f"experts, or experts replaced after loading)")
    return (f"{name} (model type {model_type!r}) has no MoE layers that hf_moe_offload can offload; "
            f"{closest_supported(model_type)}")
