"""The offloaded experts forward: group tokens per expert, touch only experts that receive tokens, and compute the
experts already resident first while missing ones are still on their way (the cache's `fetch` order).

`run_routed_experts` is that loop, shared by every family; an adapter's forward gives it the family's per-expert
math. Every offloaded experts module reaches its runtime (an `ExpertFetcher`) through `runtime_of`, which
`attach_runtime` set.

Shapes: T = tokens, H = hidden, k = experts per token, E = experts, I = expert intermediate size.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from ..layout import SlabLayout
from ..memory import cpu_kernels
from .base import ExpertFetcher
from .grouped import can_run_grouped, run_over_slots

EXPERTS_IMPLEMENTATION = "hf_moe_offload"


def routes_on_host(expert_of_row: torch.Tensor) -> torch.Tensor:
    """`expert_of_row` [R] on the host: the one host sync of an offloaded layer (which experts to fetch is decided
    there). Refuses inside a CUDA graph capture, where the decision could not change from step to step."""
    if expert_of_row.is_cuda and _capturing(expert_of_row.device):
        raise RuntimeError("hf_moe_offload's offloaded experts cannot be captured in a CUDA graph: which experts "
                           "run is decided on the host at every step. Generate without CUDA graphs (no "
                           "torch.compile(mode='reduce-overhead'), no manual capture; generate_batch: pass "
                           "continuous_batching_config=hf_moe_offload.offload_batching_config(model), which sets "
                           "use_cuda_graph=False)")
    return expert_of_row.cpu()


def group_by_expert(expert_of_row: torch.Tensor, num_experts: int, on_host: torch.Tensor | None = None
                    ) -> dict[int, torch.Tensor]:
    """Rows grouped per expert: `{expert: its row indices}` for the experts that received any row.

    `expert_of_row` [R] holds an expert per row, or -1 for a row that goes to none (Switch's capacity drops);
    `on_host`: the same on the host, if the caller has it (`routes_on_host`). At most one host sync per call: the
    indices come to the host once and are sorted and counted there (on CUDA, `bincount` alone would sync twice
    more); the sorted row order goes back to the device in one copy.
    """
    on_host = routes_on_host(expert_of_row) if on_host is None else on_host
    order = torch.argsort(on_host, stable=True).to(expert_of_row.device, non_blocking=True)   # [R], -1 rows first
    counts = torch.bincount(on_host + 1, minlength=num_experts + 1).tolist()             # [1 + E]
    rows, start = {}, counts[0]
    for expert, count in enumerate(counts[1:]):
        if count:
            rows[expert] = order[start:start + count]
        start += count
    return rows


def slots_of_one_token(routed: list[int]) -> dict[int, slice] | None:
    """One token's routing `routed` [k] (-1: no expert) as `{expert: its slot}`, experts in ascending order like
    `group_by_expert`'s; None when an expert takes two of the token's slots (`group_by_expert` serves that). A slot
    is a one-row slice, so indexing with it copies nothing: the decode step of a single sequence skips the sort,
    the count and the gathers of the general path."""
    slots = {expert: slice(slot, slot + 1) for slot, expert in sorted(enumerate(routed), key=lambda s: s[1])
             if expert >= 0}
    return slots if len(slots) == sum(expert >= 0 for expert in routed) else None


def _capturing(device: torch.device) -> bool:
    """Whether `device`'s current stream is capturing a CUDA graph (the check looks at the current device only)."""
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def expert_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """`F.linear(x, weight)` for a dense weight (bfloat16 weights of a CPU store through their prepacked oneDNN
    copy, `memory.cpu_kernels`: same bits); a quantized weight (`hf_moe_offload.storage.quantize`) runs its own
    matmul (or dequantizes) where it lives."""
    if isinstance(weight, torch.Tensor):
        return cpu_kernels.linear(x, weight)
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


def _refuse_backward(output: torch.Tensor, hidden_states: torch.Tensor,
                     routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Attach a backward that raises when the caller's graph reaches the experts: through their input, or through
    the routing weights they were scaled by (a trainable router), which the loop applies without autograd."""
    wants_grad = hidden_states.requires_grad or (routing_weights is not None and routing_weights.requires_grad)
    if torch.is_grad_enabled() and wants_grad:
        return _NoBackwardThroughOffloadedExperts.apply(output.requires_grad_(True))
    return output


# The one name under which an offloaded experts module (transformers' own, or a swapped-in stand-in) holds the
# runtime its forward fetches experts from.
RUNTIME_ATTR = "_hf_moe_offload_runtime"


def attach_runtime(module: nn.Module, runtime: ExpertFetcher) -> None:
    """Give `module`'s offloaded forward the runtime to fetch its experts from (read back with `runtime_of`)."""
    # object.__setattr__: a runtime is no submodule or parameter of the model, whatever its type.
    object.__setattr__(module, RUNTIME_ATTR, runtime)


def detach_runtime(module: nn.Module) -> None:
    """Undo `attach_runtime` (nothing to do if none is attached)."""
    module.__dict__.pop(RUNTIME_ATTR, None)


def runtime_of(module: nn.Module) -> ExpertFetcher:
    """The runtime `attach_runtime` gave `module`; raises if it has none (the module runs outside hf_moe_offload)."""
    runtime = module.__dict__.get(RUNTIME_ATTR)
    if runtime is None:
        raise RuntimeError(f"{type(module).__name__} has no offloaded weights attached; its offloaded forward is "
                           f"only usable through hf_moe_offload")
    return runtime


# An expert's math: its input rows x [n, H] (already on the expert's device) and named weights -> rows [n, H].
ExpertFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def run_routed_experts(runtime: ExpertFetcher, hidden_states: torch.Tensor, routed_to: torch.Tensor,
                       num_experts: int, expert_fn: ExpertFn, *, routing_weights: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None, layer_input: torch.Tensor | None = None,
                       routed_on_host: torch.Tensor | None = None, in_expert_order: bool = False) -> torch.Tensor:
    """The routed-experts loop of every offloaded forward; a family gives only its per-expert math, `expert_fn`.

    `hidden_states` [T, H]; `routed_to` [T, k]: the expert of each token's k slots (-1: none). Only experts that
    receive a row are fetched, resident first. Each (token, slot) row gets `expert_fn(x, weights)`, times its
    `routing_weights` [T, k] if given, and the rows are summed over the k slots at the end, like transformers'
    grouped_mm, so the order in which experts arrive does not change the numbers; a slot of no expert adds zero.
    The sum is kept in `out_dtype` (default: `hidden_states` and `routing_weights` promoted); the result [T, H] is
    in `hidden_states.dtype`. `layer_input` is what the runtime's hooks see as the layer's input (default
    `hidden_states`); `routed_on_host`: `routed_to` already on the host, if the caller has it. `in_expert_order`:
    add a token's rows one at a time in ascending expert order instead, rounding to `out_dtype` after each add (a
    family whose own forward loops over the experts adding into its output, as DBRX does). Backward through the
    result raises (`_NoBackwardThroughOffloadedExperts`).

    Example:
        >>> out = run_routed_experts(runtime, x, top_k_index, num_experts,                      # doctest: +SKIP
        ...                          lambda x, w: F.linear(F.silu(F.linear(x, w["up"])), w["down"]),
        ...                          routing_weights=top_k_weights)
    """
    num_tokens, hidden = hidden_states.shape                      # [T, H]
    k = routed_to.shape[-1]
    on_host = routes_on_host(routed_to.reshape(-1)) if routed_on_host is None else routed_on_host.reshape(-1)
    # {expert: its (token, slot) rows [n]}, or for a single token {expert: its slot}
    rows_of = slots_of_one_token(on_host.tolist()) if num_tokens == 1 else None
    if rows_of is not None:
        tokens = [1] * len(rows_of)                               # what expert_compute="auto" weighs
    else:
        rows_of = group_by_expert(routed_to.reshape(-1), num_experts, on_host)
        tokens = [rows.numel() for rows in rows_of.values()]
    row_weights = None if routing_weights is None else routing_weights.reshape(-1)   # [T*k]
    if out_dtype is None:
        out_dtype = hidden_states.dtype if row_weights is None else torch.promote_types(hidden_states.dtype,
                                                                                        row_weights.dtype)
    shown = hidden_states if layer_input is None else layer_input
    with _expert_compute(), contextlib.closing(runtime.fetch(list(rows_of), shown, tokens)) as fetched:
        # Zeros only where some slot goes to no expert (Switch's capacity drops, Llama-4's unrouted experts).
        make = hidden_states.new_empty if sum(tokens) == num_tokens * k else hidden_states.new_zeros
        weighted = make(num_tokens * k, hidden, dtype=out_dtype)  # [T*k, H]
        for expert, weights in fetched:
            rows = rows_of[expert]                                # [n] (or a slice of one slot)
            x = hidden_states if isinstance(rows, slice) else hidden_states[rows // k if k > 1 else rows]  # [n, H]
            y = expert_fn(x.to(weights_device(weights)), weights).to(weighted.device)   # [n, H]
            weighted[rows] = y if row_weights is None else y * row_weights[rows, None]
        weighted = weighted.view(num_tokens, k, hidden)                                 # [T, k, H]
        out = (_sum_in_expert_order(weighted, on_host.view(num_tokens, k)) if in_expert_order
               else weighted.sum(dim=1)).to(hidden_states.dtype)                        # [T, H]
    return _refuse_backward(out, hidden_states, routing_weights)


def _sum_in_expert_order(weighted: torch.Tensor, routed_to: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H]: each token's k rows added into zeros one at a time, in ascending expert order, each add
    rounded to the rows' dtype (what a loop of `index_add_` over the experts computes)."""
    order = routed_to.to(weighted.device).argsort(dim=1, stable=True)                   # [T, k]
    rows = weighted.gather(1, order[:, :, None].expand_as(weighted))
    out = torch.zeros_like(rows[:, 0])
    for j in range(rows.shape[1]):
        out += rows[:, j]
    return out

# Host-side decisions at every step: compiling it (static-cache generate auto-compiles on CUDA) would only recompile.
@torch.compiler.disable
def offloaded_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """`ExpertsInterface` function for fused experts (`self` is e.g. a `MixtralExperts` whose weights are offloaded).

    The module's layout flags decide the math, as in transformers' own implementations: `is_transposed` weights
    ([in, out], Aria) are used as `x @ W`, others through `F.linear`; without a gate (`has_gate=False`, Nemotron-H)
    the slab's `up` part goes through the module's `act_fn` alone instead of `_apply_gate`.

    hidden_states [T, H]; top_k_index, top_k_weights [T, k].
    """
    runtime = runtime_of(self)
    project = _matmul if getattr(self, "is_transposed", False) else expert_linear

    if getattr(self, "has_gate", True):
        def expert_fn(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
            return project(self._apply_gate(project(x, w["gate_up"])), w["down"])      # [n, I] -> [n, H]
    else:
        def expert_fn(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
            return project(self.act_fn(project(x, w["up"])), w["down"])                # [n, I] -> [n, H]

    routed = None
    if can_run_grouped(self, runtime, hidden_states):
        routed = routes_on_host(top_k_index)                                             # [T, k]
        experts = torch.unique(routed).tolist()                                          # sorted, on the host
        if experts and experts[0] >= 0:
            with _expert_compute():
                out = run_over_slots(self, runtime, hidden_states, top_k_index, top_k_weights, experts)
            if out is not None:
                return _refuse_backward(out, hidden_states, top_k_weights)
    return run_routed_experts(runtime, hidden_states, top_k_index, self.num_experts, expert_fn,
                              routing_weights=top_k_weights, routed_on_host=routed)


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, offloaded_experts_forward)


@dataclass(frozen=True)
class MatmulSlabLayout(SlabLayout):
    """The slab of an expert whose weights are used as `x @ weight` (transposed against `F.linear`'s [out, in]) or
    added (biases): GPT-OSS, DBRX, Llama-4, and fused experts with `is_transposed=True` (Aria). int8/int4
    quantization packs [out, in] matrices for `F.linear`, so it does not apply; `quantize_refusal` is the message
    `QuantizedSlabLayout.build` raises instead.

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
