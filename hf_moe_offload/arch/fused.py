"""Families whose experts transformers 5 keeps as fused 3D tensors behind `ExpertsInterface`:
Mixtral, Qwen2-MoE (the shared expert stays resident), Qwen3-MoE, OLMoE.

In memory: `gate_up_proj [E, 2I, H]` (gate rows first, then up) and `down_proj [E, H, I]`.
On disk (Hub layout): per-expert `gate/up/down` keys under family-specific names, or the fused keys themselves.
The offloaded forward is registered as the experts implementation "hf_moe_offload"; attaching selects it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint import CheckpointError, CheckpointIndex
from ..execute import EXPERTS_IMPLEMENTATION
from . import ExpertPiece, MoEArch, MoELayer, SlabLayout, UnsupportedModelError, checkpoint_key_candidates, \
    register_arch, release_parameter, restore_parameter, weight_piece

_PREVIOUS_IMPL = "_hf_moe_offload_previous_experts_implementation"


class FusedExpertsArch(MoEArch):
    """One adapter for every family listed in `FAMILIES`: they differ only in checkpoint key names."""

    # model_type -> (experts class name, per-expert checkpoint names of (gate, up, down), legacy module renames)
    FAMILIES = {
        "mixtral": ("MixtralExperts", ("w1", "w3", "w2"), ((".block_sparse_moe.", ".mlp."),)),
        "qwen2_moe": ("Qwen2MoeExperts", ("gate_proj", "up_proj", "down_proj"), ()),
        "qwen3_moe": ("Qwen3MoeExperts", ("gate_proj", "up_proj", "down_proj"), ()),
        "olmoe": ("OlmoeExperts", ("gate_proj", "up_proj", "down_proj"), ()),
    }
    model_types = tuple(FAMILIES)

    def is_experts_module(self, module: nn.Module) -> bool:
        return any(type(module).__name__ == cls for cls, _, _ in self.FAMILIES.values())

    def _family(self, module_or_config) -> tuple:
        if isinstance(module_or_config, nn.Module):
            for family in self.FAMILIES.values():
                if type(module_or_config).__name__ == family[0]:
                    return family
        return self.FAMILIES[module_or_config.model_type]

    def layout(self, module: nn.Module) -> SlabLayout:
        if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False) \
                or not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
            raise UnsupportedModelError(f"{type(module).__name__} uses an experts layout hf_moe_offload does not "
                                        f"support (transposed, biased, gateless or post-normed experts)")
        _, two_i, h = module.gate_up_proj.shape
        return SlabLayout(parts=(("gate_up", (two_i, h)), ("down", tuple(module.down_proj.shape[1:]))))

    def top_k(self, config) -> int:
        return int(config.num_experts_per_tok)

    def expert_pieces(self, index: CheckpointIndex, name: str, expert: int, layout: SlabLayout
                      ) -> list[ExpertPiece]:
        gate, up, down = self._names_for(index, name)
        renames = self._renames_for(name)
        for prefix in checkpoint_key_candidates(name, renames):
            fused_gate_up, fused_down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
            if fused_gate_up in index and fused_down in index:
                return [weight_piece(index, "gate_up", 0, fused_gate_up, expert),
                        weight_piece(index, "down", 0, fused_down, expert)]
            keys = [f"{prefix}.{expert}.{n}.weight" for n in (gate, up, down)]
            if all(k in index for k in keys):
                gate_piece = weight_piece(index, "gate_up", 0, keys[0])
                return [gate_piece,
                        weight_piece(index, "gate_up", gate_piece.source.shape[0], keys[1]),
                        weight_piece(index, "down", 0, keys[2])]
        raise CheckpointError(f"checkpoint {index.root} has no tensors for expert {expert} of {name} (looked for "
                              f"{checkpoint_key_candidates(name, renames)[0]}.{expert}.{gate}.weight and the fused "
                              f"gate_up_proj/down_proj keys)")

    def _names_for(self, index: CheckpointIndex, name: str) -> tuple[str, str, str]:
        for family in self.FAMILIES.values():
            if any(f"{p}.0.{family[1][0]}.weight" in index for p in checkpoint_key_candidates(name, family[2])):
                return family[1]
        return ("gate_proj", "up_proj", "down_proj")

    def _renames_for(self, name: str) -> tuple[tuple[str, str], ...]:
        return tuple(r for family in self.FAMILIES.values() for r in family[2])

    def expert_tensors(self, module: nn.Module, expert: int) -> dict[str, torch.Tensor]:
        return {"gate_up": module.gate_up_proj.data[expert], "down": module.down_proj.data[expert]}

    def set_expert_params(self, module: nn.Module, stacked: dict[str, torch.Tensor]) -> None:
        for pname, part in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
            restore_parameter(module, pname, stacked[part])

    def expert_state(self, layer: MoELayer, stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"gate_up_proj": stacked["gate_up"], "down_proj": stacked["down"]}

    def release_expert_params(self, module: nn.Module) -> None:
        for pname in ("gate_up_proj", "down_proj"):
            release_parameter(module, pname)

    def router_module(self, model: nn.Module, layer: MoELayer) -> nn.Module:
        return model.get_submodule(layer.name.rsplit(".", 1)[0]).gate

    def router_logits(self, output) -> torch.Tensor:
        return output[0]                                            # (router_logits [T, E], scores, indices)

    def routing_from_logits(self, router: nn.Module, logits: torch.Tensor, output):
        probs = torch.softmax(logits.float(), dim=-1)               # [T, E]
        top_value, top_index = torch.topk(probs, router.top_k, dim=-1)   # [T, k]
        if getattr(router, "norm_topk_prob", True):                 # Mixtral always renormalises
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return logits.to(output[0].dtype), top_value.to(output[1].dtype), top_index

    def attach(self, model: nn.Module, layer: MoELayer, runtime) -> None:
        layer.module._hf_moe_offload = runtime
        if not hasattr(model, _PREVIOUS_IMPL):
            setattr(model, _PREVIOUS_IMPL, model.config._experts_implementation)
            model.set_experts_implementation(EXPERTS_IMPLEMENTATION)

    def detach(self, model: nn.Module, layer: MoELayer) -> None:
        if hasattr(layer.module, "_hf_moe_offload"):
            del layer.module._hf_moe_offload
        previous = getattr(model, _PREVIOUS_IMPL, None)
        if previous is not None:
            delattr(model, _PREVIOUS_IMPL)
            model.set_experts_implementation(previous)


register_arch(FusedExpertsArch())
