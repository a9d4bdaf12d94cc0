"""GPT-OSS: `GptOssExperts` goes through transformers' `ExpertsInterface`, but with its own layout, which the fused
adapter does not compute: transposed weights (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`), biases
(`gate_up_proj_bias [E, 2I]`, `down_proj_bias [E, H]`) and interleaved gate/up columns with a clamped SwiGLU
(`GptOssExperts._apply_gate`, which is reused as is).

In a Hub checkpoint (and as `save_pretrained` writes it) the experts are the same four fused tensors; each expert
is row `e` of each. MXFP4 checkpoints (openai/gpt-oss-20b, -120b: `quantization_config` quant_method "mxfp4") hold
the two matrices as `gate_up_proj_blocks`/`_scales` and `down_proj_blocks`/`_scales`, [E, out, in/32, 16] codes and
[E, out, in/32] exponents, so an expert is again row `e`; its codes and exponents are read per expert and
dequantized, transposed, into the slab's dense [in, out] matrices as transformers' `Mxfp4Config(dequantize=True)`
load computes them (`checkpoint.read_mxfp4_into`; same bits). The biases are dense in both.

The offloaded forward is registered in `ExpertsInterface` as "hf_moe_offload_gpt_oss"; attaching selects it and
detaching restores the model's previous experts implementation.

Example:
    >>> model = AutoModelForCausalLM.from_pretrained("openai/gpt-oss-20b",           # doctest: +SKIP
    ...                                              offload_policy={"store": "disk", "expert_cache": "25%"})
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from ..storage.checkpoint import MXFP4_BLOCK, CheckpointError, CheckpointIndex, Mxfp4Scales
from .forward import MatmulSlabLayout, matmul_refusal, run_routed_experts, runtime_of
from ..layout import ExpertPiece, MoELayer, SlabLayout
from .base import MoEArch, StackedParams, checkpoint_key_candidates, register_arch, weight_piece
from .implementation import restore_experts_implementation, select_experts_implementation

GPT_OSS_IMPLEMENTATION = "hf_moe_offload_gpt_oss"
# slab part -> the experts module's parameter (also its name in a Hub checkpoint)
PARAMS = {"gate_up": "gate_up_proj", "gate_up_bias": "gate_up_proj_bias", "down": "down_proj",
          "down_bias": "down_proj_bias"}
# slab part -> its MXFP4 codes' tensor in a Hub checkpoint (exponents: the same name ending in _scales)
MXFP4_PARAMS = {"gate_up": "gate_up_proj_blocks", "down": "down_proj_blocks"}


@torch.compiler.disable
def offloaded_gpt_oss_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """`ExpertsInterface` function for an offloaded `GptOssExperts`: per routed expert,
    `(_apply_gate(x @ gate_up + gate_up_bias)) @ down + down_bias`, weighted (`run_routed_experts`).

    hidden_states [T, H]; top_k_index, top_k_weights [T, k].
    """
    runtime = runtime_of(self)

    def expert_fn(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self._apply_gate(x @ w["gate_up"] + w["gate_up_bias"])                   # [n, I]
        return h @ w["down"] + w["down_bias"]                                        # [n, H]

    return run_routed_experts(runtime, hidden_states, top_k_index, self.num_experts, expert_fn,
                              routing_weights=top_k_weights)


ExpertsInterface.register(GPT_OSS_IMPLEMENTATION, offloaded_gpt_oss_experts_forward)


class GptOssArch(StackedParams, MoEArch):
    """GPT-OSS (`gpt_oss`): transposed, biased experts with interleaved gate/up and a clamped SwiGLU."""

    model_types = ("gpt_oss",)
    params = PARAMS
    checkpoint_note = ("fused: gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias; MXFP4 (gpt-oss-20b/-120b): "
                       "gate_up_proj_blocks/_scales, down_proj_blocks/_scales, dequantized as read")

    def is_experts_module(self, module: nn.Module) -> bool:
        return type(module).__name__ == "GptOssExperts"

    def layout(self, module: nn.Module) -> SlabLayout:
        _, h, two_i = module.gate_up_proj.shape
        return MatmulSlabLayout(
            parts=(("gate_up", (h, two_i)), ("gate_up_bias", (two_i,)), ("down", tuple(module.down_proj.shape[1:])),
                   ("down_bias", (h,))),
            quantize_refusal=matmul_refusal("GPT-OSS", "transposed weights [in, out] and biases"))

    def top_k(self, config) -> int:
        return int(config.get_text_config(decoder=True).num_experts_per_tok)

    def expert_pieces(self, index: CheckpointIndex, name: str, expert: int, layout: SlabLayout
                      ) -> list[ExpertPiece]:
        for prefix in checkpoint_key_candidates(name):
            keys = {part: f"{prefix}.{param}" for part, param in PARAMS.items()}
            if all(k in index for k in keys.values()):
                return [weight_piece(index, part, 0, key, expert) for part, key in keys.items()]
        for prefix in checkpoint_key_candidates(name):
            if any(f"{prefix}.{blocks}" in index for blocks in MXFP4_PARAMS.values()):
                return self._mxfp4_pieces(index, prefix, expert)
        prefix = checkpoint_key_candidates(name)[0]
        raise CheckpointError(f"checkpoint {index.root} has no tensors for expert {expert} of {name} (looked for "
                              f"{prefix}.{{{', '.join(PARAMS.values())}}})")

    def _mxfp4_pieces(self, index: CheckpointIndex, prefix: str, expert: int) -> list[ExpertPiece]:
        """An MXFP4 expert: its codes with their exponents (`CheckpointIndex.mxfp4_scales` checks both) and its
        dense biases; a missing tensor is named."""
        keys = {part: f"{prefix}.{blocks}" for part, blocks in MXFP4_PARAMS.items()}
        keys.update({part: f"{prefix}.{PARAMS[part]}" for part in ("gate_up_bias", "down_bias")})
        missing = [key for key in keys.values() if key not in index]
        if missing:
            raise CheckpointError(f"checkpoint {index.root} holds MXFP4 GPT-OSS experts under {prefix} but lacks "
                                  f"{', '.join(missing)} (an MXFP4 checkpoint has {', '.join(keys.values())} and "
                                  f"the matching _scales)")
        return [ExpertPiece(part, 0, index.locate(key, row=expert), index.mxfp4_scales(key, row=expert))
                if part in MXFP4_PARAMS else weight_piece(index, part, 0, key, expert) for part, key in keys.items()]

    def locate_expert(self, index: CheckpointIndex, name: str, expert: int, layout: SlabLayout
                      ) -> list[ExpertPiece]:
        """`expert_pieces`, checked to fill every slab part with its shape; MXFP4 codes [out, in/32, 16] count as
        the [in, out] matrix they dequantize into."""
        pieces = self.expert_pieces(index, name, expert, layout)
        if not any(isinstance(p.scales, Mxfp4Scales) for p in pieces):
            return super().locate_expert(index, name, expert, layout)
        shapes = dict(layout.parts)
        for p in pieces:
            if isinstance(p.scales, Mxfp4Scales):
                out_rows, groups, _ = p.source.shape
                got = (groups * MXFP4_BLOCK, out_rows)
            else:
                got = tuple(p.source.shape)
            if got != tuple(shapes[p.part]):
                raise CheckpointError(f"{p.source.path}: expert {expert} of {name} gives {p.part} the shape "
                                      f"{list(got)}{' once dequantized' if p.scales is not None else ''}, the model "
                                      f"expects {list(shapes[p.part])}")
        return pieces

    # -- routing: GptOssTopKRouter returns (logits [T, E], softmax over the top-k logits [T, k], indices [T, k]) --

    def router_module(self, model: nn.Module, layer: MoELayer) -> nn.Module:
        return model.get_submodule(layer.name.rsplit(".", 1)[0]).router

    def router_weight(self, model: nn.Module, layer: MoELayer) -> torch.Tensor | None:
        # The router also has a bias, which look-ahead's `hidden @ weight.T` leaves out: a guess, not a decision.
        return self.router_module(model, layer).weight

    def router_logits(self, output, router: nn.Module | None = None) -> torch.Tensor:
        return output[0]

    def routing_from_logits(self, router: nn.Module, logits: torch.Tensor, output):
        logits = logits.to(output[0].dtype)
        top_value, top_index = torch.topk(logits, router.top_k, dim=-1)               # [T, k]
        scores = torch.softmax(top_value, dim=1, dtype=top_value.dtype)
        return logits, scores.to(output[1].dtype), top_index

    def attach(self, model: nn.Module, layer: MoELayer, runtime) -> None:
        select_experts_implementation(model, layer, runtime, GPT_OSS_IMPLEMENTATION)

    def detach(self, model: nn.Module, layer: MoELayer) -> None:
        restore_experts_implementation(model, layer)


register_arch(GptOssArch())
