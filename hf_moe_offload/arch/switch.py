"""Switch Transformers (encoder-decoder, top-1 router with capacity): experts are a `ModuleDict` of
`DenseActDense(wi [F, H], wo [H, F])`, which transformers does not route through `ExpertsInterface`.

The adapter swaps the sparse MLP's `experts` child for `OffloadedSwitchExperts` (same call signature) and puts the
original back on detach; nothing at class level changes.
"""

from __future__ import annotations

import torch
from torch import nn

from ..storage.checkpoint import CheckpointError, CheckpointIndex
from .forward import attach_runtime, expert_linear, run_routed_experts, runtime_of
from ..layout import ExpertPiece, MoELayer, SlabLayout, release_parameter, restore_parameter
from .base import ExpertFetcher, MoEArch, SwappedExpertsChild, checkpoint_key_candidates, register_arch


class OffloadedSwitchExperts(nn.Module):
    """Stands in for `SwitchTransformersExperts` (same call) while its experts are offloaded."""

    def __init__(self, original: nn.Module, runtime: ExpertFetcher) -> None:
        super().__init__()
        self.num_experts = original.num_experts
        self.act = original["expert_0"].act
        self.dropout = original["expert_0"].dropout               # a child: train() / eval() reach it
        attach_runtime(self, runtime)

    def expert(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """`DenseActDense` with the expert's weights: x [n, H] -> [n, H]."""
        h = self.dropout(self.act(expert_linear(x, w["wi"])))     # [n, F]
        if h.dtype != w["wo"].dtype:
            h = h.to(w["wo"].dtype)
        return expert_linear(h, w["wo"])

    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states [T, H]; selected_experts [T, 1, E] one-hot (all zero where capacity dropped the token);
        # routing_weights [T, 1]
        mask = selected_experts[:, 0, :].bool()                   # [T, E]
        assigned = torch.where(mask.any(dim=1), mask.float().argmax(dim=1), -1)   # [T] expert or -1
        return run_routed_experts(runtime_of(self), hidden_states, assigned[:, None], self.num_experts, self.expert,
                                  routing_weights=routing_weights)


class SwitchArch(SwappedExpertsChild, MoEArch):
    model_types = ("switch_transformers",)
    offloaded_class = OffloadedSwitchExperts

    def is_experts_module(self, module: nn.Module) -> bool:
        return type(module).__name__ == "SwitchTransformersExperts"

    def layout(self, module: nn.Module) -> SlabLayout:
        first = module["expert_0"]
        return SlabLayout(parts=(("wi", tuple(first.wi.weight.shape)), ("wo", tuple(first.wo.weight.shape))))

    def top_k(self, config) -> int:
        return 1

    def expert_pieces(self, index: CheckpointIndex, name: str, expert: int, layout: SlabLayout
                      ) -> list[ExpertPiece]:
        for prefix in checkpoint_key_candidates(name):
            keys = [f"{prefix}.expert_{expert}.{n}.weight" for n in ("wi", "wo")]
            if all(k in index for k in keys):
                return [ExpertPiece("wi", 0, index.locate(keys[0])), ExpertPiece("wo", 0, index.locate(keys[1]))]
        raise CheckpointError(f"checkpoint {index.root} has no tensors for expert {expert} of {name} (looked for "
                              f"{name}.expert_{expert}.wi.weight)")

    def expert_tensors(self, module: nn.Module, expert: int) -> dict[str, torch.Tensor]:
        mlp = module[f"expert_{expert}"]
        return {"wi": mlp.wi.weight.data, "wo": mlp.wo.weight.data}

    def set_expert_params(self, module: nn.Module, stacked: dict[str, torch.Tensor]) -> None:
        for e in range(module.num_experts):
            for part in ("wi", "wo"):
                restore_parameter(getattr(module[f"expert_{e}"], part), "weight", stacked[part][e])

    def expert_state(self, layer: MoELayer, stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Each expert's tensor gets its own storage: views into one stacked tensor would look tied to every tool
        # that finds tied weights by storage (transformers' id_tensor_storage, safetensors, accelerate).
        return {f"expert_{e}.{part}.weight": stacked[part][e].clone()
                for e in range(layer.num_experts) for part in ("wi", "wo")}

    def release_expert_params(self, module: nn.Module) -> None:
        for e in range(module.num_experts):
            for part in ("wi", "wo"):
                release_parameter(getattr(module[f"expert_{e}"], part), "weight")

    def router_module(self, model: nn.Module, layer: MoELayer) -> nn.Module:
        return model.get_submodule(layer.name.rsplit(".", 1)[0]).router

    def router_weight(self, model: nn.Module, layer: MoELayer) -> torch.Tensor | None:
        return self.router_module(model, layer).classifier.weight

    def router_logits(self, output, router: nn.Module | None = None) -> torch.Tensor:
        logits = output[2]                                          # (expert_index, router_probs, logits [B,S,E])
        return logits.reshape(-1, logits.shape[-1])

    def routing_from_logits(self, router: nn.Module, logits: torch.Tensor, output):
        expert_index, router_probs, router_logits = output
        probs = torch.softmax(logits.float(), dim=-1)               # [T, E]
        top = probs.argmax(dim=-1)                                  # [T]; capacity is not enforced on predictions
        one_hot = torch.nn.functional.one_hot(top, num_classes=logits.shape[-1]).to(expert_index.dtype)
        return (one_hot.view(expert_index.shape), probs.max(dim=-1).values.to(router_probs.dtype).view(
            router_probs.shape), logits.to(router_logits.dtype).view(router_logits.shape))

    def routes_input_ids(self, layer: MoELayer) -> bool:
        return layer.name.startswith("encoder.")                    # the decoder routes the generated tokens


register_arch(SwitchArch())
