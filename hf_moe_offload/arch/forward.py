"""The offloaded experts forward: group tokens per expert, touch only experts that receive tokens, and compute the
experts already resident first while missing ones are still on their way (the cache's `fetch` order).

Shapes: T = tokens, H = hidden, k = experts per token, E = experts, I = expert intermediate size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from ..layout import SlabLayout

EXPERTS_IMPLEMENTATION = "hf_moe_offload"


def group_by_expert(expert_of_row: torch.Tensor, num_experts: int) -> dict[int, torch.Tensor]:
    """Rows grouped per expert: `{expert: its row indices}` for the experts that received any row.

    `expert_of_row` [R] holds an expert per row, or -1 for a row that goes to none (Switch's capacity drops).
    Exactly one host sync per call: the indices come to the host once and are sorted and counted there (on CUDA,
    `bincount` alone would sync twice more); the sorted row order goes back to the device in one copy.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("hf_moe_offload's offloaded experts cannot be captured in a CUDA graph: which experts "
                           "run is decided on the host at every step. Generate without CUDA graphs (no "
                           "torch.compile(mode='reduce-overhead'), no manual capture; generate_batch: pass "
                           "continuous_batching_config=hf_moe_offload.offload_batching_config(model), which sets "
                           "use_cuda_graph=False)")
    on_host = expert_of_row.cpu()                                                        # the one host sync
    order = torch.argsort(on_host, stable=True).to(expert_of_row.device, non_blocking=True)   # [R], -1 rows first
    counts = torch.bincount(on_host + 1, minlength=num_experts + 1).tolist()             # [1 + E]
    rows, start = {}, counts[0]
    for expert, count in enumerate(counts[1:]):
        if count:
            rows[expert] = order[start:start + count]
        start += count
    return rows


def expert_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """`F.linear(x, weight)` for a dense weight; a quantized weight (`hf_moe_offload.storage.quantize`) runs its own
    matmul (or dequantizes) where it lives."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight)
    return weight.linear(x)


def _matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight` for a transposed ([in, out]) expert weight, as transformers computes `is_transposed` experts;
    such layouts are `MatmulSlabLayout`s, so the weight is never quantized."""
    return x @ weight


def weights_device(weights: dict) -> torch.device:
    """Where an expert's weights are: the compute device, or the host for an expert computed on the CPU
    (`expert_compute="cpu"`/`"auto"`); its tokens go there and its output comes back."""
    return next(iter(weights.values())).device


class _NoBackwardThroughOffloadedExperts(torch.autograd.Function):
    """Identity in the forward; its backward refuses, with the reason, instead of returning wrong gradients (the
    cache slots the forward read are reused by later layers, and the experts have no parameters to update)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor) -> torch.Tensor:
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError("backward through hf_moe_offload's offloaded experts is not supported: their weights live "
                           "in a store, not in parameters, so they get no gradient and the input gradients cannot "
                           "be computed. Train with the experts resident (hf_moe_offload.disable(model)), or run "
                           "inference under torch.no_grad()")


def _expert_compute():
    """The context the expert loop runs in: no autograd graph over cache slots."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


def _refuse_backward(output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """Attach a backward that raises when the caller's graph reaches the experts."""
    if torch.is_grad_enabled() and hidden_states.requires_grad:
        return _NoBackwardThroughOffloadedExperts.apply(output.requires_grad_(True))
    return output


# Host-side decisions at every step: compiling it (static-cache generate auto-compiles on CUDA) would only recompile.
@torch.compiler.disable
def offloaded_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """`ExpertsInterface` function for fused experts (`self` is e.g. a `MixtralExperts` whose weights are offloaded).

    The module's layout flags decide the math, as in transformers' own implementations: `is_transposed` weights
    ([in, out], Aria) are used as `x @ W`, others through `F.linear`; without a gate (`has_gate=False`, Nemotron-H)
    the slab's `up` part goes through the module's `act_fn` alone instead of `_apply_gate`.

    Results are written per (token, slot) and summed over the k slots at the end, like transformers' grouped_mm,
    so the order in which experts arrive does not change the numbers.
    """
    runtime = getattr(self, "_hf_moe_offload", None)
    if runtime is None:
        raise RuntimeError(f"{type(self).__name__} has no offloaded weights attached; "
                           f"experts_implementation={EXPERTS_IMPLEMENTATION!r} is only usable through hf_moe_offload")
    num_tokens, hidden = hidden_states.shape                      # [T, H]
    k = top_k_index.shape[-1]
    flat_weights = top_k_weights.reshape(-1)                      # [T*k]
    rows_of = group_by_expert(top_k_index.reshape(-1), self.num_experts)   # (token, slot) rows per expert

    out_dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
    tokens = [rows.numel() for rows in rows_of.values()]          # what expert_compute="auto" weighs
    gated = getattr(self, "has_gate", True)
    project = _matmul if getattr(self, "is_transposed", False) else expert_linear
    with _expert_compute(), contextlib.closing(runtime.fetch(list(rows_of), hidden_states, tokens)) as fetched:
        weighted = hidden_states.new_empty(num_tokens * k, hidden, dtype=out_dtype)   # [T*k, H], every row written
        for expert, weights in fetched:
            rows = rows_of[expert]                                # [n] rows of this expert
            x = hidden_states[rows // k]                          # [n, H]
            where = weights_device(weights)
            if gated:
                h = self._apply_gate(project(x.to(where), weights["gate_up"]))   # [n, I]
            else:
                h = self.act_fn(project(x.to(where), weights["up"]))             # [n, I]
            y = project(h, weights["down"]).to(weighted.device)                 # [n, H]
            weighted[rows] = y * flat_weights[rows, None]
        out = weighted.view(num_tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)   # [T, H]
    return _refuse_backward(out, hidden_states)


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, offloaded_experts_forward)


class OffloadedSwitchExperts(nn.Module):
    """Stands in for `SwitchTransformersExperts` (same call) while its experts are offloaded."""

    def __init__(self, original: nn.Module, runtime) -> None:
        super().__init__()
        self.num_experts = original.num_experts
        self.act = original["expert_0"].act
        self.runtime = runtime

    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states [T, H]; selected_experts [T, 1, E] one-hot (all zero where capacity dropped the token);
        # routing_weights [T, 1]
        mask = selected_experts[:, 0, :].bool()                   # [T, E]
        assigned = torch.where(mask.any(dim=1), mask.float().argmax(dim=1), -1)   # [T] expert or -1
        tokens_of = group_by_expert(assigned, self.num_experts)
        counts = [tokens.numel() for tokens in tokens_of.values()]   # what expert_compute="auto" weighs
        with _expert_compute(), contextlib.closing(self.runtime.fetch(list(tokens_of), hidden_states,
                                                                       counts)) as fetched:
            out = torch.zeros_like(hidden_states)
            for expert, weights in fetched:
                tokens = tokens_of[expert]                        # [n]
                where = weights_device(weights)
                h = self.act(expert_linear(hidden_states[tokens].to(where), weights["wi"]))   # [n, F]
                if h.dtype != weights["wo"].dtype:
                    h = h.to(weights["wo"].dtype)
                y = expert_linear(h, weights["wo"]).to(out.device) * routing_weights[tokens, 0, None]  # [n, H]
                out.index_add_(0, tokens, y.to(hidden_states.dtype))
        return _refuse_backward(out, hidden_states)


@dataclass(frozen=True)
class MatmulSlabLayout(SlabLayout):
    """The slab of an expert whose weights are used as `x @ weight` (transposed against `F.linear`'s [out, in]) or
    added (biases): GPT-OSS, DBRX, Llama-4, and fused experts with `is_transposed=True` (Aria). int8/int4 quantization packs [out, in] matrices for `F.linear`, so it
    does not apply; `quantize_refusal` is the message `QuantizedSlabLayout.build` raises instead.

    Example:
        >>> MatmulSlabLayout(parts=(("up", (2, 4)),), quantize_refusal="no").numel
        8
    """

    quantize_refusal: str = ""


def matmul_refusal(family: str, why: str) -> str:
    """The quantize refusal of an adapter's `MatmulSlabLayout`: names the family, why, and what is allowed.

    Example:
        >>> matmul_refusal("DBRX", "w2 is [I, H]")[:32]
        "quantize='int8'/'int4' is not ava"
    """
    return (f"quantize='int8'/'int4' is not available for {family} experts ({why}; the quantized kernels take "
            f"[out, in] weights without bias); allowed for {family}: quantize='none' (exact)")
