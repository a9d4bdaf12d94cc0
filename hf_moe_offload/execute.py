"""The offloaded experts forward: group tokens per expert, touch only experts that receive tokens, and compute the
experts already resident first while missing ones are still on their way (the cache's `fetch` order).

Shapes: T = tokens, H = hidden, k = experts per token, E = experts, I = expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ExpertsInterface

EXPERTS_IMPLEMENTATION = "hf_moe_offload"


def offloaded_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """`ExpertsInterface` function for fused experts (`self` is e.g. a `MixtralExperts` whose weights are offloaded).

    Results are written per (token, slot) and summed over the k slots at the end, like transformers' grouped_mm,
    so the order in which experts arrive does not change the numbers.
    """
    runtime = getattr(self, "_hf_moe_offload", None)
    if runtime is None:
        raise RuntimeError(f"{type(self).__name__} has no offloaded weights attached; "
                           f"experts_implementation={EXPERTS_IMPLEMENTATION!r} is only usable through hf_moe_offload")
    num_tokens, hidden = hidden_states.shape                      # [T, H]
    k = top_k_index.shape[-1]
    flat_experts = top_k_index.reshape(-1)                        # [T*k]
    flat_weights = top_k_weights.reshape(-1)                      # [T*k]
    order = torch.argsort(flat_experts, stable=True)              # [T*k] (token, slot) rows grouped by expert
    counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()   # one host sync per layer
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)

    out_dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
    weighted = hidden_states.new_empty(num_tokens * k, hidden, dtype=out_dtype)   # [T*k, H], every row written
    for expert, weights in runtime.fetch([e for e, c in enumerate(counts) if c]):
        rows = order[starts[expert]:starts[expert + 1]]          # [n] rows of this expert
        x = hidden_states[rows // k]                              # [n, H]
        h = self._apply_gate(F.linear(x, weights["gate_up"]))     # [n, I]
        y = F.linear(h, weights["down"])                          # [n, H]
        weighted[rows] = y * flat_weights[rows, None]
    return weighted.view(num_tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)   # [T, H]


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, offloaded_experts_forward)


class OffloadedSwitchExperts(nn.Module):
    """Stands in for `SwitchTransformersExperts` (same call) while its experts are offloaded."""

    def __init__(self, original: nn.Module, runtime) -> None:
        super().__init__()
        self.num_experts = original.num_experts
        self.act = original["expert_0"].act
        self.runtime = runtime
        # Kept outside the module tree (a list, not a child) so its meta parameters are not listed twice.
        self._original = [original]

    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states [T, H]; selected_experts [T, 1, E] one-hot (all zero where capacity dropped the token);
        # routing_weights [T, 1]
        mask = selected_experts[:, 0, :].bool()                   # [T, E]
        assigned = torch.where(mask.any(dim=1), mask.float().argmax(dim=1), -1)   # [T] expert or -1
        order = torch.argsort(assigned, stable=True)
        counts = torch.bincount(assigned + 1, minlength=self.num_experts + 1).tolist()[1:]
        start = int((assigned < 0).sum())                         # dropped tokens sort first
        out = torch.zeros_like(hidden_states)
        starts = {}
        for e, c in enumerate(counts):
            starts[e] = (start, start + c)
            start += c
        for expert, weights in self.runtime.fetch([e for e, c in enumerate(counts) if c]):
            tokens = order[starts[expert][0]:starts[expert][1]]   # [n]
            h = self.act(F.linear(hidden_states[tokens], weights["wi"]))       # [n, F]
            if h.dtype != weights["wo"].dtype:
                h = h.to(weights["wo"].dtype)
            y = F.linear(h, weights["wo"]) * routing_weights[tokens, 0, None]  # [n, H]
            out.index_add_(0, tokens, y.to(hidden_states.dtype))
        return out
