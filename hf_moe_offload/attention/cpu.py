"""CPU attention next to a host KV cache (MoE-Lightning, FlexGen's CPU attention), through transformers' own
extension points: an attention function registered with `AttentionInterface`, its mask function (transformers'
`sdpa_mask`) registered with `AttentionMaskInterface`, and a `DynamicCache` whose layers keep keys and values in
host memory (pinned when the model runs on CUDA). No model class is patched.

Per attention layer and forward pass: the new key/value rows go to the host cache (`HostKVCache` layers), the query
goes to the host, transformers' sdpa runs there on the CPU (GQA as sdpa does it), and only the output
[batch, tokens, heads, head_dim] returns to the model's device. The KV cache then costs host memory, not device
memory, so a batch can grow far beyond what device memory holds. On a CPU-only machine every move is a no-op and the
same code runs, so it is tested everywhere.

Example:
    >>> from hf_moe_offload.attention.cpu import use_cpu_attention, restore_attention         # doctest: +SKIP
    >>> use_cpu_attention(model)          # model.generate now keeps its KV cache on the host  # doctest: +SKIP
    >>> out = model.generate(**inputs, max_new_tokens=32)                                    # doctest: +SKIP
    >>> restore_attention(model)          # the attention implementation it had before      # doctest: +SKIP

With offloading, `offload_policy={"attention": "cpu", ...}` does the same at load / `enable`, and `disable()`
undoes it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .._compat import cache_keyword, is_continuous_batching, kv_cache
from ..policy.offload_policy import PolicyError
from ..storage.store import HostMemory

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "hf_moe_offload_cpu"
HOST = torch.device("cpu")
_STATE_ATTR = "_hf_moe_offload_cpu_attention"
_MIN_CAPACITY = 64           # tokens a host layer's buffer holds at first; it doubles when full (pinned: x1.5)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory; from CUDA through a pinned buffer (a DMA copy, not a pageable staging copy)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
    out.copy_(t)                 # blocking: the CPU reads it right after
    return out


class HostLayer(DynamicLayer):
    """A full-attention `DynamicLayer` whose keys/values live in host memory (pinned when they come from CUDA).

    Rows are written into a buffer with spare capacity that doubles when full, so a decode step copies only its
    new rows instead of concatenating the whole cache. `keys` / `values` are views of the filled part; when
    transformers replaces them (beam reorder, `crop`, `batch_select_indices`), the buffer is rebuilt from them.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, HOST
        self.keys = torch.tensor([], dtype=self.dtype, device=HOST)
        self.values = torch.tensor([], dtype=self.dtype, device=HOST)
        self._buffers_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._view = None
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, s = self.get_seq_length(), key_states.shape[-2]
        kbuf, vbuf = self._room(n, s, key_states, value_states)
        kbuf[:, :, n:n + s].copy_(key_states)
        vbuf[:, :, n:n + s].copy_(value_states)
        self.keys, self.values = kbuf[:, :, :n + s], vbuf[:, :, :n + s]
        self._view = self.keys
        return self.keys, self.values

    def stage_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, rows: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `update` would return for the batch rows `rows` (a micro-batch), as views of the buffer: the new
        rows are written past the cached length, which stays as it is until the whole batch's `update` (which
        writes them again). The cached rows are not copied, as a concatenation would copy them.

        Example:
            >>> layer = HostLayer()
            >>> _ = layer.update(torch.zeros(4, 1, 3, 2), torch.zeros(4, 1, 3, 2))
            >>> k, v = layer.stage_rows(torch.ones(2, 1, 1, 2), torch.ones(2, 1, 1, 2), (2, 4))
            >>> k.shape, layer.get_seq_length()
            (torch.Size([2, 1, 4, 2]), 3)
        """
        start, end = rows
        if not self.is_initialized or end > self.keys.shape[0] or self.keys.shape[1:2] != key_states.shape[1:2]:
            raise ValueError(f"rows {rows} of new keys {tuple(key_states.shape)} do not fit this layer's cached "
                             f"keys {tuple(self.keys.shape) if self.is_initialized else None}")
        n, s = self.get_seq_length(), key_states.shape[-2]
        kbuf, vbuf = self._room(n, s, self.keys, self.values)
        self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]       # the same rows, now in the buffer's views
        self._view = self.keys
        kbuf[start:end, :, n:n + s].copy_(key_states)
        vbuf[start:end, :, n:n + s].copy_(value_states)
        return kbuf[start:end, :, :n + s], vbuf[start:end, :, :n + s]

    def _room(self, n: int, s: int, like_keys: torch.Tensor, like_values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers, grown if they cannot take `s` rows after the `n` cached ones for a batch shaped like
        `like_keys` / `like_values` (or if transformers replaced `keys`: beam reorder, `crop`)."""
        bufs = getattr(self, "_buffers_kv", None)
        if (bufs is None or getattr(self, "_view", None) is not self.keys or bufs[0].shape[-2] < n + s
                or bufs[0].shape[:2] != like_keys.shape[:2] or bufs[1].shape[:2] != like_values.shape[:2]):
            bufs = self._grow(n, n + s, like_keys, like_values)
        return bufs

    def _grow(self, n: int, need: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """New buffers of at least `need` rows holding the `n` rows cached now (wherever `keys` is).

        Pinned buffers (from CUDA) are registered exactly (`HostMemory`: torch's pinned allocator would round each
        up to a power of two and keep every outgrown one cached) and grow by half, not double; the outgrown pair
        is unpinned and freed once replaced."""
        pin = key_states.device.type == "cuda" or (self.keys is not None and self.keys.is_pinned())
        capacity = max(need, _MIN_CAPACITY, n + n // 2 if pin else 2 * n)
        memory = None
        if pin:
            memory = HostMemory(key_states.device if key_states.is_cuda else
                                torch.device("cuda", torch.cuda.current_device()))
        bufs = []
        for new, old in ((key_states, self.keys), (value_states, self.values)):
            b, h, _, d = new.shape
            buf = memory.empty((b, h, capacity, d), new.dtype) if memory is not None else \
                torch.empty((b, h, capacity, d), dtype=new.dtype)
            if n:
                buf[:, :, :n].copy_(old)
            bufs.append(buf)
        self._buffers_kv = (bufs[0], bufs[1])
        self._host_memory = memory       # the outgrown buffers' registration ends with the memory it replaces
        self.dtype = key_states.dtype
        self.device = HOST
        return self._buffers_kv

    def offload(self):      # already on the host
        pass

    def prefetch(self):     # attention reads it where it is
        pass


class HostSlidingWindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window `DynamicSlidingWindowLayer` whose keys/values live in host memory."""

    _layer_type = None      # never registered in transformers' layer-type mappings

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_initialized and self.keys is not None and self.keys.device.type != "cpu":
            self.keys, self.values = _to_host(self.keys), _to_host(self.values)   # adopted from a device cache
        return super().update(_to_host(key_states), _to_host(value_states), *args, **kwargs)

    def offload(self):
        pass

    def prefetch(self):
        pass


_HOST_LAYERS = {DynamicLayer: HostLayer, DynamicSlidingWindowLayer: HostSlidingWindowLayer}


def move_cache_to_host(cache: Cache) -> Cache:
    """Turn a `DynamicCache`'s layers (filled or not) into host layers, in place, and return it.

    Its object stays the one `generate` holds, so every later step uses host layers. Layer kinds other than full or
    sliding attention (linear attention, indexed, quantized, static) are refused.

    Example:
        >>> from transformers import DynamicCache
        >>> move_cache_to_host(DynamicCache()).layer_class_to_replicate.__name__
        'HostLayer'
    """
    if isinstance(cache, HostKVCache) and getattr(cache, "_all_host", False):
        return cache
    for layer in cache.layers:
        if type(layer) in _HOST_LAYERS.values():
            continue
        host_cls = _HOST_LAYERS.get(type(layer))
        if host_cls is None:
            raise PolicyError(f"CPU attention (attention='cpu') keeps a DynamicCache's full or sliding-window layers "
                              f"on the host; this cache has a {type(layer).__name__} layer. Allowed: DynamicCache "
                              f"(the default of generate) or HostKVCache, with layer types {list(SUPPORTED_LAYER_TYPES)}")
        # Same state, host behaviour: HostLayer rebuilds its buffer from whatever `keys` holds on its next update.
        layer.__class__ = host_cls
    replicate = cache.layer_class_to_replicate
    if replicate is not None and replicate not in _HOST_LAYERS.values():
        if replicate not in _HOST_LAYERS:
            raise PolicyError(f"CPU attention cannot keep {replicate.__name__} layers on the host; allowed: "
                              f"DynamicCache or HostKVCache")
        cache.layer_class_to_replicate = _HOST_LAYERS[replicate]
    if getattr(cache, "offloading", False):
        cache.offloading = False      # its prefetch/offload would move host layers back to a device
    return cache


class HostKVCache(DynamicCache):
    """A `DynamicCache` whose keys and values stay in host memory (pinned when the model runs on CUDA), for the
    CPU attention function (`attn_implementation="hf_moe_offload_cpu"`).

    `use_cpu_attention(model)` makes `generate` (and a plain forward with `use_cache`) use one by itself; pass one
    explicitly as `past_key_values=` to reuse a cache across calls.

    Example:
        >>> from transformers import MixtralConfig
        >>> cache = HostKVCache(config=MixtralConfig(num_hidden_layers=2))
        >>> [type(layer).__name__ for layer in cache.layers]
        ['HostLayer', 'HostLayer']
    """

    def __init__(self, config=None, **kwargs: Any):
        super().__init__(config=config, **kwargs)
        move_cache_to_host(self)
        self._all_host = True


def cpu_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered attention function: transformers' sdpa on the CPU, output back on the query's device.

    Keys/values from a `HostKVCache` are already on the host (nothing moves); from any other cache they are copied.

    Example:
        >>> import torch
        >>> q = k = v = torch.zeros(1, 2, 3, 4)
        >>> cpu_attention_forward(torch.nn.Module(), q, k, v, None)[0].shape
        torch.Size([1, 3, 2, 4])
    """
    if is_continuous_batching(kwargs):
        raise PolicyError(CB_REFUSAL)       # continuous batching's packed pass (generate_batch is refused earlier)
    device = query.device
    if kwargs.get("position_bias") is not None:
        kwargs["position_bias"] = kwargs["position_bias"].to(HOST)
    out, weights = sdpa_attention_forward(module, query.to(HOST), key.to(HOST), value.to(HOST),
                                          _host_mask(attention_mask), **kwargs)
    return out.to(device), weights


_mask_memo = threading.local()      # per thread: several threads may generate on one model


def _host_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask on the host; every layer of a pass gets the same mask object, so it is copied once per pass."""
    if mask is None or mask.device.type == "cpu":
        return mask
    ref, host = getattr(_mask_memo, "last", (None, None))
    if ref is not None and ref() is mask:
        return host
    host = mask.to(HOST)
    _mask_memo.last = (weakref.ref(mask), host)
    return host


CB_REFUSAL = ("CPU attention (attention='cpu', attn_implementation='hf_moe_offload_cpu') cannot run transformers' "
              "continuous batching (generate_batch): it accepts only 'sdpa', 'paged|eager' or a flash attention "
              "implementation, and its paged KV cache is allocated on the model's device. Use generate() with CPU "
              "attention, or restore the attention first (hf_moe_offload.attention.cpu.restore_attention(model), or a "
              "policy with attention='device')")


def register() -> None:
    """Register the attention function and its mask function (transformers' sdpa mask) under
    `ATTN_IMPLEMENTATION`; idempotent, done on import."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, cpu_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()


def check_cpu_attention(model: nn.Module) -> None:
    """Refuse, before changing anything, a model the CPU attention path does not cover (a meta skeleton will do).

    Example:
        >>> check_cpu_attention(model)      # raises PolicyError for an encoder-decoder model  # doctest: +SKIP
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise PolicyError(f"CPU attention needs a transformers PreTrainedModel, not {type(model).__name__}")
    if getattr(config, "is_encoder_decoder", False):
        raise PolicyError(f"CPU attention supports decoder-only models; {config.model_type!r} is an encoder-decoder "
                          f"model (its cross-attention cache is not a host cache). Allowed: attention='device'")
    if not getattr(model, "_supports_sdpa", True):
        raise PolicyError(f"CPU attention runs transformers' sdpa, which {type(model).__name__} does not support (its "
                          f"attention applies what sdpa cannot, such as learned attention sinks); allowed: "
                          f"attention='device'")
    if not model._can_set_attn_implementation():
        raise PolicyError(f"{type(model).__name__} does not dispatch its attention through transformers' "
                          f"AttentionInterface, so CPU attention cannot be selected; allowed: attention='device'")
    layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None) or ()
    other = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if other:
        raise PolicyError(f"CPU attention keeps full and sliding-window attention layers on the host; this model has "
                          f"layer types {other}. Allowed layer types: {list(SUPPORTED_LAYER_TYPES)}; use "
                          f"attention='device'")


def _cache_to_host_hook(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: the pass's cache becomes a host cache (generate's DynamicCache, in place), or a new
    HostKVCache where the model would create a DynamicCache itself."""
    _, cache = kv_cache(kwargs)
    if cache is None:
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(module.config, "use_cache", False)
        if use_cache and len(args) <= 1 and not module.training:
            kwargs[cache_keyword(module.forward)] = HostKVCache(config=module.config.get_text_config(decoder=True))
    elif isinstance(cache, DynamicCache):
        move_cache_to_host(cache)
    elif isinstance(cache, Cache) and not getattr(cache, "_hf_moe_offload_warned", False):
        cache._hf_moe_offload_warned = True
        logger.warning("hf_moe_offload: CPU attention got a %s, which keeps its keys/values on the device: every "
                       "layer copies them to the host at every step. Use the default dynamic cache (no "
                       "cache_implementation) or cache=HostKVCache(config=model.config) (past_key_values= before "
                       "transformers 5.24)",
                       type(cache).__name__)
    return args, kwargs


def _refuse_generate_batch(*args, **kwargs):
    raise PolicyError(CB_REFUSAL)


def use_cpu_attention(model: nn.Module) -> nn.Module:
    """Run `model`'s attention on the CPU against a host KV cache, with or without expert offloading.

    Sets the attention implementation to `ATTN_IMPLEMENTATION` (transformers' `set_attn_implementation`) and adds
    a forward pre-hook that gives each pass a host cache (`generate`'s DynamicCache is converted in place; a
    `past_key_values=HostKVCache(...)` you pass is used as is). `generate_batch` is refused with the reason.
    `restore_attention(model)` undoes all of it.

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained(path)                   # doctest: +SKIP
        >>> use_cpu_attention(model).generate(**inputs, max_new_tokens=16)      # doctest: +SKIP
        >>> restore_attention(model)                                            # doctest: +SKIP
    """
    if getattr(model, _STATE_ATTR, None) is not None:
        return model
    check_cpu_attention(model)
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    handle = model.register_forward_pre_hook(_cache_to_host_hook, with_kwargs=True)
    # An instance attribute shadows the method for this model only (as the engine's `_apply` guard does).
    own_generate_batch = vars(model).get("generate_batch")
    model.generate_batch = _refuse_generate_batch
    setattr(model, _STATE_ATTR, (before, handle, own_generate_batch))
    logger.info("hf_moe_offload: attention on the CPU against a host KV cache (attn_implementation %r, was %r)",
                ATTN_IMPLEMENTATION, before)
    return model


def restore_attention(model: nn.Module) -> nn.Module:
    """Undo `use_cpu_attention`: the attention implementation the model had before, no cache hook; a no-op for a
    model without CPU attention.

    Example:
        >>> restore_attention(model).config._attn_implementation   # doctest: +SKIP
        'sdpa'
    """
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return model
    before, handle, own_generate_batch = state
    handle.remove()
    if own_generate_batch is not None:
        model.generate_batch = own_generate_batch
    elif "generate_batch" in vars(model):
        del model.generate_batch
    model.set_attn_implementation(before)
    delattr(model, _STATE_ATTR)
    _empty_host_cache()
    return model


def _empty_host_cache() -> None:
    """Give torch's cached pinned blocks (the per-step query and new K/V copies) back to the OS."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    empty = getattr(torch._C, "_host_emptyCache", None) or getattr(torch._C, "_accelerator_emptyHostCache", None)
    if empty is not None:
        empty()


def cpu_attention_enabled(model: nn.Module) -> bool:
    """Whether `use_cpu_attention` is in effect on `model`."""
    return getattr(model, _STATE_ATTR, None) is not None
