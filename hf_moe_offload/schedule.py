"""Choose each forward pass's schedule from its shape (MoE-Lightning's paged weights, Klotski's expert-aware
pipeline, FlexGen's block schedule, brought to the per-expert cache).

- **on_demand** (a few tokens: batch-1 decode): each layer fetches the experts its router picked; the cache's
  eviction policy decides what stays. Nothing is read speculatively.
- **stream** (a pass expected to touch most experts: prefill, batches of 8 and more, lm-eval batches): every
  expert is needed about once per pass, in forward order. The layer's loads are bounded by a small window of
  slots, so the rest of the cache holds a stable resident set (read zero times per pass) instead of churning, and
  while layer l computes, layer l+1's likely experts (its router applied to layer l's input: "look-ahead") are read
  into the window in forward order, most-routed first. Exact: each layer's own router still decides; a wrong guess
  costs bytes, never tokens.

The choice is per pass and visible in `hf_moe_offload.stats(model)["passes"]` and `["last_schedule"]`;
`repeat_reads` counts experts read twice in one pass.

Example:
    >>> round(expected_experts(tokens=1, num_experts=8, top_k=2), 2), round(expected_experts(8, 8, 2), 2)
    (2.0, 7.2)
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from .hooks import LayerHook

from .policy import AUTO

STREAM_SHARE = 0.5    # stream a pass expected to touch at least this share of a layer's experts


def expected_experts(tokens: int, num_experts: int, top_k: int) -> float:
    """Distinct experts a pass of `tokens` tokens touches in one layer if routing were uniform."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


class StreamPlanner(LayerHook):
    """Picks the schedule at each pass's first MoE layer and feeds the cache's read-ahead queue while streaming."""

    def __init__(self, engine, share: float = STREAM_SHARE):
        policy = engine.policy
        self.cache, self.counters, self.share = engine.cache, engine.stats, share
        self.schedule = policy.schedule           # "auto", or forced "on_demand" / "stream"
        self.lookahead = policy.prefetch == "lookahead"   # read ahead in on-demand passes too
        self.window = policy.stream_window       # concrete once the policy is resolved
        self.layers = {layer.index: layer for layer in engine.layers}
        stacks = [layer.name.split(".", 1)[0] for layer in engine.layers]   # Switch: "encoder" / "decoder"
        self.next_in_stack = {a.index: b.index for a, b, sa, sb in zip(engine.layers, engine.layers[1:], stacks,
                                                                        stacks[1:]) if sa == sb}
        self.stack = dict(zip(self.layers, stacks))
        self.router_weights = {layer.index: engine.arch.router_weight(engine.model, layer) for layer in engine.layers}
        self._local = threading.local()      # each generating thread's position in its own pass

    def before_experts(self, layer: int, hidden_states: torch.Tensor) -> None:
        last = getattr(self._local, "last_layer", None)
        if last is None or layer <= last or self.stack[layer] != self.stack[last]:
            self._begin_pass(layer, tokens=hidden_states.shape[0])
        self._local.last_layer = layer
        if self._local.streaming or self.lookahead:
            nxt = self.next_in_stack.get(layer)
            if nxt is not None:
                self.cache.read_ahead(nxt, self._likely_experts(nxt, hidden_states))

    def _begin_pass(self, layer: int, tokens: int) -> None:
        moe = self.layers[layer]
        if self.schedule == AUTO:
            streaming = expected_experts(tokens, moe.num_experts, moe.top_k) >= self.share * moe.num_experts
        else:
            streaming = self.schedule == "stream"
        self._local.streaming = streaming
        if streaming:
            self.cache.begin_pass(self.window)
        else:   # on demand; with prefetch="lookahead", room for the next layer's top-k guesses
            self.cache.begin_pass(None, ahead_room=moe.top_k if self.lookahead else 0)
        self.counters.record_pass("stream" if streaming else "on_demand")

    def _likely_experts(self, layer: int, hidden_states: torch.Tensor) -> list[int]:
        """Layer `layer`'s router applied to these hidden states: experts any token would pick, most-routed first."""
        weight = self.router_weights[layer]
        num_experts = self.layers[layer].num_experts
        if weight is None:
            return list(range(num_experts))
        logits = F.linear(hidden_states.to(weight.dtype), weight)                     # [T, E]
        top = logits.topk(self.layers[layer].top_k, dim=-1).indices.reshape(-1)       # [T*k]
        counts = torch.bincount(top, minlength=num_experts).cpu()                      # one host sync
        order = torch.argsort(counts, descending=True, stable=True)
        return [int(e) for e in order if counts[e] > 0]
