"""Micro-batches inside the forward (FlexGen's zig-zag block schedule, Klotski's multi-batch pipeline, MoE-Lightning's
CGOPipe): each decoder layer that holds an offloaded MoE block runs its batch as `micro_batches` slices, one after
the other, and the layer's experts stay in the cache until the last slice has used them, so every expert a pass
needs is read once and serves every micro-batch.

Why: on a GPU with CPU attention (`attention="cpu"`), the device's expert kernels of one micro-batch are queued
asynchronously, each slice on a CUDA stream of its own (`slice_streams`), and the CPU attention of the next
micro-batch runs meanwhile, so host attention and device expert compute overlap (CGOPipe); attention's activations
(scores, the mask) are also bounded by a micro-batch instead of the whole batch. `generate` is unchanged: the
model's own decoder layers run on slices of their inputs.

How, without patching a model class:
- `MicroBatchedLayers.attach` wraps each such decoder layer's `forward` on the instance (as accelerate's hooks
  do); `detach` puts the original back.
- The wrapper slices the layer's batch-shaped inputs (hidden states, attention mask, position ids, position
  embeddings; an input it does not know runs the whole batch, with one warning) and hands each slice a
  `MicroBatchCacheView` of the pass's `DynamicCache`: a slice's `update` returns that slice's keys and values, and
  the last slice writes the whole batch's new rows into the real cache once.
- `current()` tells the engine which slice of how many is running, so the cache holds every expert of the layer
  pinned until the last slice (`ExpertCache.fetch(hold=True)`, then `release_held`) and the stream planner counts
  one pass, not one per slice.

Several threads generating on one model take turns per layer call, split or not (a cache sized for one layer's hold
has no room for a second call beside it); the held pins are each thread's own.

The whole batch runs in one call (no slicing) when: a single sequence; gradients are on (training); the pass asks
for attentions or router logits (recorded per module call); its cache is not a `DynamicCache` of full or
sliding-window layers (paged, static, quantized, linear-attention caches).

Example:
    >>> model = AutoModelForCausalLM.from_pretrained(path, offload_policy={"store": "disk",
    ...                                              "micro_batches": 2})                   # doctest: +SKIP
    >>> model.generate(**batch, max_new_tokens=32)          # each MoE decoder layer runs two slices  # doctest: +SKIP
    >>> bounds(5, 2)
    [(0, 3), (3, 5)]
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from .._compat import CACHE_NAMES, kv_cache
from ..attention.cpu import HostLayer, HostSlidingWindowLayer
from . import slice_streams
from .not_copyable import NotCopyable

logger = logging.getLogger(__name__)

# Cache layers whose `update` is the only write a decoder layer makes (subclasses add their own: indexer keys,
# convolution and recurrent states, which a slice would write for its rows only).
SPLITTABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, HostLayer, HostSlidingWindowLayer)
BATCH_KWARGS = ("attention_mask", "position_ids", "position_embeddings")   # sliced along the batch
SHARED_KWARGS = (*CACHE_NAMES, "use_cache", "cache_position")              # the same for every slice
RECORDED_OUTPUTS = ("output_attentions", "output_router_logits")            # recorded per module call
_local = threading.local()


@dataclass(frozen=True)
class MicroBatch:
    """The slice running now: `index` of `count`, and the tokens of the whole batch in this pass."""

    index: int
    count: int
    total_tokens: int

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def current() -> MicroBatch | None:
    """The micro-batch this thread is running inside a micro-batched decoder layer, else None."""
    return getattr(_local, "micro_batch", None)


def bounds(rows: int, count: int) -> list[tuple[int, int]]:
    """`rows` split into `count` near-equal consecutive slices (the first ones one row larger); at most `rows`.

    Example:
        >>> bounds(7, 3), bounds(2, 4)
        ([(0, 3), (3, 5), (5, 7)], [(0, 1), (1, 2)])
    """
    count = max(1, min(count, rows))
    size, extra = divmod(rows, count)
    out, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


class MicroBatchCacheView:
    """What one micro-batch's attention sees as `past_key_values`: the pass's cache, with `update` restricted to
    the slice's rows. Earlier slices get their old rows plus their new ones (what the real update would return
    for them); the last slice writes the new rows of every slice into the real cache at once and gets its rows
    of the result. Everything else is the real cache's.

    Example:
        >>> cache = DynamicCache()
        >>> pending = {}
        >>> views = [MicroBatchCacheView(cache, rows, i, 2, pending) for i, rows in enumerate([(0, 1), (1, 2)])]
        >>> k = torch.arange(8.).view(2, 1, 2, 2)
        >>> views[0].update(k[:1], k[:1], 0)[0].shape, views[1].update(k[1:], k[1:], 0)[0].shape
        (torch.Size([1, 1, 2, 2]), torch.Size([1, 1, 2, 2]))
        >>> cache.layers[0].keys.shape
        torch.Size([2, 1, 2, 2])
    """

    def __init__(self, cache: DynamicCache, rows: tuple[int, int], index: int, count: int,
                 pending: dict[int, list[tuple[torch.Tensor, torch.Tensor, Any]]]):
        self._cache, self._rows, self._index, self._count = cache, rows, index, count
        self._pending = pending     # layer -> the new (keys, values, ready marker) of the slices so far, shared

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = self._pending.setdefault(layer_idx, [])
        pieces.append((key_states, value_states, slice_streams.ready_marker(key_states)))
        start, end = self._rows
        if self._index < self._count - 1:
            layer = self._cache.layers[layer_idx] if layer_idx < len(self._cache.layers) else None
            if isinstance(layer, HostLayer) and layer.is_initialized and layer.get_seq_length():
                # Host keys: written into the buffer's spare rows, the cached ones read in place (not copied).
                return layer.stage_rows(key_states, value_states, self._rows)
            return self._visible(layer_idx, key_states, value_states)
        del self._pending[layer_idx]
        if len(pieces) != self._count:
            raise RuntimeError(f"micro-batched layer {layer_idx}: {len(pieces)} cache updates for {self._count} "
                               f"micro-batches")
        # The earlier slices' rows may come from other streams (`slice_streams`): wait for them, keep them.
        keys = torch.cat([slice_streams.consume(k, made) for k, _, made in pieces])
        values = torch.cat([slice_streams.consume(v, made) for _, v, made in pieces])
        keys, values = self._cache.update(keys, values, layer_idx, *args, **kwargs)
        return keys[start:end], values[start:end]

    def _visible(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys/values the real `update` would return for this slice's rows (the cache is not written)."""
        start, end = self._rows
        layer = self._cache.layers[layer_idx] if layer_idx < len(self._cache.layers) else None
        out = []
        for new, old in ((key_states, getattr(layer, "keys", None)), (value_states, getattr(layer, "values", None))):
            if layer is not None and layer.is_initialized and old is not None and old.numel():
                # The last slice's update replaces the cache's tensors on its own stream: keep this read's.
                new = torch.cat([slice_streams.consume(old)[start:end], new.to(old.device)], dim=-2)
            out.append(new)
        if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized and layer.record_past:
            visible = layer.sliding_window - 1 + key_states.shape[-2]
            out = [t[:, :, -visible:] for t in out]
        return out[0], out[1]


def cache_refusal(cache: Any) -> str | None:
    """Why a pass's cache cannot be split by micro-batch (None: it can)."""
    if cache is None:
        return None
    if not isinstance(cache, DynamicCache) or getattr(cache, "offloading", False):
        return f"its cache is a {type(cache).__name__} (micro-batches split a DynamicCache)"
    kinds = [type(layer) for layer in cache.layers]
    if cache.layer_class_to_replicate is not None:
        kinds.append(cache.layer_class_to_replicate)
    other = sorted({k.__name__ for k in kinds if k not in SPLITTABLE_LAYERS})
    return f"its cache has {other} layers" if other else None


class MicroBatchedLayers(NotCopyable):
    """Runs every given decoder layer as `count` micro-batches (see the module docstring); `detach()` undoes it.

    Example:
        >>> handle = MicroBatchedLayers.attach(model, decoder_layers, count=2)    # doctest: +SKIP
        >>> handle.detach()                                                        # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], count: int,
                 on_split: Callable[[bool], None] | None = None, on_end: Callable[[], None] | None = None):
        self.model, self.layers, self.count = model, list(layers), count
        self.on_split = on_split          # called once per wrapped layer call: True when it was split
        self.on_end = on_end              # called after a split call's last slice, or its failure
        self._originals: list[tuple[nn.Module, Any]] = []
        self._pre_hooks: list = []
        self._warned: set[str] = set()
        # One thread at a time runs a split layer: each holds a layer's experts in the cache until its last slice,
        # and a cache sized for one layer's hold has no room for two.
        self._turn = threading.Lock()

    @classmethod
    def attach(cls, model: nn.Module, layers: Sequence[nn.Module], count: int,
               on_split: Callable[[bool], None] | None = None, on_end: Callable[[], None] | None = None
               ) -> "MicroBatchedLayers":
        self = cls(model, layers, count, on_split, on_end)
        # On the model and its base model: either may be called with output_router_logits / output_attentions.
        for module in dict.fromkeys([model, getattr(model, "base_model", model)]):
            self._pre_hooks.append(module.register_forward_pre_hook(self._note_outputs, with_kwargs=True))
        for layer in self.layers:
            own = vars(layer).get("forward")       # an instance forward (accelerate's hook) or None (the class's)
            self._originals.append((layer, own))
            layer.forward = functools.update_wrapper(functools.partial(self._forward, layer.forward), layer.forward)
        return self

    def detach(self) -> None:
        for layer, own in reversed(self._originals):
            if own is None:
                del layer.forward
            else:
                layer.forward = own
        self._originals.clear()
        for hook in self._pre_hooks:
            hook.remove()
        self._pre_hooks.clear()

    def _note_outputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Model forward pre-hook: whether this pass records per-module outputs (which slicing would multiply)."""
        config = getattr(module, "config", None)
        recording = any(kwargs.get(name, getattr(config, name, False)) for name in RECORDED_OUTPUTS)
        if module is self.model or recording:     # the outer call decides; an inner one may only add a request
            _local.recording = recording

    def _forward(self, forward: Callable, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.get("hidden_states")
        why = self._whole_batch_reason(hidden, args, kwargs)
        if why is not None:
            if self.on_split is not None:
                self.on_split(False)
            if why not in self._warned and why != "one sequence":
                self._warned.add(why)
                logger.warning("hf_moe_offload: a pass runs its whole batch at once instead of %d micro-batches: "
                               "%s", self.count, why)
            with self._turn:      # another thread's split call may hold this layer's experts between its slices
                return forward(*args, **kwargs)
        if self.on_split is not None:
            self.on_split(True)
        with self._turn:
            return self._run_slices(forward, args, kwargs, hidden)

    def _run_slices(self, forward: Callable, args: tuple, kwargs: dict, hidden: torch.Tensor) -> Any:
        """The layer once per slice of the batch, each with its rows of the batch-shaped inputs and its view of
        the cache; the outputs joined. The engine's `on_end` runs after the last slice, or a failure."""
        batch = hidden.shape[0]
        slices = bounds(batch, self.count)
        total_tokens = batch * hidden.shape[1] if hidden.dim() > 2 else batch
        cache_name, cache = kv_cache(kwargs)
        pending: dict = {}
        outputs = []
        streams = slice_streams.for_layer_call(self.model, hidden, len(slices))
        try:
            for i, rows in enumerate(slices):
                _local.micro_batch = MicroBatch(i, len(slices), total_tokens)
                sliced_args = tuple(_rows_of(a, rows, batch) if j == 0 else a for j, a in enumerate(args))
                sliced = {k: (_rows_of(v, rows, batch) if k in BATCH_KWARGS or k == "hidden_states" else v)
                          for k, v in kwargs.items()}
                if cache is not None:
                    sliced[cache_name] = MicroBatchCacheView(cache, rows, i, len(slices), pending)
                with streams.running(i) if streams is not None else contextlib.nullcontext():
                    outputs.append(forward(*sliced_args, **sliced))
        finally:
            if streams is not None:   # before the held experts are released: their markers then cover every slice
                streams.join()
            _local.micro_batch = None
            if self.on_end is not None:
                self.on_end()
        return _concat(outputs)

    def _whole_batch_reason(self, hidden: Any, args: tuple, kwargs: dict) -> str | None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or hidden.shape[0] < 2:
            return "one sequence"
        if torch.is_grad_enabled():
            return "gradients are on (training runs whole batches)"
        if getattr(_local, "recording", False):
            return "the pass records attentions or router logits per module call"
        batch = hidden.shape[0]
        for name, value in kwargs.items():
            if name in BATCH_KWARGS or name in SHARED_KWARGS or name == "hidden_states":
                if name == "attention_mask" and value is not None and not isinstance(value, torch.Tensor):
                    return f"its attention mask is a {type(value).__name__}"
                continue
            if _has_batch_rows(value, batch):
                return f"the decoder layer gets an input {name!r} this schedule does not know how to split"
        for value in args[1:]:
            if _has_batch_rows(value, batch):
                return "the decoder layer gets a positional input this schedule does not know how to split"
        return cache_refusal(kv_cache(kwargs)[1])


def _has_batch_rows(value: Any, batch: int) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() > 0 and value.shape[0] == batch
    if isinstance(value, (tuple, list)):
        return any(_has_batch_rows(v, batch) for v in value)
    return False


def _rows_of(value: Any, rows: tuple[int, int], batch: int) -> Any:
    """`value`'s rows `rows` when its first dimension is the batch (a tensor broadcast over it stays whole)."""
    if isinstance(value, torch.Tensor):
        return value[rows[0]:rows[1]] if value.dim() > 0 and value.shape[0] == batch else value
    if isinstance(value, tuple):
        return tuple(_rows_of(v, rows, batch) for v in value)
    if isinstance(value, list):
        return [_rows_of(v, rows, batch) for v in value]
    return value


def _concat(outputs: list[Any]) -> Any:
    """The slices' outputs joined along the batch: tensors concatenated, tuples element by element."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    if isinstance(first, (tuple, list)):
        joined = [None if first[i] is None else _concat([o[i] for o in outputs]) for i in range(len(first))]
        return type(first)(joined)
    raise TypeError(f"a micro-batched decoder layer returned {type(first).__name__}; expected a tensor or a tuple")


def decoder_layers(model: nn.Module, expert_module_names: Sequence[str]) -> list[nn.Module]:
    """The decoder layer holding each offloaded experts module: its outermost ancestor that is an element of an
    `nn.ModuleList` (e.g. "model.layers.3" for "model.layers.3.mlp.experts"), in forward order, without repeats.

    Example:
        >>> decoder_layers(model, ["model.layers.0.mlp.experts"])[0] is model.model.layers[0]   # doctest: +SKIP
        True
    """
    found: dict[int, nn.Module] = {}
    for name in expert_module_names:
        parts = name.split(".")
        for depth in range(1, len(parts)):
            parent = model.get_submodule(".".join(parts[:depth - 1])) if depth > 1 else model
            if isinstance(parent, nn.ModuleList):
                layer = model.get_submodule(".".join(parts[:depth]))
                found.setdefault(id(layer), layer)
                break
        else:
            raise ValueError(f"experts module {name!r} is not inside a decoder layer (an element of a ModuleList)")
    return list(found.values())
