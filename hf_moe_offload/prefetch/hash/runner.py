"""Run a SiDA hash predictor beside the model during inference.

SiDA's two threads: a hash-building thread predicts, for every token of the batch, its experts at every MoE layer
(on the prompt before prefill, and on each new token during decode); the inference thread takes that table when it
reaches the first MoE layer and, from then on, loads each layer's predicted experts one or two layers ahead
(`cache.prefetch`, issued once the current layer's own experts are pinned, so nothing in use is evicted).

- `routing="router"` (default, exact): the router still decides; predictions only prefetch.
- `routing="predicted"` (SiDA's serving mode, approximate): the predicted logits replace the router's, through the
  router's own selection rebuilt by its `RouterKind` (softmax or sigmoid, correction bias, group-limited top-k,
  renormalisation, scaling; a forward hook on the router module). Routers it cannot rebuild are refused at attach.

Decode: step t+1's token exists only once step t's logits do, so as soon as they do (a forward hook on the model)
the hash thread predicts step t+1's table from the greedy token, while generate() picks the token. At step t+1's
start the guess is checked (on the CPU; on CUDA, where that would be a host sync, the hash thread checks it): right,
the table is ready before the first MoE layer and even that layer's experts are prefetched; wrong (sampling), the
table is predicted anew, and after 16 guesses with fewer than a quarter right no more guesses are made.

Only predictions likely to be used are prefetched, since a wrong one costs a copy and may evict an expert that
would have hit:

- *confidence*: of a layer's predicted top-k experts (union over the pass's tokens), only those whose estimated
  chance of being routed, 1 - prod over tokens (1 - min(1, k * p)) with p the predicted router probability, reaches
  `min_confidence`; most likely first;
- *share* (opt-in, `share_cap=True`): at most `num_slots // (LOOKAHEAD_LAYERS + 1)` (at least top-k) per layer
  ahead. Off by default: the cache already never lets a prefetch evict an expert needed sooner, and on the demo
  model the cap lowered the hit rate at batch 4 (docs/benchmarks.md);
- *per-layer shut-off*: each layer's precision (confident predictions the router then chose, over the last
  `precision_window`) is tracked online, also while the layer is off; a layer under `min_precision` is not
  prefetched until it climbs back.

`stats(model)` gains `hash_prefetch_issued` / `_used` / `_unused` (used or not by the pass they were issued for),
`hash_skipped_low_confidence`, `hash_skipped_layer_off`, `hash_skipped_no_room`, `hash_layers_off`, `hash_tables`
(tables built), `hash_tables_ready` (of those, ready when first asked for: no wait), `hash_speculated` /
`hash_speculation_hits` (next-token guesses made / right), `predictor_s` (time building tables) and
`predictor_wait_s` (time the inference thread waited for them).

Example:
    >>> model = AutoModelForCausalLM.from_pretrained(path, offload_policy={             # doctest: +SKIP
    ...     "store": "disk", "expert_cache": "25%", "prefetch": "hash", "predictor": "predictor/"})
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ..._compat import is_continuous_batching, kv_cache
from ...arch.routing import kind_of
from ...hooks import LayerHook
from ...storage.read_priority import submit_or_run

logger = logging.getLogger(__name__)

LOOKAHEAD_LAYERS = 2
# Defaults of the filters (see the module docstring); how they were chosen: docs/benchmarks.md.
MIN_CONFIDENCE = 0.5
MIN_PRECISION = 0.5
PRECISION_WINDOW = 64
MIN_SAMPLES = 16

_COUNTERS = ("hash_prefetch_issued", "hash_prefetch_used", "hash_prefetch_unused", "hash_skipped_low_confidence",
             "hash_skipped_layer_off", "hash_skipped_no_room", "hash_tables", "hash_tables_ready",
             "hash_speculated", "hash_speculation_hits")


@dataclass
class Prediction:
    """The hash table for the tokens of one forward pass."""

    logits: torch.Tensor              # [tokens, predicted layers, E], tokens in the router's (batch, seq) order
    experts: list[list[int]]          # per predicted layer: the union of every token's predicted top-k experts
    ready: object | None = None       # CUDA event after the logits were computed (None on the CPU)
    # per predicted layer: (expert, chance some token of the pass routes to it) for `experts`, most likely first
    ranked: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class _CallerState:
    """What one calling thread's generation has told the predictor: each thread generating on the model has its
    own, so concurrent `generate` calls never mix their tokens' predictions."""

    state: object | None = None       # a causal predictor's summary of the tokens so far
    seen: int | None = None           # how many tokens of the sequence it has summarized (None: unknown)
    batch: int = 0
    pending: Future | None = None
    table: Prediction | None = None
    predicted: dict = field(default_factory=dict)   # layer -> confident predictions for this pass (issued or not)
    issued: dict = field(default_factory=dict)      # layer -> experts this pass prefetched for it
    speculation: Future | None = None  # the next decode step's table, predicted from a guessed (greedy) token


def build_table(current: torch.Tensor, mask: torch.Tensor | None, top_k: int) -> Prediction:
    """Logits [B, n, layers, E] -> the table: per layer the predicted experts, ranked by chance of use."""
    flat = current.reshape(-1, *current.shape[2:])        # [B*n, layers, E]
    valid = None if mask is None else mask.reshape(-1).bool()
    chance = _chance_routed(flat, top_k, valid)           # [layers, E]
    top = flat.topk(top_k, dim=-1).indices               # [B*n, layers, k]
    if valid is not None:                                # padding routes nowhere (its row: any valid token's)
        top = top[valid] if bool(valid.any()) else top[:0]
    top, chance = top.cpu(), chance.cpu()                # host syncs of the hash thread, not of the model
    ready = _record_event(flat.device)
    experts = [sorted(set(top[:, i].reshape(-1).tolist())) for i in range(top.shape[1])]
    ranked = [sorted(((e, float(chance[i, e])) for e in layer), key=lambda pair: -pair[1])
              for i, layer in enumerate(experts)]
    return Prediction(flat, experts, ready, ranked)


class LayerPrecision:
    """Per predicted MoE layer: the share of its last `window` confident predictions the router chose, and the
    layers shut off for falling under `min_precision` (tracked while off too, so a layer can come back). Not
    locked: `HashPrefetcher` holds its lock around every call."""

    def __init__(self, layers: Sequence[int], min_precision: float, window: int, min_samples: int):
        self.min_precision, self.min_samples = min_precision, min_samples
        self.outcomes = {layer: deque(maxlen=window) for layer in layers}
        self.off: set[int] = set()

    def record(self, layer: int, predicted: Sequence[int], routed: set[int]) -> None:
        """Score `layer`'s confident predictions of a pass against the experts the router chose."""
        outcomes = self.outcomes[layer]
        outcomes.extend(e in routed for e in predicted)
        if len(outcomes) < self.min_samples:
            return
        precision = sum(outcomes) / len(outcomes)
        if precision < self.min_precision and layer not in self.off:
            self.off.add(layer)
            logger.info("hf_moe_offload: hash prefetch off for MoE layer %d (precision %.2f < %.2f)",
                        layer, precision, self.min_precision)
        elif precision >= self.min_precision and layer in self.off:
            self.off.discard(layer)
            logger.info("hf_moe_offload: hash prefetch back on for MoE layer %d (precision %.2f)",
                        layer, precision)

    def precision(self) -> dict[int, float | None]:
        return {layer: (sum(o) / len(o) if o else None) for layer, o in self.outcomes.items()}


class _Tally:
    """The counters and timers of `stats(model)` (hash_*, predictor_s, predictor_wait_s) and the next-token guess
    record, under one lock: the hash thread and every generating thread update them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.predict_s = 0.0
        self.wait_s = 0.0
        self.counts = dict.fromkeys(_COUNTERS, 0)
        self.guesses = self.right_guesses = 0               # next-token guesses checked, and right (not reset)

    def reset(self) -> None:
        with self.lock:
            self.predict_s = self.wait_s = 0.0
            self.counts = dict.fromkeys(_COUNTERS, 0)


class HashBuilder:
    """SiDA's hash-building thread: predicts a pass's table from its tokens, or from a guessed next token, on one
    worker thread. Calls are serialised, so each caller's causal state advances in order."""

    def __init__(self, predictor: nn.Module, embeddings: nn.Module, top_k: int, tally: _Tally):
        self.predictor, self.embeddings, self.top_k, self.tally = predictor, embeddings, top_k, tally
        device = predictor.device
        # The hash thread works on its own CUDA stream, ordered after the caller's by an event (F4).
        self.cuda_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_moe_offload_hash")

    def submit(self, work: Any, *args: Any) -> Future:
        """Run `work(*args)` (one of the methods below) on the hash thread."""
        return submit_or_run(self._pool, work, *args)     # at interpreter exit: on the caller's thread

    @torch.inference_mode()
    def speculate(self, caller: _CallerState, guess: torch.Tensor, inputs_ready):
        """The table for token `guess` following the caller's state, without committing the state."""
        start = time.perf_counter()
        with _on_stream(self.cuda_stream, inputs_ready):
            embeddings = self.embeddings(guess).to(self.predictor.device)
            current, state = self.predictor.step(embeddings, None, caller.state)
            table = build_table(current, None, self.top_k)
        with self.tally.lock:
            self.tally.predict_s += time.perf_counter() - start
            self.tally.counts["hash_speculated"] += 1
        return guess, table, state

    def confirm(self, caller: _CallerState, speculation: Future, ids: torch.Tensor, mask: torch.Tensor | None,
                inputs_ready) -> Prediction | None:
        """The speculated table if its guess is the token that came, every row unpadded; else None."""
        guess, table, state = speculation.result()
        with _on_stream(self.cuda_stream, inputs_ready):
            right = guess.shape == ids.shape and bool(torch.equal(guess, ids.to(guess.device))) and \
                (mask is None or bool(mask.all()))
        with self.tally.lock:
            self.tally.guesses += 1
            self.tally.right_guesses += right
        if not right:
            return None
        caller.state = state
        with self.tally.lock:
            self.tally.counts["hash_speculation_hits"] += 1
            self.tally.counts["hash_tables"] += 1
        return table

    def confirm_or_predict(self, caller: _CallerState, speculation: Future, ids: torch.Tensor,
                           mask: torch.Tensor | None, inputs_ready) -> Prediction:
        """`confirm`, or when the guess was wrong `predict` on the tokens that came."""
        table = self.confirm(caller, speculation, ids, mask, inputs_ready)
        return table if table is not None else self.predict(caller, ids, mask, False, inputs_ready)

    @torch.inference_mode()
    def predict(self, caller: _CallerState, ids: torch.Tensor, mask: torch.Tensor | None, new_sequence: bool,
                inputs_ready) -> Prediction:
        """The table of this pass's tokens `ids`; a causal predictor advances the caller's state past them."""
        start = time.perf_counter()
        with _on_stream(self.cuda_stream, inputs_ready):
            embeddings = self.embeddings(ids).to(self.predictor.device)       # [B, n, H]
            mask = None if mask is None else mask.to(self.predictor.device)
            if self.predictor.config.causal:   # incremental: only the new tokens run through the LSTM
                current, caller.state = self.predictor.step(embeddings, mask, None if new_sequence else caller.state)
            else:                              # an encoder sees its whole input at once
                current = self.predictor.predict(embeddings, mask)           # [B, n, layers, E]
            table = build_table(current, mask, self.top_k)
        with self.tally.lock:
            self.tally.predict_s += time.perf_counter() - start
            self.tally.counts["hash_tables"] += 1
        return table

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class HashPrefetcher(LayerHook):
    """Attaches a trained predictor to an offloaded model (see the module docstring).

    Example:
        >>> prefetcher = hf_moe_offload.get_engine(model).prefetcher                    # doctest: +SKIP
        >>> prefetcher.configure(min_confidence=0.7)      # fewer, surer prefetches      # doctest: +SKIP
        >>> hf_moe_offload.stats(model)["hash_prefetch_used"]                           # doctest: +SKIP
    """

    def __init__(self, engine, predictor: nn.Module, routing: str = "router", *,
                 min_confidence: float = MIN_CONFIDENCE, min_precision: float = MIN_PRECISION,
                 precision_window: int = PRECISION_WINDOW, min_samples: int = MIN_SAMPLES,
                 share_cap: bool = False):
        self.engine, self.predictor, self.routing = engine, predictor, routing
        self.prefetches = engine.policy.prefetch == "hash"   # a predictor may serve routing="predicted" alone
        model, arch = engine.model, engine.arch
        axis = {name: i for i, name in enumerate(predictor.config.layer_names)}
        self.axis_of = {layer.index: axis[layer.name] for layer in engine.layers if layer.name in axis}
        self.order = sorted(self.axis_of)                    # engine layer indices with a prediction
        self.top_k = engine.layers[0].top_k
        self.configure(min_confidence=min_confidence, min_precision=min_precision,
                       precision_window=precision_window, min_samples=min_samples, share_cap=share_cap)
        embeddings = model.get_input_embeddings()
        self.predictor.to(next(embeddings.parameters()).device).eval()
        self.tally = _Tally()
        self.builder = HashBuilder(self.predictor, embeddings, self.top_k, self.tally)
        self.stream = model.get_encoder() if model.config.is_encoder_decoder else model.get_decoder()
        self._callers = threading.local()
        self._warned_paged = False
        self._hooks = [self.stream.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        # Decode: the next token is known only after this pass's logits, so the next table is predicted from the
        # greedy guess as soon as they exist (the model's forward hook), while generate() picks the token; the next
        # pass uses it if the guess was right, else predicts anew.
        self.speculates = bool(self.predictor.config.causal) and not model.config.is_encoder_decoder
        if self.speculates:
            self._hooks.append(model.register_forward_hook(self._on_logits))
        if routing == "predicted":
            for layer in engine.layers:
                if layer.index in self.axis_of:
                    router = arch.router_module(model, layer)
                    kind = arch.router_kind(model, layer)      # refused here, before any hook is added
                    if kind is not None:
                        kind.check("routing='predicted'", weights=True)
                    self._hooks.append(router.register_forward_hook(self._routing_hook(layer.index)))

    def configure(self, *, min_confidence: float | None = None, min_precision: float | None = None,
                  precision_window: int | None = None, min_samples: int | None = None,
                  share_cap: bool | None = None) -> None:
        """Change the prefetch filters (None keeps a value); `min_confidence=0, min_precision=0` prefetches every
        predicted top-k expert, as before the filters existed. Resets the precision tracking.

        >>> prefetcher.configure(min_confidence=0.7, min_precision=0.6)                 # doctest: +SKIP
        """
        _check_filters(min_confidence, min_precision, precision_window, min_samples)
        current = getattr(self, "precision_window", PRECISION_WINDOW)
        self.min_confidence = float(min_confidence) if min_confidence is not None else \
            getattr(self, "min_confidence", MIN_CONFIDENCE)
        self.min_precision = float(min_precision) if min_precision is not None else \
            getattr(self, "min_precision", MIN_PRECISION)
        self.precision_window = precision_window or current
        self.min_samples = min_samples or getattr(self, "min_samples", MIN_SAMPLES)
        if self.min_samples > self.precision_window:
            raise ValueError(f"min_samples ({self.min_samples}) must not exceed precision_window "
                             f"({self.precision_window})")
        self.share_cap = bool(share_cap) if share_cap is not None else getattr(self, "share_cap", False)
        self._precision = LayerPrecision(self.order, self.min_precision, self.precision_window, self.min_samples)

    def _caller(self) -> _CallerState:
        caller = getattr(self._callers, "state", None)
        if caller is None:
            caller = self._callers.state = _CallerState()
        return caller

    # -- before the pass: hand its tokens to the hash thread --------------------------------------------------------

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        caller = self._caller()
        caller.predicted, caller.issued = {}, {}
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or is_continuous_batching(kwargs):
            # inputs_embeds only: nothing to hash. Continuous batching packs a different set of requests into one
            # row every pass, which a per-row causal state cannot follow: the router decides alone there.
            if ids is not None and self.routing == "predicted" and not self._warned_paged:
                logger.warning("hf_moe_offload: routing='predicted' is not applied under continuous batching "
                               "(generate_batch); the router decides")
                self._warned_paged = True
            caller.pending, caller.table, caller.seen = None, None, None
            return
        _, past = kv_cache(kwargs)
        past_length = 0 if past is None else past.get_seq_length()
        # A cache that does not continue what the state summarized (another sequence's, a copied prefix, a pass the
        # predictor did not see) starts a new summary: predictions never depend on an earlier, unrelated call.
        new_sequence = past_length == 0 or caller.batch != ids.shape[0] or past_length != caller.seen
        caller.batch, caller.seen = ids.shape[0], past_length + ids.shape[1]
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != ids.shape[0]
                                 or mask.shape[1] < ids.shape[1]):
            mask = None    # a 4D mask, or a static cache's masks per layer type: predict without padding info
        new_mask = None if mask is None else mask[:, -ids.shape[1]:]   # the mask of the tokens in this pass
        inputs_ready = _record_event(ids.device)             # the caller's stream has produced ids and mask
        caller.table = None
        speculation, caller.speculation = caller.speculation, None
        if speculation is not None and not new_sequence and ids.shape[1] == 1:
            # Waited for here, before the pass's first MoE layer, so that layer's experts are prefetched too.
            start, ready = time.perf_counter(), speculation.done()
            guessed = speculation.result()[1]
            with self.tally.lock:
                self.tally.wait_s += time.perf_counter() - start
            if ids.device.type == "cpu":                     # the guess checked here: free on the CPU
                caller.pending = None
                caller.table = self.builder.confirm(caller, speculation, ids, new_mask, inputs_ready)
                if caller.table is not None:
                    with self.tally.lock:
                        self.tally.counts["hash_tables_ready"] += ready
                    self._prefetch_first_layers(caller, caller.table)
                    return
                caller.pending = self.builder.submit(self.builder.predict, caller, ids, new_mask, False, inputs_ready)
                return
            # On CUDA the check would be a host sync: prefetch on the guess (a wrong one costs bytes, never
            # tokens) and check it on the hash thread.
            self._prefetch_first_layers(caller, guessed)
            caller.pending = self.builder.submit(self.builder.confirm_or_predict, caller, speculation, ids,
                                                 new_mask, inputs_ready)
            return
        caller.pending = self.builder.submit(self.builder.predict, caller, ids, new_mask, new_sequence,
                                             inputs_ready)

    def _on_logits(self, module: nn.Module, args: tuple, output) -> None:
        """After a decode pass of a causal LM: predict the next pass's table from its greedy token (a guess)."""
        caller = self._caller()
        logits = getattr(output, "logits", None)
        if caller.pending is None and caller.table is None or logits is None or logits.dim() != 3:
            return                                           # no prediction this pass (e.g. continuous batching)
        if not self.prefetches or logits.shape[0] != caller.batch:
            return
        with self.tally.lock:                                # sampling, not greedy: guesses rarely right, stop
            if self.tally.guesses >= 16 and self.tally.right_guesses < self.tally.guesses // 4:
                return
        if not self.speculates:
            return
        guess = logits[:, -1:].argmax(dim=-1)                # [B, 1], on the logits' device
        caller.speculation = self.builder.submit(self.builder.speculate, caller, guess,
                                                 _record_event(guess.device))

    # -- the inference thread ---------------------------------------------------------------------------------

    def _current(self) -> Prediction | None:
        caller = self._caller()
        if caller.table is None and caller.pending is not None:
            start = time.perf_counter()
            ready = caller.pending.done()                    # built before the first MoE layer asked for it
            caller.table = caller.pending.result()
            caller.pending = None
            if caller.table.ready is not None:               # the caller's stream reads the logits after they exist
                torch.cuda.current_stream(caller.table.logits.device).wait_event(caller.table.ready)
            with self.tally.lock:
                self.tally.wait_s += time.perf_counter() - start
                self.tally.counts["hash_tables_ready"] += ready
        return caller.table

    def on_route(self, layer: int, experts: Sequence[int]) -> None:
        """The router chose: score this pass's predictions for `layer` (precision, used / unused prefetches)."""
        caller = self._caller()
        predicted = caller.predicted.pop(layer, None)
        issued = caller.issued.pop(layer, set())
        if predicted is None:
            return
        routed = set(experts)
        with self.tally.lock:
            self.tally.counts["hash_prefetch_used"] += len(issued & routed)
            self.tally.counts["hash_prefetch_unused"] += len(issued - routed)
            self._precision.record(layer, predicted, routed)

    def on_pinned(self, layer: int) -> None:
        """This layer's experts are pinned: prefetch the next predicted layers' confident experts."""
        if not self.prefetches or layer not in self.axis_of:
            return
        table = self._current()
        if table is None:
            return
        position = self.order.index(layer)
        self._plan(self._caller(), table, self.order[position + 1:position + 1 + LOOKAHEAD_LAYERS])

    def _prefetch_first_layers(self, caller: _CallerState, table: Prediction) -> None:
        """A table before the pass reaches any MoE layer (from the guessed token): prefetch the first layers too."""
        if self.prefetches and not self.engine.cache.zero_copy:
            with self.engine.cache.lock:
                self._plan(caller, table, self.order[:LOOKAHEAD_LAYERS])

    def _plan(self, caller: _CallerState, table: Prediction, layers: list[int]) -> None:
        cache = self.engine.cache
        share = max(self.top_k, cache.num_slots // (LOOKAHEAD_LAYERS + 1)) if self.share_cap else None
        for ahead in layers:
            if ahead in caller.predicted:                    # planned from an earlier layer of this pass already
                self._issue(caller, ahead, caller.predicted[ahead])
                continue
            ranked = table.ranked[self.axis_of[ahead]]
            confident = [e for e, chance in ranked if chance >= self.min_confidence]
            low = len(ranked) - len(confident)
            if share is not None:
                confident = confident[:share]
            caller.predicted[ahead] = confident
            with self.tally.lock:
                self.tally.counts["hash_skipped_low_confidence"] += low
                if ahead in self._precision.off:
                    self.tally.counts["hash_skipped_layer_off"] += len(confident)
            self._issue(caller, ahead, confident)

    def _issue(self, caller: _CallerState, layer: int, experts: list[int]) -> None:
        """Prefetch `experts` of `layer`, most likely first, until the cache has no slot for a guess."""
        if layer in self._precision.off:
            return
        cache, issued = self.engine.cache, caller.issued.setdefault(layer, set())
        for i, e in enumerate(experts):
            if e in issued or (layer, e) in cache.resident:
                continue
            if not cache.prefetch(layer, [e]):
                with self.tally.lock:
                    self.tally.counts["hash_skipped_no_room"] += sum(1 for x in experts[i:] if x not in issued)
                return
            issued.add(e)
            with self.tally.lock:
                self.tally.counts["hash_prefetch_issued"] += 1

    def precision(self) -> dict[int, float | None]:
        """Per predicted MoE layer: the share of its recent confident predictions the router chose (None before any).

        >>> hf_moe_offload.get_engine(model).prefetcher.precision()       # doctest: +SKIP
        {1: 0.83, 2: 0.71, 3: 0.44}
        """
        with self.tally.lock:
            return self._precision.precision()

    def layers_off(self) -> list[int]:
        """MoE layers whose prefetches are shut off for low precision now."""
        with self.tally.lock:
            return sorted(self._precision.off)

    def _routing_hook(self, layer_index: int):
        def replace_routing(module: nn.Module, args: tuple, output):
            table = self._current()
            kind = kind_of(module)                           # its logits may be probabilities (Gemma-4)
            ours = kind.logits(output) if kind is not None else self.engine.arch.router_logits(output)
            if table is None or table.logits.shape[0] != ours.shape[0]:
                return output                                # no prediction for these tokens: the router decides
            logits = table.logits[:, self.axis_of[layer_index]].to(ours.device)
            return self.engine.arch.routing_from_logits(module, logits, output)

        return replace_routing

    def stats(self) -> dict[str, float]:
        """This hook's part of `hf_moe_offload.stats(model)` (the keys in the module docstring)."""
        tally = self.tally
        with tally.lock:
            return {"predictor_s": tally.predict_s, "predictor_wait_s": tally.wait_s, **tally.counts,
                    "hash_layers_off": len(self._precision.off)}

    def reset_stats(self) -> None:
        self.tally.reset()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.builder.close()


def _check_filters(min_confidence: float | None, min_precision: float | None, precision_window: int | None,
                   min_samples: int | None) -> None:
    """Refuse filter values `configure` cannot take (None: unchanged, always fine)."""
    for name, value in (("min_confidence", min_confidence), ("min_precision", min_precision)):
        if value is not None and not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
    for name, value in (("precision_window", precision_window), ("min_samples", min_samples)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _chance_routed(logits: torch.Tensor, top_k: int, valid: torch.Tensor | None) -> torch.Tensor:
    """Estimated chance that some token routes to each expert: logits [N, layers, E] -> [layers, E], from each
    token's predicted router probability p as min(1, k * p) (a top-k router takes p's largest k), combined over
    the valid tokens as 1 - prod(1 - chance).

    >>> _chance_routed(torch.tensor([[[2.0, 0.0, -9.0]]]), 1, None).round(decimals=2)
    tensor([[0.8800, 0.1200, 0.0000]])
    """
    chance = (torch.softmax(logits.float(), dim=-1) * top_k).clamp(max=1.0)
    if valid is not None:
        chance = chance * valid[:, None, None].to(chance.dtype)
    miss_all = torch.log1p(-chance.clamp(max=1.0 - 1e-6)).sum(dim=0)
    return 1.0 - torch.exp(miss_all)


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
