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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from ..hooks import LayerHook

logger = logging.getLogger(__name__)

LOOKAHEAD_LAYERS = 2


@dataclass
class Prediction:
    """The hash table for the tokens of one forward pass."""

    logits: torch.Tensor              # [tokens, predicted layers, E], tokens in the router's (batch, seq) order
    experts: list[list[int]]          # per predicted layer: the union of every token's predicted top-k experts
    ready: object | None = None       # CUDA event after the logits were computed (None on the CPU)


@dataclass
class _CallerState:
    """What one calling thread's generation has told the predictor: each thread generating on the model has its
    own, so concurrent `generate` calls never mix their tokens' predictions."""

    state: object | None = None       # a causal predictor's summary of the tokens so far
    batch: int = 0
    pending: Future | None = None
    table: Prediction | None = None


class HashPrefetcher(LayerHook):
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
        device = self.predictor.device
        # The hash thread works on its own CUDA stream, ordered after the caller's by an event (F4).
        self.cuda_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stream = model.get_encoder() if model.config.is_encoder_decoder else model.get_decoder()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_moe_offload_hash")
        self._callers = threading.local()
        self._times_lock = threading.Lock()
        self._warned_paged = False
        self.predict_s = 0.0
        self.wait_s = 0.0
        self._hooks = [self.stream.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        if routing == "predicted":
            for layer in engine.layers:
                if layer.index in self.axis_of:
                    router = arch.router_module(model, layer)
                    self._hooks.append(router.register_forward_hook(self._routing_hook(layer.index)))

    def _caller(self) -> _CallerState:
        caller = getattr(self._callers, "state", None)
        if caller is None:
            caller = self._callers.state = _CallerState()
        return caller

    # -- the hash-building thread ---------------------------------------------------------------------------------

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        caller = self._caller()
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or _is_continuous_batching(kwargs):
            # inputs_embeds only: nothing to hash. Continuous batching packs a different set of requests into one
            # row every pass, which a per-row causal state cannot follow: the router decides alone there.
            if ids is not None and self.routing == "predicted" and not self._warned_paged:
                logger.warning("hf_moe_offload: routing='predicted' is not applied under continuous batching "
                               "(generate_batch); the router decides")
                self._warned_paged = True
            caller.pending, caller.table = None, None
            return
        past = kwargs.get("past_key_values")
        new_sequence = past is None or past.get_seq_length() == 0 or caller.batch != ids.shape[0]
        caller.batch = ids.shape[0]
        mask = kwargs.get("attention_mask")
        if mask is not None and (mask.dim() != 2 or mask.shape[0] != ids.shape[0] or mask.shape[1] < ids.shape[1]):
            mask = None                                      # e.g. a 4D mask: predict without padding info
        new_mask = None if mask is None else mask[:, -ids.shape[1]:]   # the mask of the tokens in this pass
        inputs_ready = _record_event(ids.device)             # the caller's stream has produced ids and mask
        caller.table = None
        caller.pending = self._pool.submit(self._predict, caller, ids, new_mask, new_sequence, inputs_ready)

    @torch.no_grad()
    def _predict(self, caller: _CallerState, ids: torch.Tensor, mask: torch.Tensor | None, new_sequence: bool,
                 inputs_ready) -> Prediction:
        """Runs on the hash-building thread; calls are serialised, so each caller's causal state advances in order."""
        start = time.perf_counter()
        with _on_stream(self.cuda_stream, inputs_ready):
            embeddings = self.embeddings(ids).to(self.predictor.device)       # [B, n, H]
            mask = None if mask is None else mask.to(self.predictor.device)
            if self.predictor.config.causal:   # incremental: only the new tokens run through the LSTM
                current, caller.state = self.predictor.step(embeddings, mask, None if new_sequence else caller.state)
            else:                              # an encoder sees its whole input at once
                current = self.predictor.predict(embeddings, mask)           # [B, n, layers, E]
            flat = current.reshape(-1, *current.shape[2:])    # [B*n, layers, E]
            top = flat.topk(self.top_k, dim=-1).indices.cpu()   # [B*n, layers, k]: the one host sync
            ready = _record_event(flat.device)
        experts = [sorted(set(top[:, i].reshape(-1).tolist())) for i in range(top.shape[1])]
        with self._times_lock:
            self.predict_s += time.perf_counter() - start
        return Prediction(flat, experts, ready)

    # -- the inference thread ---------------------------------------------------------------------------------

    def _current(self) -> Prediction | None:
        caller = self._caller()
        if caller.table is None and caller.pending is not None:
            start = time.perf_counter()
            caller.table = caller.pending.result()
            caller.pending = None
            if caller.table.ready is not None:               # the caller's stream reads the logits after they exist
                torch.cuda.current_stream(caller.table.logits.device).wait_event(caller.table.ready)
            with self._times_lock:
                self.wait_s += time.perf_counter() - start
        return caller.table

    def on_pinned(self, layer: int) -> None:
        """This layer's experts are pinned: prefetch the next predicted layers' experts."""
        if not self.prefetches or layer not in self.axis_of:
            return
        table = self._current()
        if table is None:
            return
        position = self.order.index(layer)
        for ahead in self.order[position + 1:position + 1 + LOOKAHEAD_LAYERS]:
            self.engine.cache.prefetch(ahead, table.experts[self.axis_of[ahead]])

    def _routing_hook(self, layer_index: int):
        def replace_routing(module: nn.Module, args: tuple, output):
            table = self._current()
            ours = self.engine.arch.router_logits(output)
            if table is None or table.logits.shape[0] != ours.shape[0]:
                return output                                # no prediction for these tokens: the router decides
            logits = table.logits[:, self.axis_of[layer_index]].to(ours.device)
            return self.engine.arch.routing_from_logits(module, logits, output)

        return replace_routing

    def stats(self) -> dict[str, float]:
        with self._times_lock:
            return {"predictor_s": self.predict_s, "predictor_wait_s": self.wait_s}

    def reset_stats(self) -> None:
        with self._times_lock:
            self.predict_s = self.wait_s = 0.0

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._pool.shutdown(wait=True)


def _is_continuous_batching(forward_kwargs: dict) -> bool:
    """Whether a forward runs under transformers' continuous batching (packed sequences, a paged KV cache)."""
    return "cu_seq_lens_q" in forward_kwargs or type(forward_kwargs.get("cache")).__name__ == "PagedAttentionCache"


def _record_event(device: torch.device):
    """An event on `device`'s current CUDA stream, or None off CUDA."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class _on_stream:
    """Run on `stream` after `event` (both may be None: then nothing changes)."""

    def __init__(self, stream, event):
        self.stream, self.event = stream, event
        self._context = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.stream is None:
            return None
        if self.event is not None:
            self.stream.wait_event(self.event)
        return self._context.__enter__()

    def __exit__(self, *exc):
        if self._context is not None:
            self._context.__exit__(*exc)
