"""`LayerHook`: what prefetchers and observers implement to see each offloaded MoE layer as the forward reaches it
(the role accelerate's `ModelHook` plays around a module's forward).

The engine calls, per MoE layer and pass: `before_experts` (the layer's input hidden states, before anything is
fetched), `on_route` (the router has chosen, nothing fetched yet), `on_pinned`
(this layer's experts are pinned and their loads issued: the moment to prefetch for later layers, since nothing
this layer needs can be evicted), `on_layer_done` (its experts have computed). `stats()` adds counters to
`hf_moe_offload.stats(model)`; `close()` runs when the engine detaches.

Example:
    >>> class Recorder(LayerHook):
    ...     def __init__(self):
    ...         self.routed = []
    ...     def on_route(self, layer, experts):
    ...         self.routed.append((layer, list(experts)))
    >>> handle = hf_moe_offload.get_engine(model).add_hook(Recorder())   # doctest: +SKIP
    >>> handle.remove()                                                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Sequence

import torch


class LayerHook:
    """Override what you need; every method does nothing by default."""

    def before_experts(self, layer: int, hidden_states: torch.Tensor) -> None:
        """MoE layer `layer` is about to run on `hidden_states` [tokens, hidden] (its router's input)."""

    def on_route(self, layer: int, experts: Sequence[int]) -> None:
        """The router chose `experts` (unique, ascending) for this pass of MoE layer `layer`."""

    def on_pinned(self, layer: int) -> None:
        """`layer`'s experts are pinned and their loads issued."""

    def on_layer_done(self, layer: int) -> None:
        """`layer`'s experts have computed for this pass."""

    def stats(self) -> dict[str, float]:
        """Counters to merge into `hf_moe_offload.stats(model)`."""
        return {}

    def reset_stats(self) -> None:
        """`stats(model).reset()` was called: zero the counters `stats()` reports."""

    def close(self) -> None:
        """The engine detaches: release threads and hooks."""


class HookHandle:
    """Returned by `OffloadEngine.add_hook`; `remove()` detaches the hook (idempotent)."""

    def __init__(self, hooks: list[LayerHook], hook: LayerHook):
        self._hooks, self.hook = hooks, hook

    def remove(self) -> None:
        if self.hook in self._hooks:
            self._hooks.remove(self.hook)
