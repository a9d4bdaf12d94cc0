"""Families whose experts transformers 5 keeps as fused 3D tensors behind `ExpertsInterface`: every decoder family
in the installed transformers whose experts class is decorated with `use_experts_implementation` in the layout
below (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, Phi-MoE, Granite-MoE, Jamba, ...). They are
discovered from transformers' own code (`discover_families`), not hand-listed; `FAMILIES` keeps the entries that
work without importing any modeling module.

In memory: `gate_up_proj [E, 2I, H]` (gate rows first, then up) and `down_proj [E, H, I]`, no bias; or transposed
(`is_transposed=True`, Aria: `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`, kept so in the slab and computed as
`x @ W`); or without a gate (`has_gate=False`, Nemotron-H: `up_proj [E, I, H]`, `down_proj [E, H, I]`, the
module's `act_fn` on `up` alone). On disk (Hub layout): per-expert `gate/up/down` (or `up/down`) keys under
family-specific names (read off transformers' checkpoint conversion mapping), fused keys under a legacy name
(Granite-MoE's `input_linear`/`output_linear`, Aria's `fc1`/`fc2`), or the fused keys themselves. The offloaded
forward is registered as the experts implementation "hf_moe_offload"; attaching selects it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import re

import torch
from torch import nn
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..layout import ExpertPiece, MoELayer, SlabLayout, release_parameter, restore_parameter
from ..storage.checkpoint import CheckpointError, CheckpointIndex
from .base import (
    MoEArch,
    UnsupportedModelError,
    checkpoint_key_candidates,
    register_arch,
    registered_archs,
    weight_piece,
)
from .forward import EXPERTS_IMPLEMENTATION, MatmulSlabLayout, matmul_refusal
from .implementation import restore_experts_implementation, select_experts_implementation
from .routing import kind_of, replacement_output, router_kind

logger = logging.getLogger(__name__)

# slab part -> the experts module's parameter (a gated module has gate_up, a gateless one up; both have down)
_PARAMS = {"gate_up": "gate_up_proj", "up": "up_proj", "down": "down_proj"}

# Per-expert checkpoint names (gate, up, down) seen in transformers' conversion mapping; tried for any family whose
# own mapping names none (a checkpoint may have been written by another tool).
_KNOWN_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# Config attributes that hold the number of experts per token, in the order families use them.
_TOP_K_ATTRS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts",
                "num_experts_per_token_routed", "top_k")
_FLAGS = ("is_concatenated", "is_transposed", "has_bias", "has_gate", "has_post_expert_norm")
# Flags whose other value is refused (is_transposed and has_gate take either value: `FusedExpertsArch.layout`).
_SUPPORTED_FLAGS = {"is_concatenated": True, "has_bias": False, "has_post_expert_norm": False}
_DEFAULT_FLAGS = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
                  "has_post_expert_norm": False}     # use_experts_implementation's defaults
_FLAG_REASONS = {"is_concatenated": "interleaved gate/up rows (is_concatenated=False)",
                 "is_transposed": "transposed weights (is_transposed=True)",
                 "has_bias": "biased experts (has_bias=True)",
                 "has_gate": "no gate projection (has_gate=False)",
                 "has_post_expert_norm": "a norm after each expert (has_post_expert_norm=True)"}


@dataclasses.dataclass(frozen=True)
class Family:
    """One model type whose experts go through transformers' `ExpertsInterface`.

    Example:
        >>> from hf_moe_offload.arch.fused import family_for
        >>> family_for("mixtral").expert_names
        ('w1', 'w3', 'w2')
    """

    model_type: str
    experts_classes: tuple[str, ...]                 # class names of its experts modules
    expert_names: tuple[str, ...] | None = None      # per-expert checkpoint names of (gate, up, down) or (up, down)
    renames: tuple[tuple[str, str], ...] = ()        # (checkpoint, in-memory) module path renames
    fused_renames: tuple[tuple[str, str], ...] = ()  # (checkpoint key, in-memory key) of fused tensors
    refused: str | None = None                       # why its experts layout is not supported, or None
    interleaved: tuple[str, ...] = ()                # fused gate_up checkpoint keys with rows (gate 0, up 0, ...)

    @property
    def supported(self) -> bool:
        return self.refused is None


def _unescape(pattern: str) -> str | None:
    """A conversion pattern as a plain string, or None when it is a real regular expression."""
    plain = re.sub(r"\\(.)", r"\1", pattern)
    return None if re.search(r"[\^$*+?()\[\]{}|]", plain.replace(".", "")) else plain


def experts_flags(cls: type) -> dict[str, bool] | None:
    """The layout flags `use_experts_implementation` gave `cls`, or None if it is not so decorated (read from the
    decorator's closure, so no instance is needed)."""
    init = getattr(cls, "__init__", None)
    code = getattr(init, "__code__", None)
    if code is None or "original_init" not in code.co_freevars:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in init.__closure__)))
    if not all(f in cells for f in _FLAGS):
        return None
    return {f: bool(cells[f]) for f in _FLAGS}


def _own_adapter(model_type: str) -> bool:
    """Whether another registered adapter (`arch/gpt_oss.py`, ...) offloads `model_type`."""
    return any(not isinstance(arch, FusedExpertsArch) and arch.supports(model_type) for arch in registered_archs())


def _refusal(cls_name: str, flags: dict[str, bool]) -> str | None:
    wrong = [_FLAG_REASONS[f] for f, ok in _SUPPORTED_FLAGS.items() if flags[f] != ok]
    return None if not wrong else f"{cls_name} has {', '.join(wrong)}"


def _checkpoint_names(model_type: str) -> tuple[tuple[str, str, str] | None, tuple, tuple, tuple]:
    """Per-expert names, module renames, fused-key renames and interleaved fused gate_up keys of `model_type`, from
    transformers' checkpoint conversion mapping (what its own loader applies to Hub checkpoints)."""
    try:
        # inside the try: an older transformers has no conversion mapping module
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        conversions = get_checkpoint_conversion_mapping(model_type) or []
    except Exception:   # noqa: BLE001  (an older transformers: fall back to the known names)
        return None, (), (), ()
    gate_up: list[str] = []
    up: list[str] = []          # a gateless family's (Nemotron-H) per-expert up projection
    down: list[str] = []
    renames, fused, interleaved = [], [], []
    for conv in conversions:
        if type(conv).__name__ == "WeightConverter":    # per-expert keys merged into one fused tensor
            target = re.sub(r"\\(.)", r"\1", conv.target_patterns[0])
            sources = [re.sub(r"\\(.)", r"\1", s) for s in conv.source_patterns]
            names = [m.group(1) for s in sources if (m := re.search(r"experts\.\*\.(\w+)\.weight$", s))]
            if target.endswith("experts.gate_up_proj") and len(names) == 2:
                gate_up = names
            elif target.endswith("experts.up_proj") and len(names) == 1:
                up = names
            elif target.endswith("experts.down_proj") and len(names) == 1:
                down = names
            elif target.endswith("experts.gate_up_proj") and _deinterleaves_rows(conv) \
                    and (source := _unescape(conv.source_patterns[0])) is not None:
                fused.append((source, target))             # Inkling-2's w13_weight: (gate 0, up 0, gate 1, ...)
                interleaved.append(source)
            continue
        if type(conv).__name__ == "PrefixChange" and getattr(conv, "model_prefix", ""):
            # A composite's text model loaded from the composite checkpoint: model.language_model. -> model.
            inner = f"{conv.model_prefix}.{conv.prefix_to_remove or conv.prefix_to_add}."
            outer = f"{conv.model_prefix}."
            renames.append((inner, outer) if conv.prefix_to_remove else (outer, inner))
            continue
        if len(conv.source_patterns) != 1 or len(conv.target_patterns) != 1:
            continue
        source, target = _unescape(conv.source_patterns[0]), _unescape(conv.target_patterns[0])
        if source is None or target is None:
            continue
        if target.endswith(("experts.gate_up_proj", "experts.down_proj")):
            fused.append((source, target))                 # a fused tensor under a legacy name (Granite-MoE)
        elif source.startswith(".") and source.endswith(".") and target.endswith("."):
            renames.append((source, target))               # a module path rename such as .block_sparse_moe. -> .mlp.
        elif re.fullmatch(r"\w+\.(\w+\.)*", source) and target.startswith("model.") and target.endswith("."):
            renames.append((source, target))               # a prefix rename: model.llm. -> model., backbone. -> model.
    names = (gate_up[0], gate_up[1], down[0]) if gate_up and down else (up[0], down[0]) if up and down else None
    return names, tuple(renames), tuple(fused), tuple(interleaved)


def _deinterleaves_rows(conv) -> bool:
    """Whether the converter `conv` only turns one fused [E, 2I, H] tensor whose rows alternate gate, up into gate
    rows first (transformers' `Interleave(dim=1)`): the store can undo that per expert as it reads."""
    ops = getattr(conv, "operations", ())
    return len(conv.source_patterns) == 1 and len(ops) == 1 and type(ops[0]).__name__ == "Interleave" \
        and getattr(ops[0], "dim", None) == 1 and not getattr(ops[0], "inverse", True)


def _modeling_module(model_type: str):
    name = model_type_to_module_name(model_type)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


@functools.lru_cache(maxsize=None)
def discover_family(model_type: str) -> Family | None:
    """The `Family` of `model_type` read from transformers' code, or None if its modeling module has no experts
    class decorated with `use_experts_implementation` (or it has no modeling module).

    Example:
        >>> discover_family("deepseek_v3").expert_names
        ('gate_proj', 'up_proj', 'down_proj')
    """
    if _own_adapter(model_type):        # e.g. GPT-OSS: its experts use the interface in a layout of their own
        return None
    try:
        module = _modeling_module(model_type)
    except Exception as exc:   # noqa: BLE001  (a missing optional dependency, an unknown model type)
        logger.debug("model type %r: no modeling module (%s)", model_type, exc)
        return None
    classes = [(n, experts_flags(c)) for n, c in vars(module).items()
               if inspect.isclass(c) and c.__module__ == module.__name__ and experts_flags(c) is not None]
    if not classes:
        return None
    names, renames, fused, interleaved = _checkpoint_names(model_type)
    refused = [r for n, flags in classes if (r := _refusal(n, flags))]
    family = _SEEN[model_type] = Family(model_type, tuple(n for n, _ in classes), names, renames, fused,
                  refused="; ".join(refused) if len(refused) == len(classes) else None, interleaved=interleaved)
    return family


@functools.lru_cache(maxsize=1)
def discover_families() -> dict[str, Family]:
    """Every model type of transformers' causal-LM auto mapping whose experts use `use_experts_implementation`,
    supported or refused (`Family.refused` says why). Imports each candidate modeling module once (seconds).

    Example:
        >>> discover_families()["nemotron_h"].expert_names         # gateless: (up, down)
        ('up_proj', 'down_proj')
    """
    found = dict(FusedExpertsArch.FAMILIES_BY_TYPE)
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if model_type not in found and (family := discover_family(model_type)) is not None:
            found[model_type] = family
    return dict(sorted(found.items()))


_SEEN: dict[str, Family] = {}     # families discovered in this process, for their checkpoint names


def _families_seen() -> list[Family]:
    return list(FusedExpertsArch.FAMILIES_BY_TYPE.values()) + list(_SEEN.values())


def _fused_candidates(prefix: str, fused_renames: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """(gate_up, down) keys that may hold the fused experts of module `prefix`: the in-memory names, and the legacy
    names a conversion renames to them (Granite-MoE: `input_linear.weight`, `output_linear.weight`)."""
    gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    out = [(gate_up, down)]
    for old, new in fused_renames:
        if new.endswith("gate_up_proj") and new in gate_up:
            out += [(gate_up.replace(new, old), down.replace(new_d, old_d)) for old_d, new_d in fused_renames
                    if new_d.endswith("down_proj") and new_d in down]
    return out


def family_for(model_type: str | None) -> Family | None:
    """The `Family` of `model_type`: an explicit entry, else discovered from transformers' code; None if its
    experts do not use the experts interface."""
    if model_type is None:
        return None
    return FusedExpertsArch.FAMILIES_BY_TYPE.get(model_type) or discover_family(model_type)


class FusedExpertsArch(MoEArch):
    """One adapter for every family with fused experts: they differ only in checkpoint key names and in the config
    attribute that holds the experts per token."""

    reads_fp8_block_scales = True
    # model_type -> (experts class name, per-expert checkpoint names of (gate, up, down), legacy module renames).
    # Known without importing any modeling module; every other family is discovered (`family_for`).
    FAMILIES = {
        "mixtral": ("MixtralExperts", ("w1", "w3", "w2"), ((".block_sparse_moe.", ".mlp."),)),
        "qwen2_moe": ("Qwen2MoeExperts", ("gate_proj", "up_proj", "down_proj"), ()),
        "qwen3_moe": ("Qwen3MoeExperts", ("gate_proj", "up_proj", "down_proj"), ()),
        "olmoe": ("OlmoeExperts", ("gate_proj", "up_proj", "down_proj"), ()),
    }
    FAMILIES_BY_TYPE = {t: Family(t, (cls,), names, renames) for t, (cls, names, renames) in FAMILIES.items()}
    model_types = tuple(FAMILIES)

    def supports(self, model_type: str | None) -> bool:
        family = family_for(model_type)
        return family is not None and family.supported

    def refusal(self, model_type: str | None) -> str | None:
        family = family_for(model_type)
        return None if family is None else family.refused

    def supported_types(self) -> tuple[str, ...]:
        return tuple(t for t, f in discover_families().items() if f.supported)

    def is_experts_module(self, module: nn.Module) -> bool:
        return experts_flags(type(module)) is not None

    def layout(self, module: nn.Module) -> SlabLayout:
        """One expert's slab, in the module's own orientation: `gate_up` (or `up` without a gate), then `down`.
        Transposed weights ([in, out], Aria) stay so, which keeps the unpatched model's `x @ W` and `state_dict`;
        their `MatmulSlabLayout` refuses int8/int4, whose kernels take [out, in].

        Example:
            >>> FusedExpertsArch().layout(model.model.layers[0].mlp.experts).parts      # doctest: +SKIP
            (('gate_up', (96, 32)), ('down', (32, 48)))
        """
        flags = experts_flags(type(module)) or {f: bool(getattr(module, f, d)) for f, d in _DEFAULT_FLAGS.items()}
        if (why := _refusal(type(module).__name__, flags)) is not None:
            raise UnsupportedModelError(f"{why}, an experts layout hf_moe_offload does not support; supported: "
                                        f"gate_up_proj [E, 2I, H] gate rows first (or up_proj without a gate) and "
                                        f"down_proj [E, H, I], or all of them transposed, no bias, no post-expert "
                                        f"norm")
        first = "gate_up" if flags["has_gate"] else "up"
        parts = ((first, tuple(getattr(module, _PARAMS[first]).shape[1:])), ("down", tuple(module.down_proj.shape[1:])))
        if flags["is_transposed"]:
            return MatmulSlabLayout(parts=parts, quantize_refusal=matmul_refusal(
                type(module).__name__, "transposed weights [in, out], used as x @ W"))
        return SlabLayout(parts=parts)

    def top_k(self, config) -> int:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        for attr in _TOP_K_ATTRS:
            value = getattr(text, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        raise UnsupportedModelError(f"{type(text).__name__} names no number of experts per token that "
                                    f"hf_moe_offload knows (looked for {', '.join(_TOP_K_ATTRS)})")

    def expert_pieces(self, index: CheckpointIndex, name: str, expert: int, layout: SlabLayout
                      ) -> list[ExpertPiece]:
        families = _families_seen()
        renames = tuple(dict.fromkeys(r for f in families for r in f.renames))
        fused_renames = tuple(dict.fromkeys(r for f in families for r in f.fused_renames))
        interleaved = tuple(dict.fromkeys(k for f in families for k in f.interleaved))
        first = layout.parts[0][0]                  # "gate_up", or "up" for a gateless module (Nemotron-H)
        width = 3 if first == "gate_up" else 2
        known = _KNOWN_EXPERT_NAMES if width == 3 else (("up_proj", "down_proj"),)
        name_sets = tuple(dict.fromkeys([f.expert_names for f in families if f.expert_names
                                         and len(f.expert_names) == width] + list(known)))
        # Per-expert [out, in] tensors cannot fill a transposed slab (Aria's checkpoints are fused, as in memory).
        if isinstance(layout, MatmulSlabLayout):
            name_sets = ()
        for prefix in checkpoint_key_candidates(name, renames):
            fused_keys = _fused_candidates(prefix, fused_renames) if width == 3 \
                else [(f"{prefix}.up_proj", f"{prefix}.down_proj")]
            for gate_up_key, down_key in fused_keys:
                if gate_up_key in index and down_key in index:
                    gate_up = weight_piece(index, first, 0, gate_up_key, expert)
                    if gate_up_key.endswith(interleaved):   # rows (gate 0, up 0, ...): the store de-interleaves
                        gate_up = dataclasses.replace(gate_up, interleaved=True)
                    return [gate_up, weight_piece(index, "down", 0, down_key, expert)]
            for up, down in (n for n in name_sets if width == 2):
                keys = [f"{prefix}.{expert}.{n}.weight" for n in (up, down)]
                if all(k in index for k in keys):
                    return [weight_piece(index, "up", 0, keys[0]), weight_piece(index, "down", 0, keys[1])]
            for gate, up, down in (n for n in name_sets if width == 3):
                keys = [f"{prefix}.{expert}.{n}.weight" for n in (gate, up, down)]
                if all(k in index for k in keys):
                    gate_piece = weight_piece(index, "gate_up", 0, keys[0])
                    return [gate_piece,
                            weight_piece(index, "gate_up", gate_piece.source.shape[0], keys[1]),
                            weight_piece(index, "down", 0, keys[2])]
        prefixes = checkpoint_key_candidates(name, renames)
        # The expert's tensors that are there: a set with one name missing says which
        present = sorted(k for k in index.keys() if any(k.startswith(f"{p}.{expert}.") for p in prefixes))
        raise CheckpointError(f"checkpoint {index.root} has no tensors for expert {expert} of {name} (looked under "
                              f"{', '.join(prefixes)} for <prefix>.{expert}.<{first}>.weight with <{first}> one of "
                              f"{sorted({n[0] for n in name_sets})} and the fused {_PARAMS[first]}/down_proj keys)"
                              + (f"; it has only {present}" if present else ""))

    def expert_tensors(self, module: nn.Module, expert: int) -> dict[str, torch.Tensor]:
        return {part: getattr(module, _PARAMS[part]).data[expert] for part, _ in self.layout(module).parts}

    def set_expert_params(self, module: nn.Module, stacked: dict[str, torch.Tensor]) -> None:
        for part, tensor in stacked.items():
            restore_parameter(module, _PARAMS[part], tensor)

    def expert_state(self, layer: MoELayer, stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_PARAMS[part]: tensor for part, tensor in stacked.items()}

    def release_expert_params(self, module: nn.Module) -> None:
        for pname in _PARAMS.values():
            if pname in module._parameters:       # gate_up_proj or up_proj, and down_proj
                release_parameter(module, pname)

    def router_module(self, model: nn.Module, layer: MoELayer) -> nn.Module:
        block = model.get_submodule(layer.name.rsplit(".", 1)[0])
        candidates = [m for attr in ("gate", "router") if isinstance(m := getattr(block, attr, None), nn.Module)]
        # Some blocks have both (AFMoE: `gate` is an output gate, `router` routes): the router class wins.
        routers = [m for m in candidates if re.search(r"Router|Gate$", type(m).__name__)]
        if not (routers or candidates):
            raise UnsupportedModelError(f"{type(block).__name__} at {layer.name} has no `gate` or `router` module")
        return (routers or candidates)[0]

    def router_kind(self, model: nn.Module, layer: MoELayer):
        block = model.get_submodule(layer.name.rsplit(".", 1)[0])
        text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        return router_kind(self.router_module(model, layer), block, layer.num_experts, layer.top_k,
                           int(text.hidden_size))

    def router_logits(self, output, router: nn.Module | None = None) -> torch.Tensor:
        kind = kind_of(router) if router is not None else None
        if kind is not None:
            return kind.logits(output)                              # Gemma-4's probabilities -> log
        first = output[0] if isinstance(output, (tuple, list)) else output   # (logits, weights, indices, ...)
        return first.reshape(-1, first.shape[-1])

    def routing_from_logits(self, router: nn.Module, logits: torch.Tensor, output):
        kind = kind_of(router)
        if kind is None:    # no kind built for it (the arch's router_kind was not called): read it off the router
            kind = router_kind(router, None, logits.shape[-1], int(router.top_k), int(router.weight.shape[-1]))
        kind.check("predicted routing (routing='predicted')", weights=True)
        return replacement_output(kind, logits, output)

    def router_weight(self, model: nn.Module, layer: MoELayer) -> torch.Tensor | None:
        router = self.router_module(model, layer)
        for weight in (getattr(router, "weight", None), getattr(getattr(router, "gate", None), "weight", None)):
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == layer.num_experts:
                return weight
        return None

    def attach(self, model: nn.Module, layer: MoELayer, runtime) -> None:
        select_experts_implementation(model, layer, runtime, EXPERTS_IMPLEMENTATION)

    def detach(self, model: nn.Module, layer: MoELayer) -> None:
        restore_experts_implementation(model, layer)


register_arch(FusedExpertsArch())
