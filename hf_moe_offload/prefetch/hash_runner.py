"""Run a SiDA hash predictor beside the model during inference.

SiDA's two threads: a hash-building thread predicts, for every token of the batch, its experts at every MoE layer
(on the prompt before prefill, and on each new token during decode); the inference thread takes that table when it
reaches the first MoE layer and, from then on, loads each layer's predicted experts one or two layers ahead
(`cache.prefetch`, issued once the current layer's own experts are pinned, so nothing in use is evicted).

- `routing="router"` (default, exact): the router still decides; predictions only prefetch.
- `routing="predicted"` (SiDA's serving mode, approximate): the predicted logits replace the router's, through the
  router's own softmax/top-k (a forward hook on the router module).

Example:
    >>> model = AutoModelForCausalLM.from_pretrained(path, offload_policy={             # doctest: +SKIP
    ...     "store": "disk", "expert_cache": "25%", "prefetch": "hash", "predictor": "predictor/"})
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

LOOKAHEAD_LAYERS = 2


@dataclass
class Prediction:
    """The hash table for the tokens of one forward pass."""

    logits: torch.Tensor              # [tokens, predicted layers, E], tokens in the router's (batch, seq) order
    experts: list[list[int]]          # per predicted layer: the union of every token's predicted top-k experts


class HashPrefetcher:
    """Attaches a trained predictor to an offloaded model (see the module docstring)."""

    def __init__(self, engine, predictor: nn.Module, routing: str = "router"):
        self.engine, self.predictor, self.routing = engine, predictor, routing
        self.prefetches = engine.policy.prefetch == "hash"   # a predictor may serve routing="predicted" alone
        model, arch = engine.model, engine.arch
        axis = {name: i for i, name in enumerate(predictor.config.layer_names)}
        self.axis_of = {layer.index: axis[layer.name] for layer in engine.layers if layer.name in axis}
        self.order = sorted(self.axis_of)                    # engine layer indices with a prediction
        self.top_k = engine.layers[0].top_k
        self.embeddings = model.get_input_embeddings()
        self.predictor.to(next(self.embeddings.parameters()).device).eval()
        self.stream = model.get_encoder() if model.config.is_encoder_decoder else model.get_decoder()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_moe_offload_hash")
        self._state = None                                   # a causal predictor's summary of the tokens so far
        self._batch = 0
        self._pending: Future | None = None
        self._table: Prediction | None = None
        self.predict_s = 0.0
        self.wait_s = 0.0
        self._hooks = [self.stream.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        if routing == "predicted":
            for layer in engine.layers:
                if layer.index in self.axis_of:
                    router = arch.router_module(model, layer)
                    self._hooks.append(router.register_forward_hook(self._routing_hook(layer.index)))

    # -- the hash-building thread ---------------------------------------------------------------------------------

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:                                      # inputs_embeds only: nothing to hash
            self._pending, self._table = None, None
            return
        past = kwargs.get("past_key_values")
        new_sequence = past is None or past.get_seq_length() == 0 or self._batch != ids.shape[0]
        self._batch = ids.shape[0]
        mask = kwargs.get("attention_mask")
        if mask is not None and (mask.dim() != 2 or mask.shape[0] != ids.shape[0] or mask.shape[1] < ids.shape[1]):
            mask = None                                      # e.g. a 4D mask: predict without padding info
        new_mask = None if mask is None else mask[:, -ids.shape[1]:]   # the mask of the tokens in this pass
        self._table = None
        self._pending = self._pool.submit(self._predict, ids, new_mask, new_sequence)

    @torch.no_grad()
    def _predict(self, ids: torch.Tensor, mask: torch.Tensor | None, new_sequence: bool) -> Prediction:
        """Runs on the hash-building thread; calls are serialised, so the causal state advances in order."""
        start = time.perf_counter()
        embeddings = self.embeddings(ids).to(self.predictor.device)       # [B, n, H]
        mask = None if mask is None else mask.to(self.predictor.device)
        if self.predictor.config.causal:   # incremental: only the new tokens run through the LSTM
            current, self._state = self.predictor.step(embeddings, mask, None if new_sequence else self._state)
        else:                              # an encoder sees its whole input at once
            current = self.predictor.predict(embeddings, mask)           # [B, n, layers, E]
        flat = current.reshape(-1, *current.shape[2:])        # [B*n, layers, E]
        top = flat.topk(self.top_k, dim=-1).indices          # [B*n, layers, k]
        experts = [torch.unique(top[:, i]).tolist() for i in range(top.shape[1])]
        self.predict_s += time.perf_counter() - start
        return Prediction(flat, experts)

    # -- the inference thread ---------------------------------------------------------------------------------

    def _current(self) -> Prediction | None:
        if self._table is None and self._pending is not None:
            start = time.perf_counter()
            self._table = self._pending.result()
            self._pending = None
            self.wait_s += time.perf_counter() - start
        return self._table

    def on_layer(self, layer_index: int) -> Callable[[], None] | None:
        """The `on_pinned` callback for this layer's fetch: prefetch the next predicted layers."""
        if not self.prefetches or layer_index not in self.axis_of:
            return None

        def prefetch_ahead() -> None:
            table = self._current()
            if table is None:
                return
            position = self.order.index(layer_index)
            for ahead in self.order[position + 1:position + 1 + LOOKAHEAD_LAYERS]:
                self.engine.cache.prefetch(ahead, table.experts[self.axis_of[ahead]])

        return prefetch_ahead

    def _routing_hook(self, layer_index: int):
        def replace_routing(module: nn.Module, args: tuple, output):
            table = self._current()
            ours = self.engine.arch.router_logits(output)
            if table is None or table.logits.shape[0] != ours.shape[0]:
                return output                                # no prediction for these tokens: the router decides
            logits = table.logits[:, self.axis_of[layer_index]].to(ours.device)
            return self.engine.arch.routing_from_logits(module, logits, output)

        return replace_routing

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._pool.shutdown(wait=True)
