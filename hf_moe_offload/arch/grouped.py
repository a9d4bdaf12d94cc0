"""A layer whose routed experts are all in the cache already runs as one grouped computation over the cache's slots.

The per-expert loop (`forward.run_routed_experts`) launches a few small kernels per expert; with many small experts
per token (64 or 128 experts, top-8) and all of them resident, those launches dominate a GPU decode step. Here the
cache's slot memory is seen as transformers' stacked expert parameters ([slots, ...] per weight, zero-copy), the
routed expert ids become slot ids, and transformers' own `grouped_mm_experts_forward` runs the layer: the same math
as the resident model with `experts_implementation="grouped_mm"`.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from transformers.integrations.moe import grouped_mm_experts_forward

# Where the grouped kernel runs without a host sync of its own: CUDA in bfloat16 (other dtypes take transformers'
# per-group fallback, which reads the group sizes on the host; on the CPU the per-expert loop is as fast).
GROUPED_DEVICE_TYPES = ("cuda",)
GROUPED_DTYPES = (torch.bfloat16,)


class _SlotExperts:
    """A fused experts module as `grouped_mm_experts_forward` reads it, with the cache's slots as its experts."""

    _is_expert_parallel = False
    has_bias = False

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor]):
        self.module = module
        self.num_experts = weights["down"].shape[0]
        self.has_gate = getattr(module, "has_gate", True)
        self.is_transposed = getattr(module, "is_transposed", False)
        self.has_post_expert_norm = getattr(module, "has_post_expert_norm", False)
        self.gate_up_proj, self.up_proj, self.down_proj = weights.get("gate_up"), weights.get("up"), weights["down"]

    def _apply_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.module._apply_gate(x)

    def act_fn(self, x: torch.Tensor) -> torch.Tensor:
        return self.module.act_fn(x)

    def post_expert_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.module.post_expert_norm(x)


def can_run_grouped(module: nn.Module, runtime, hidden_states: torch.Tensor) -> bool:
    """Whether `module`'s layer may take the grouped path: the device and dtype of the grouped kernel, no biases,
    and a runtime that serves landed experts by slot."""
    return (hidden_states.device.type in GROUPED_DEVICE_TYPES and hidden_states.dtype in GROUPED_DTYPES
            and not getattr(module, "has_bias", False) and hasattr(runtime, "fetch_landed"))


def run_over_slots(module: nn.Module, runtime, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, experts: Sequence[int]) -> torch.Tensor | None:
    """The layer's output [T, H] from one grouped computation over the cache's slots, or None when some routed
    expert (`experts`, the distinct ids in `top_k_index` [T, k]) has not landed: the per-expert loop serves it."""
    out = None
    # Run to exhaustion, not closed early: resuming the runtime drops the slots' pins after the kernels below are
    # queued, and tells the hooks the layer is done.
    for slots, weights in runtime.fetch_landed(list(experts), hidden_states):
        slot_of = torch.zeros(module.num_experts, dtype=torch.int64)                   # [E] on the host
        slot_of[list(experts)] = torch.tensor(slots, dtype=torch.int64)
        if hidden_states.is_cuda:      # pinned, so the copy is queued without waiting for the device
            slot_of = slot_of.pin_memory().to(hidden_states.device, non_blocking=True)
        out = grouped_mm_experts_forward(_SlotExperts(module, weights), hidden_states, slot_of[top_k_index],
                                         top_k_weights)
    return out
