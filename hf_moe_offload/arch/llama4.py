"""Llama-4 text (`llama4_text`, and the composite `llama4` loaded through `AutoModelForCausalLM`): experts outside
transformers' `ExpertsInterface`. `Llama4TextExperts` holds `gate_up_proj [E, H, 2I]` (gate columns first) and
`down_proj [E, I, H]`, used as `x @ w`. `Llama4TextMoe` routes with a sigmoid top-k router, scales each token's
input by its score before the experts (an unselected expert gets score sigmoid(-inf) = 0, so all-zero rows), calls
the experts on [E * T, H] and adds the shared expert, which stays resident.

The offloaded experts (`OffloadedLlama4Experts`, swapped in for the `experts` child) compute only the rows with a
nonzero input: an all-zero row gives an all-zero output (`act(0) * 0 @ down`), as in the original batched matmul.

In a Hub checkpoint the experts are the same fused tensors, row e per expert: `model.layers.{i}.feed_forward.
experts.gate_up_proj` for a text model, under `language_model.` for the composite model.

Example:
    >>> model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-4-Scout-17B-16E",     # doctest: +SKIP
    ...                                              offload_policy={"store": "disk", "expert_cache": "25%"})
"""

from __future__ import annotations

import torch
from torch import nn

from ..storage.checkpoint import CheckpointError, CheckpointIndex
from .forward import MatmulSlabLayout, attach_runtime, matmul_refusal, run_routed_experts, runtime_of
from ..layout import ExpertPiece, MoELayer, SlabLayout
from .base import ExpertFetcher, MoEArch, StackedParams, SwappedExpertsChild, checkpoint_key_candidates, \
    register_arch, weight_piece

PARAMS = {"gate_up": "gate_up_proj", "down": "down_proj"}


class OffloadedLlama4Experts(nn.Module):
    """Stands in for `Llama4TextExperts` (same call) while its experts are offloaded."""

    def __init__(self, original: nn.Module, runtime: ExpertFetcher) -> None:
        super().__init__()
        self.num_experts = original.num_experts
        self.hidden_size = original.hidden_size
        self.act_fn = original.act_fn
        attach_runtime(self, runtime)

    def expert(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """`Llama4TextExperts`' math for one expert: x [n, H] -> [n, H]."""
        gate, up = (x @ w["gate_up"]).chunk(2, dim=-1)                  # [n, I] each
        return (up * self.act_fn(gate)) @ w["down"]

    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states [E * T, H]: expert e's block is every token scaled by its score for e (0 if not routed).
        routed = hidden_states.view(self.num_experts, -1, self.hidden_size)          # [E, T, H]
        live = routed.ne(0).any(dim=-1)                                                 # [E, T]
        expert_ids = torch.arange(self.num_experts, device=live.device)[:, None].expand_as(live)
        routed_to = torch.where(live, expert_ids, -1).reshape(-1, 1)                    # [E * T, 1]
        # The hooks (look-ahead) see the layer's input: the sum over experts is it times the sum of its scores, a
        # positive factor that leaves every later router's top-k unchanged.
        shown = routed.sum(dim=0)                                                       # [T, H]
        # Each row is one (expert, token) pair already scaled by its score: no routing weights, one slot.
        return run_routed_experts(runtime_of(self), hidden_states, routed_to, self.num_experts, self.expert,
                                  layer_input=shown)


class Llama4Arch(StackedParams, SwappedExpertsChild, MoEArch):
    """Llama-4 text (`llama4_text`, `llama4`): transposed fused experts, sigmoid top-k router, a shared expert."""

    model_types = ("llama4", "llama4_text")
    params = PARAMS
    offloaded_class = OffloadedLlama4Experts
    checkpoint_note = "fused: gate_up_proj, down_proj"

    def is_experts_module(self, module: nn.Module) -> bool:
        return type(module).__name__ == "Llama4TextExperts"

    def layout(self, module: nn.Module) -> SlabLayout:
        _, h, two_i = module.gate_up_proj.shape
        return MatmulSlabLayout(parts=(("gate_up", (h, two_i)), ("down", tuple(module.down_proj.shape[1:]))),
                                quantize_refusal=matmul_refusal("Llama-4", "transposed weights [in, out]"))

    def top_k(self, config) -> int:
        return int(config.get_text_config(decoder=True).num_experts_per_tok)

    def expert_pieces(self, index: CheckpointIndex, name: str, expert: int, layout: SlabLayout
                      ) -> list[ExpertPiece]:
        candidates = checkpoint_key_candidates(name)
        # The composite model's checkpoint keeps the text model under `language_model.` (Hub and save_pretrained).
        candidates += ["language_model." + c for c in candidates if c.startswith("model.")]
        for prefix in candidates:
            keys = {part: f"{prefix}.{param}" for part, param in PARAMS.items()}
            if all(k in index for k in keys.values()):
                return [weight_piece(index, part, 0, key, expert) for part, key in keys.items()]
        raise CheckpointError(f"checkpoint {index.root} has no tensors for expert {expert} of {name} (looked for "
                              f"{candidates[0]}.gate_up_proj and .down_proj, also under language_model.)")

    # -- routing: Llama4Router (an nn.Linear) returns (sigmoid scores, -inf-masked to the top-k [T, E], logits) --

    def router_module(self, model: nn.Module, layer: MoELayer) -> nn.Module:
        return model.get_submodule(layer.name.rsplit(".", 1)[0]).router

    def router_logits(self, output, router: nn.Module | None = None) -> torch.Tensor:
        return output[1]

    def routing_from_logits(self, router: nn.Module, logits: torch.Tensor, output):
        logits = logits.to(output[1].dtype)
        top_value, top_index = torch.topk(logits, router.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, top_index, top_value)
        return torch.sigmoid(scores.float()).to(output[0].dtype), logits


register_arch(Llama4Arch())
