"""DBRX: experts outside transformers' `ExpertsInterface`. `DbrxExperts.mlp` (`DbrxExpertGLU`) holds
`w1`, `v1`, `w2`, each [E * F, H] with expert e in rows [e * F, (e + 1) * F); the expert computes
`(act(x @ w1_e.T) * (x @ v1_e.T)) @ w2_e` (so `w2_e` [F, H] is used transposed against `F.linear`).

In a Hub checkpoint (and as `save_pretrained` writes it) the three tensors are stored as they are in memory
(`transformer.blocks.{i}.ffn.experts.mlp.w1`, ...): an expert is a contiguous block of F rows of each.

The adapter swaps the FFN's `experts` child for `OffloadedDbrxExperts` (same call) and puts the original back on
detach.

Example:
    >>> model = AutoModelForCausalLM.from_pretrained("databricks/dbrx-base",                 # doctest: +SKIP
    ...                                              offload_policy={"store": "disk", "expert_cache": "25%"})
"""

from __future__ import annotations

import torch
from torch import nn

from ..storage.checkpoint import ByteRange, CheckpointError, CheckpointIndex
from .forward import MatmulSlabLayout, attach_runtime, matmul_refusal, run_routed_experts, runtime_of
from ..layout import ExpertPiece, MoELayer, SlabLayout, release_parameter, restore_parameter
from .base import ExpertFetcher, MoEArch, SwappedExpertsChild, checkpoint_key_candidates, register_arch

PARTS = ("w1", "v1", "w2")


def row_block(index: CheckpointIndex, key: str, start: int, rows: int) -> ByteRange:
    """Byte range of rows [start, start + rows) of tensor `key` (rows of the first dimension are contiguous).

    Example:
        >>> row_block(index, "transformer.blocks.0.ffn.experts.mlp.w1", 3 * 10752, 10752)   # doctest: +SKIP
    """
    e = index.entries[key]
    if not 0 <= start <= start + rows <= e.shape[0]:
        raise CheckpointError(f"{key} has {e.shape[0]} rows, rows {start}..{start + rows} requested ({e.path})")
    row_bytes = e.nbytes // e.shape[0]
    return ByteRange(e.path, e.offset + start * row_bytes, rows * row_bytes, e.dtype, (rows, *e.shape[1:]))


class OffloadedDbrxExperts(nn.Module):
    """Stands in for `DbrxExperts` (same call) while its experts are offloaded."""

    def __init__(self, original: nn.Module, runtime: ExpertFetcher) -> None:
        super().__init__()
        self.num_experts = original.num_experts
        self.hidden_size = original.hidden_size
        self.act = original.mlp.activation_fn
        attach_runtime(self, runtime)

    def expert(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """`DbrxExpertGLU` with the expert's weights: x [n, H] -> [n, H]."""
        h = self.act(x.matmul(w["w1"].T)) * x.matmul(w["v1"].T)       # [n, F]
        return h.matmul(w["w2"])

    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states [B, S, H] (or [T, H]); top_k_index, top_k_weights [T, k]. Output like DbrxExperts: [B, -1, H].
        batch = hidden_states.shape[0]
        x_all = hidden_states.reshape(-1, self.hidden_size)              # [T, H]
        # Summed as DbrxExperts does: into next_states of hidden_states' dtype, one expert at a time in expert order.
        out = run_routed_experts(runtime_of(self), x_all, top_k_index, self.num_experts, self.expert,
                                 routing_weights=top_k_weights, out_dtype=x_all.dtype, in_expert_order=True)
        return out.view(batch, -1, self.hidden_size)


class DbrxArch(SwappedExpertsChild, MoEArch):
    """DBRX (`dbrx`): experts in `DbrxExpertGLU` as w1/v1/w2 [E * F, H]."""

    model_types = ("dbrx",)
    offloaded_class = OffloadedDbrxExperts
    checkpoint_note = "fused: mlp.w1, mlp.v1, mlp.w2 ([E*F, H], F rows per expert)"

    def is_experts_module(self, module: nn.Module) -> bool:
        return type(module).__name__ == "DbrxExperts"

    def layout(self, module: nn.Module) -> SlabLayout:
        shape = (module.ffn_hidden_size, module.hidden_size)
        return MatmulSlabLayout(parts=tuple((part, shape) for part in PARTS),
                                quantize_refusal=matmul_refusal("DBRX", "w2 is used as x @ w2, [in, out]"))

    def top_k(self, config) -> int:
        return int(config.ffn_config.moe_top_k)

    def expert_pieces(self, index: CheckpointIndex, name: str, expert: int, layout: SlabLayout
                      ) -> list[ExpertPiece]:
        rows = dict(layout.parts)["w1"][0]
        for prefix in checkpoint_key_candidates(name):
            keys = {part: f"{prefix}.mlp.{part}" for part in PARTS}
            if all(k in index for k in keys.values()):
                return [ExpertPiece(part, 0, row_block(index, key, expert * rows, rows)) for part, key in keys.items()]
        raise CheckpointError(f"checkpoint {index.root} has no tensors for expert {expert} of {name} (looked for "
                              f"{checkpoint_key_candidates(name)[0]}.mlp.{{w1,v1,w2}})")

    def _split(self, module: nn.Module, param: str) -> torch.Tensor:
        return getattr(module.mlp, param).data.view(module.num_experts, module.ffn_hidden_size, module.hidden_size)

    def expert_tensors(self, module: nn.Module, expert: int) -> dict[str, torch.Tensor]:
        return {part: self._split(module, part)[expert] for part in PARTS}

    def set_expert_params(self, module: nn.Module, stacked: dict[str, torch.Tensor]) -> None:
        for part in PARTS:
            restore_parameter(module.mlp, part, stacked[part].reshape(-1, module.hidden_size))

    def expert_state(self, layer: MoELayer, stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"mlp.{part}": stacked[part].reshape(-1, stacked[part].shape[-1]) for part in PARTS}

    def release_expert_params(self, module: nn.Module) -> None:
        for part in PARTS:
            release_parameter(module.mlp, part)

    # -- routing: DbrxRouter returns logits [T, E]; the FFN takes softmax, top-k and the p-norm itself ----------

    def router_module(self, model: nn.Module, layer: MoELayer) -> nn.Module:
        return model.get_submodule(layer.name.rsplit(".", 1)[0]).router

    def router_weight(self, model: nn.Module, layer: MoELayer) -> torch.Tensor | None:
        return self.router_module(model, layer).layer.weight

    def router_logits(self, output, router: nn.Module | None = None) -> torch.Tensor:
        return output

    def routing_from_logits(self, router: nn.Module, logits: torch.Tensor, output):
        return logits.to(output.dtype)        # DbrxFFN.route_tokens_to_experts decides from these logits


register_arch(DbrxArch())
