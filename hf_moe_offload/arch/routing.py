"""Router kinds: how a family's router turns logits [T, E] into each token's experts and weights, rebuilt outside
the model so that look-ahead prefetch, `eviction="lookahead"`, SiDA hash training and predicted routing work for
every supported family, not only softmax `gate` routers.

A `RouterKind` is read off the live router (and its MoE block), never off a list of model types:

- score function: softmax or sigmoid over the logits (or Phi-MoE's `sparsemixer`, the family's own function);
- a correction bias (`e_score_correction_bias`, `expert_bias`, Ernie's `moe_statics`, a bias the block passes in),
  added to the scores or to the raw logits before the top-k (it changes the choice, never the weights);
- group-limited top-k (`n_group` groups, keep `topk_group`), groups scored by the sum of their two best (DeepSeek-V3
  style) or by their best (DeepSeek-V2's `group_limited_greedy`);
- renormalisation of the top-k weights, a scaling factor held by the router (`routed_scaling_factor`, `route_scale`,
  `router_scaling_factor`; a factor the block applies after the experts is not part of the routing), a per-expert
  scale (Gemma-4);
- where the logits come from: the router's first output, which Gemma-4 gives as probabilities (their log is used).

Attributes name the candidates; which candidate the router really computes is settled by probing its own forward
once with random hidden states and keeping the first candidate that reproduces its indices and weights. A router no
candidate reproduces (Zaya's skip expert and cross-layer state, Inkling's shared experts inside the softmax) gets a
kind with `refused` (nothing rebuilt) or `weights_refused` (the experts are rebuilt, not their weights): the error is
raised only where the rebuilt routing is used (`check`), never at load.

Example:
    >>> kind = get_arch(model.config).router_kind(model, layer)                     # doctest: +SKIP
    >>> weights, indices = kind.select(logits)          # [T, k] each, as the model computes them
    >>> kind.experts_for(hidden_states)                 # [T, k]: what the router would pick for these inputs
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import sys
from typing import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

_KIND_ATTR = "_hf_moe_offload_router_kind"
# Router attributes holding a factor the router multiplies its top-k weights by.
_SCALE_ATTRS = ("routed_scaling_factor", "route_scale", "router_scaling_factor")
_PROBE_TOKENS = 64


class RoutingUnsupportedError(ValueError):
    """The family's routing cannot be rebuilt outside its router, so a feature that needs it is refused."""


@dataclasses.dataclass
class RouterKind:
    """How one router routes; `select` is its top-k, `experts_for` its choice for given hidden states.

    Example:
        >>> kind = RouterKind(router=None, num_experts=4, top_k=2, score="softmax", normalize=True)
        >>> w, i = kind.select(torch.tensor([[4.0, 3.0, 0.0, -1.0]]))
        >>> sorted(i[0].tolist()), round(float(w.sum()), 4)
        ([0, 1], 1.0)
    """

    router: nn.Module | None
    num_experts: int
    top_k: int
    score: str = "softmax"                         # "softmax" | "sigmoid" | "sparsemixer"
    bias: Callable[[], torch.Tensor] | None = None  # the live correction bias [E] (looked up at each use)
    bias_on: str = "scores"                        # "scores" | "logits": what the bias is added to
    n_group: int = 1
    topk_group: int = 1
    group_rule: str = "top2sum"                    # "top2sum" | "max": a group's score
    normalize: bool = False
    scale: float = 1.0
    expert_scale: Callable[[], torch.Tensor] | None = None   # Gemma-4's per_expert_scale [E]
    logits_are_probs: bool = False                 # the router's first output is softmax probabilities
    extra_args: Callable[[], tuple] = lambda: ()   # tensors the block passes the router after the hidden states
    input_rank: int = 2                            # the router's forward takes [T, H] (2) or [1, T, H] (3)
    refused: str | None = None                     # why nothing can be rebuilt
    weights_refused: str | None = None             # why the experts are rebuilt but not their weights

    def describe(self) -> str:
        """One line: the kind as the docs name it."""
        if self.refused:
            return f"not rebuilt: {self.refused}"
        parts = [self.score]
        if self.bias is not None:
            parts.append(f"correction bias on {self.bias_on}")
        if self.n_group > 1:
            parts.append(f"group top-k ({self.topk_group} of {self.n_group}, {self.group_rule})")
        parts += ["renormalised"] * (self.normalize and self.score != "sparsemixer")
        parts += [f"x{self.scale:g}"] * (self.scale != 1.0)
        parts += ["per-expert scale"] * (self.expert_scale is not None)
        return ", ".join(parts)

    def check(self, feature: str, weights: bool = False) -> None:
        """Raise `RoutingUnsupportedError` naming `feature` if this kind cannot serve it (`weights`: it needs the
        top-k weights too, as predicted routing does)."""
        why = self.refused or (self.weights_refused if weights else None)
        if why:
            raise RoutingUnsupportedError(
                f"{feature} needs the router's routing rebuilt from its logits, which hf_moe_offload cannot do for "
                f"{type(self.router).__name__}: {why}; allowed: routers whose top-k hf_moe_offload rebuilds "
                f"(softmax or sigmoid scores, correction bias, group-limited top-k, renormalisation, scaling)")

    # -- logits -> routing ----------------------------------------------------------------------------------------

    def logits(self, output) -> torch.Tensor:
        """Router logits [T, E] (float32) from the router's forward `output`."""
        first = output[0] if isinstance(output, (tuple, list)) else output
        first = first.reshape(-1, first.shape[-1]).float()
        return torch.log(first.clamp_min(torch.finfo(torch.float32).tiny)) if self.logits_are_probs else first

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, indices [T, k]) exactly as the router computes them from `logits` [T, E]."""
        x = logits.reshape(-1, logits.shape[-1]).float()
        if self.score == "sparsemixer":
            fn = getattr(sys.modules[type(self.router).__module__], "sparsemixer")
            weights, indices = fn(x, jitter_eps=self.router.router_jitter_noise, training=False, top_k=self.top_k)
            return weights.float(), indices
        scores = torch.softmax(x, dim=-1) if self.score == "softmax" else torch.sigmoid(x)
        choice = scores if self.bias_on == "scores" else x
        if self.bias is not None:
            choice = choice + self.bias().to(choice.device, torch.float32).reshape(-1)
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1) if self.group_rule == "top2sum" \
                else grouped.max(dim=-1).values
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        indices = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scale
        if self.expert_scale is not None:
            weights = weights * self.expert_scale().to(weights.device, torch.float32)[indices]
        return weights, indices

    # -- hidden states -> experts (look-ahead) --------------------------------------------------------------------

    def router_output(self, hidden_states: torch.Tensor):
        """The router's own forward on `hidden_states` [T, H] (no hooks run: a hook replacing the output, as
        predicted routing does, must not steer a look-ahead guess)."""
        weight = next(self.router.parameters(), None)
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        if weight is not None:
            hidden = hidden.to(weight.device)
        if self.input_rank == 3:
            hidden = hidden[None]
        return self.router.forward(hidden, *self.extra_args())

    def experts_for(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Indices [T, k]: the experts each token of `hidden_states` [T, H] would be routed to by this router."""
        return self.select(self.logits(self.router_output(hidden_states)))[1]


class _CachedKind:
    """A router's kind, cached on the router. Its getters read that router's own module: a copy or pickle of the
    model gets no cache (its routers are probed again on first use), never one that reads the original."""

    def __init__(self, kind: RouterKind | None = None):
        self.kind = kind

    def __deepcopy__(self, memo: dict) -> "_CachedKind":
        return _CachedKind()

    def __reduce__(self) -> tuple:
        return _CachedKind, ()


def kind_of(router: nn.Module) -> RouterKind | None:
    """The kind `router_kind` built for `router`, if any."""
    cached = getattr(router, _KIND_ATTR, None)
    return cached.kind if cached is not None else None


def router_kind(router: nn.Module, block: nn.Module | None, num_experts: int, top_k: int, hidden_size: int
                ) -> RouterKind:
    """Read `router`'s kind off its attributes (and `block`'s, which may hold the correction bias it passes in),
    settled by probing its forward; cached on the router. Never raises for an unsupported router: the kind says why
    (`refused`, `weights_refused`) and `RouterKind.check` raises where a feature needs it.

    Example:
        >>> block = model.model.layers[0].mlp                                                # doctest: +SKIP
        >>> router_kind(block.gate, block, 8, 2, 4096).describe()                            # doctest: +SKIP
        'sigmoid, correction bias on scores, group top-k (4 of 8, top2sum), renormalised, x2.5'
    """
    kind = kind_of(router)
    if kind is not None and kind.num_experts == num_experts and kind.top_k == top_k:
        return kind
    kind = _build(router, block, num_experts, top_k, hidden_size)
    setattr(router, _KIND_ATTR, _CachedKind(kind))
    logger.debug("router %s: %s", type(router).__name__, kind.describe())
    return kind


def _live(module: nn.Module, name: str) -> Callable[[], torch.Tensor]:
    """A getter for `module.<name>` (buffers are replaced, not updated, by `.to()`, so no tensor is kept)."""
    if name in dict(module.named_parameters()):
        return lambda: module.get_parameter(name)
    return lambda: module.get_buffer(name)


def _extras(router: nn.Module, block: nn.Module | None) -> tuple[Callable[[], tuple], list, str | None]:
    """The block tensors the router's forward takes after the hidden states (AFMoE's `expert_bias`, HY-V3's and
    MiniMax-M2's `e_score_correction_bias`), as a getter, and as bias getters; or why they are unknown."""
    try:
        params = list(inspect.signature(router.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return (lambda: ()), [], None
    names = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break
        held = block is not None and isinstance(getattr(block, p.name, None), torch.Tensor)
        if p.default is not p.empty and not held:
            break                       # optional and not held by the block (LFM2-MoE passes its expert_bias)
        if not held:
            return (lambda: ()), [], f"its forward takes {p.name!r}, which its MoE block does not hold"
        names.append(p.name)
    getters = [_live(block, n) for n in names]
    return (lambda: tuple(g() for g in getters)), getters, None


def _bias_candidates(router: nn.Module, num_experts: int, block_biases: list) -> list:
    found = list(block_biases)
    for name, tensor in itertools.chain(router.named_parameters(), router.named_buffers()):
        last = name.rsplit(".", 1)[-1]
        if "bias" in last and last != "bias" and tensor.numel() == num_experts and tensor.is_floating_point():
            found.append(_live(router, name))
    return found


def _build(router: nn.Module, block: nn.Module | None, num_experts: int, top_k: int, hidden_size: int
           ) -> RouterKind:
    extra_args, block_biases, why = _extras(router, block)
    if why:
        return RouterKind(router, num_experts, top_k, refused=why)
    # The candidates the attributes allow, most plausible first; the probe keeps the first that matches.
    biases = _bias_candidates(router, num_experts, block_biases)
    n_group = int(getattr(router, "n_group", getattr(router, "num_group", 1)) or 1)
    topk_group = int(getattr(router, "topk_group", n_group) or n_group)
    if n_group > 1 and num_experts % n_group:
        n_group = 1
    norm_attr = getattr(router, "norm_topk_prob", None)
    scales = [float(v) for a in _SCALE_ATTRS if isinstance(v := getattr(router, a, None), (int, float))
              and not isinstance(v, bool)]
    global_scale = getattr(router, "global_scale", None)
    if isinstance(global_scale, torch.Tensor) and global_scale.numel() == 1:
        scales = [s * float(global_scale.detach()) for s in scales] or [float(global_scale.detach())]
    expert_scale = _live(router, "per_expert_scale") if isinstance(getattr(router, "per_expert_scale", None),
                                                                    torch.Tensor) else None
    selection = getattr(router, "expert_selection_fn", None)
    scores = ["sigmoid", "softmax"] if biases or selection == "sigmoid" or n_group > 1 and biases \
        else ["softmax", "sigmoid"]
    if selection in ("softmax", "sigmoid"):
        scores = [selection]
    if callable(getattr(sys.modules.get(type(router).__module__), "sparsemixer", None)) \
            and hasattr(router, "router_jitter_noise"):
        scores = ["sparsemixer"] + scores
    candidates = []
    for score, probs, norm, bias, bias_on, rule, scale in itertools.product(
            scores, (False, True), (True, False) if norm_attr is None else (bool(norm_attr),),
            biases + [None] if biases else [None], ("scores", "logits"),
            ("top2sum", "max") if n_group > 1 else ("top2sum",), scales + [1.0] if scales else [1.0]):
        if score == "sparsemixer" and (probs or bias is not None or not norm or scale != 1.0 or bias_on != "scores"):
            continue
        if bias is None and bias_on == "logits":
            continue
        candidates.append(RouterKind(router, num_experts, top_k, score, bias, bias_on, n_group, topk_group, rule,
                                     norm, scale, expert_scale, probs, extra_args))
    return _probe(router, candidates, num_experts, top_k, hidden_size, extra_args)


def _probe(router: nn.Module, candidates: list[RouterKind], num_experts: int, top_k: int, hidden_size: int,
           extra_args) -> RouterKind:
    """The first candidate that reproduces the router's own output on random hidden states."""
    weight = next(router.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return RouterKind(router, num_experts, top_k, refused="its weights are not loaded (meta device)")
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(_PROBE_TOKENS, hidden_size, generator=generator)
    dtype = weight.dtype if weight.is_floating_point() else torch.float32
    hidden = (hidden * 2.0).to(weight.device, dtype)
    output, rank, errors = None, 2, []
    with torch.no_grad():
        for rank in (2, 3):
            try:
                output = router.forward(hidden if rank == 2 else hidden[None], *extra_args())
                break
            except Exception as exc:   # noqa: BLE001  (a router that wants [B, T, H], or cannot run alone)
                errors.append(f"{type(exc).__name__}: {exc}")
        if output is None:
            return RouterKind(router, num_experts, top_k, refused=f"its forward cannot run alone ({errors[-1]})")
        if not isinstance(output, (tuple, list)) or len(output) < 3:
            return RouterKind(router, num_experts, top_k, refused="its forward does not return (logits, weights, "
                              "indices); top-k computed in the MoE block is not rebuilt")
        first, want_w, want_i = output[0], output[1], output[2]
        if first.shape[-1] != num_experts:
            return RouterKind(router, num_experts, top_k, refused=f"its logits have {first.shape[-1]} columns for "
                              f"{num_experts} experts (e.g. a skip expert)")
        want_i = want_i.reshape(-1, top_k)
        want_w = want_w.reshape(-1, top_k).float()
        order = want_i.argsort(dim=-1)
        want_i, want_w = want_i.gather(1, order), want_w.gather(1, order)
        tol = max(1e-5, 4 * torch.finfo(output[1].dtype).eps if output[1].is_floating_point() else 1e-5)
        indices_only, near, near_rows = None, None, 0.0
        for kind in candidates:
            kind.input_rank = rank
            try:
                got_w, got_i = kind.select(kind.logits(output))
            except Exception:   # noqa: BLE001  (a candidate that does not fit the shapes)
                continue
            order = got_i.argsort(dim=-1)
            got_i, got_w = got_i.gather(1, order), got_w.gather(1, order)
            rows = (got_i.to(want_i.device) == want_i).all(dim=-1)
            close = torch.isclose(got_w.to(want_w.device), want_w, atol=tol, rtol=tol).all(dim=-1)
            if bool(rows.all()):
                if bool(close.all()):
                    return kind
                indices_only = indices_only or kind
            elif float((rows & close).float().mean()) > max(near_rows, 0.9):
                near, near_rows = kind, float((rows & close).float().mean())   # low-precision ties broken apart
    if near is not None and indices_only is None:
        logger.debug("router %s: kind matched on %.0f%% of the probe tokens", type(router).__name__, 100 * near_rows)
        return near
    if indices_only is not None:
        indices_only.weights_refused = ("its top-k weights depend on more than its logits output (e.g. shared "
                                        "experts scored in the same softmax)")
        return indices_only
    return RouterKind(router, num_experts, top_k, input_rank=rank,
                      refused="no softmax/sigmoid top-k (with or without correction bias, groups, renormalisation, "
                              "scaling) reproduces its choice")


def replacement_output(kind: RouterKind, logits: torch.Tensor, output):
    """The router's forward `output` with `logits` [T, E] deciding instead, in the same structure and dtypes:
    what predicted routing returns from the router's forward hook."""
    if not isinstance(output, (tuple, list)):        # logits only: the block's own top-k decides from them
        return logits.to(output.dtype).reshape(output.shape)
    weights, indices = kind.select(logits)
    first = torch.softmax(logits.float(), dim=-1) if kind.logits_are_probs else logits
    out = list(output)
    out[0] = first.to(output[0].dtype).reshape(output[0].shape)
    out[1] = weights.to(output[1].dtype).reshape(output[1].shape)
    out[2] = indices.to(output[2].dtype).reshape(output[2].shape)
    return type(output)(out) if isinstance(output, tuple) else out
