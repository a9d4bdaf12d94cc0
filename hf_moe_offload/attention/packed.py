"""Attention over continuous batching's packed requests, each request against its own keys only.

transformers' continuous batching packs every request of a forward pass into one sequence of T query tokens and
reads their cached keys into one sequence of K keys, in request order (`cu_seq_lens_q` / `cu_seq_lens_k` give the
boundaries). With sdpa or eager it then builds a dense [T, K] mask, block-diagonal with one causal block per
request, and runs attention over all of it: a pass costs T x K, although only each request's own block,
sum(T_i x K_i), is ever used. At 128 running requests that is 128x the work of a decode pass, and it grows with
the token budget. Flash attention's varlen kernels skip the mask, but on the CPU (and on GPUs without flash-attn)
sdpa is what runs.

`packed_attention_forward` is sdpa run request by request: decodes (one query token each) in one batched call
(keys gathered and padded to the longest, with a padding mask), each prefill chunk on its own, with transformers'
causal alignment (a chunk's queries are the last of its keys) and its sliding windows. Same math as the dense
mask, with no mask built. Registered in transformers' `AttentionInterface` as `ATTN_IMPLEMENTATION`. The
batch processor then allocates no mask at all, since its mask is only for "sdpa" and "paged|eager", and masking_utils
builds none for an implementation without a mask function.

An offloaded model uses it for `generate_batch` / `init_continuous_batching` whenever transformers would run sdpa
(`use_packed_attention`, called by `batching.install_batching_defaults`'s wrapper). transformers' manager puts the
model's own implementation back when it stops.

The switch is the model's, not the run's: transformers' manager reads and sets `config._attn_implementation`, which
every attention layer reads, and refuses to start while another run has switched it. So runs that switch wait for
each other (`one_packed_run_at_a_time`, with a log line), while any other call beside a run is served as sdpa would
serve it: outside continuous batching's packed passes the registered function is sdpa, and its registered mask
function is sdpa's (none in the generation thread of a run, whose packed passes need none).

Example:
    >>> from hf_moe_offload.attention.packed import use_packed_attention         # doctest: +SKIP
    >>> manager = model.init_continuous_batching(generation_config=gc)          # doctest: +SKIP
    >>> use_packed_attention(model, manager)          # before the manager's first pass  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "hf_moe_offload_packed"
REPLACES = "sdpa"            # the implementation it stands in for (eager models keep eager: softcaps, sinks)
_PACKED_MARK = "_hf_moe_offload_packed"   # set on a manager whose batch processor runs packed attention
_GQA_IN_SDPA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)   # sdpa's enable_gqa


class _PassLayout(threading.local):
    """The host-side request boundaries of the pass now running, read once per pass and layer type (not once per
    layer: on CUDA each read is a device sync), with the gather index and padding mask of its decodes."""

    queries: torch.Tensor | None = None     # held, so no later tensor can reuse its memory while it is compared
    version: int = -1
    cq: list[int] = []
    keys: list = []                          # (cu_k tensor, its version, its host list, decode gathers) per type
    in_run: bool = False                     # this thread is a packed run's generation loop


_layout = _PassLayout()


def _boundaries(cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple[list[int], list[int], dict]:
    """`cu_q` / `cu_k` as host lists, and the decode-gather memo of this pass and key boundaries. Every layer of a
    pass gets the same tensors (one `cu_k` per layer type); the batch processor rewrites them in place between
    passes, which bumps their version counters, or hands new ones: the same objects at the same versions name one
    pass's values."""
    if _layout.queries is not cu_q or _layout.version != cu_q._version:
        _layout.queries, _layout.version, _layout.cq, _layout.keys = cu_q, cu_q._version, cu_q.tolist(), []
    for tensor, version, ck, gathers in _layout.keys:
        if tensor is cu_k and version == cu_k._version:
            return _layout.cq, ck, gathers
    entry = (cu_k, cu_k._version, cu_k.tolist(), {})
    _layout.keys.append(entry)
    return _layout.cq, entry[2], entry[3]


def _decode_gather(decodes: list[int], cq: list[int], ck: list[int], device: torch.device,
                   memo: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the requests `decodes` (one query token each): their query rows [n], the index [n, L] of their keys in
    the packed keys, padded to the longest L by repeating its last key, and the mask [n, 1, 1, L] of the real ones."""
    cached = memo.get((device, tuple(decodes)))
    if cached is None:
        starts = torch.tensor([ck[i] for i in decodes])
        lengths = torch.tensor([ck[i + 1] - ck[i] for i in decodes])
        steps = torch.arange(int(lengths.max()))
        real = steps[None, :] < lengths[:, None]
        index = starts[:, None] + torch.minimum(steps[None, :], lengths[:, None] - 1)
        rows = torch.tensor([cq[i] for i in decodes])
        cached = (rows.to(device), index.to(device), real[:, None, None, :].to(device))
        memo[(device, tuple(decodes))] = cached
    return cached


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scaling: float | None, groups: int) -> torch.Tensor:
    if groups > 1 and not _GQA_IN_SDPA:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    extra = {"enable_gqa": True} if groups > 1 and _GQA_IN_SDPA else {}
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scaling, **extra)


def _chunk_mask(q_len: int, k_len: int, window: int | None, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """transformers' continuous-batching mask for one request (`build_attention_mask`): query row i sees keys up to
    i + (k_len - q_len) (the queries are the last q_len keys), and with a sliding window only the last `window`."""
    offset = k_len - q_len if q_len < k_len else 0
    if not window or window <= 1:
        if q_len == 1:
            return None, False
        if offset == 0 and q_len == k_len:
            return None, True
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(k_len, device=device)[None, :]
    mask = cols <= rows + offset
    if window and window > 1:
        mask &= cols > rows + k_len - q_len - window
    return mask, False


def _layer_window(module: nn.Module) -> int | None:
    """The sliding window of `module`'s layer as continuous batching's paged cache groups layers
    (`group_layers_by_attn_type`): by `config.layer_types`, or every layer sliding when the config has a window
    and no layer types."""
    config = module.config
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return window
    return window if layer_types[module.layer_idx] == "sliding_attention" else None


def packed_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             cache: PagedAttentionCache | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The registered attention function: query [1, heads, T, d], key/value [1, kv_heads, T, d] of a packed
    continuous-batching pass; returns [1, T, heads, d] as transformers' attention functions do. Any other call (a
    `generate` beside a running `generate_batch`, while the model is switched) is sdpa's, with sdpa's mask."""
    if kwargs.get("cu_seq_lens_q") is None and not isinstance(cache, PagedAttentionCache):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("cu_seq_lens_q") is None or kwargs.get("block_table") is not None:
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} runs continuous batching's packed passes "
                           "only (generate_batch / init_continuous_batching), without a block table")
    for unsupported in ("s_aux", "softcap", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"packed attention does not support {unsupported}; this model's continuous batching "
                             f"needs its own attention implementation (eager)")
    if dropout and module.training:
        raise ValueError("packed attention is for inference: call model.eval() before generate_batch")
    if isinstance(cache, PagedAttentionCache):
        # transformers <= 5.23 hands the paged cache to the attention function; later versions update it in the
        # attention module before the call, and the keys arrive packed with this layer's boundaries already chosen
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    if not isinstance(kwargs.get("cu_seq_lens_k"), torch.Tensor):
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} got a continuous-batching pass whose keys "
                           "were not read from the paged cache (cu_seq_lens_k is not one layer's boundaries)")
    cq, ck, gathers = _boundaries(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"])
    window = _layer_window(module)
    groups = getattr(module, "num_key_value_groups", 1)
    out = query.new_empty(query.shape)
    if cq[-1] < query.shape[2]:
        out[:, :, cq[-1]:] = 0             # padded query tokens (static shapes) belong to no request
    decodes = []
    for i in range(len(cq) - 1):
        q_len, k_len = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if q_len == 0:
            continue                       # a padding request (static shapes): nothing to attend
        if q_len == 1 and not (window and k_len > window):
            decodes.append(i)
            continue
        mask, causal = _chunk_mask(q_len, k_len, window, query.device)
        out[:, :, cq[i]:cq[i + 1]] = _sdpa(query[:, :, cq[i]:cq[i + 1]], key[:, :, ck[i]:ck[i + 1]],
                                           value[:, :, ck[i]:ck[i + 1]], mask, causal, scaling, groups)
    if decodes:
        rows, index, real = _decode_gather(decodes, cq, ck, query.device, gathers)
        q = query[0, :, rows].transpose(0, 1).unsqueeze(2)                        # [n, heads, 1, d]
        k = key[0][:, index].transpose(0, 1)                                      # [n, kv_heads, L, d]
        v = value[0][:, index].transpose(0, 1)
        out[0, :, rows] = _sdpa(q, k, v, real, False, scaling, groups).squeeze(2).transpose(0, 1)
    return out.transpose(1, 2).contiguous(), None


def packed_mask(*args, **kwargs) -> torch.Tensor | None:
    """The registered mask function: none in a packed run's generation thread (its passes attend request by
    request), sdpa's everywhere else (a call beside a run gets the mask sdpa would)."""
    return None if _layout.in_run else sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register `packed_attention_forward` with transformers' `AttentionInterface` and `packed_mask` with its
    `AttentionMaskInterface` (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, packed_mask)


register()


def use_packed_attention(model: nn.Module, manager) -> bool:
    """Switch `model` to packed attention for the continuous-batching `manager` just created by transformers, if it
    would run sdpa; the manager puts the model's implementation back when it stops (its `_original_attn_impl`, the
    field transformers' own switch to a batching-friendly implementation uses). Returns whether it switched.
    Must run before the manager's first pass: its batch processor decides then whether to build the dense mask."""
    current = model.config._attn_implementation
    if current == ATTN_IMPLEMENTATION:
        return True
    if current != REPLACES:
        return False                       # flash (no mask anyway) or eager (kept: softcaps, sinks)
    if getattr(manager, "batch_processor", None) is not None and not getattr(manager, _PACKED_MARK, False):
        return False                       # a kept manager whose batch processor was built with the dense mask
    original = getattr(manager, "_original_attn_impl", None) or current
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    manager._original_attn_impl = original
    setattr(manager, _PACKED_MARK, True)   # a manager kept for the next session keeps its mask-free processor
    _mark_generation_thread(manager)
    logger.info("hf_moe_offload continuous batching: attention request by request (%s) instead of %s over a dense "
                "mask of every request's keys", ATTN_IMPLEMENTATION, current)
    return True


def runs_packed(model: nn.Module) -> bool:
    """Whether `model`'s continuous batching runs packed attention (it runs sdpa outside it, or packed already)."""
    return model.config._attn_implementation in (REPLACES, ATTN_IMPLEMENTATION)


def _mark_generation_thread(manager) -> None:
    """Mark the thread `manager` generates in (transformers starts it on `manager._run_generation_loop`, looked up
    on the instance) as a packed run's, so `packed_mask` builds no mask there."""
    if "_run_generation_loop" in vars(manager):
        return
    loop = manager._run_generation_loop

    def run_generation_loop(*args, **kwargs):
        _layout.in_run = True
        try:
            return loop(*args, **kwargs)
        finally:
            _layout.in_run = False

    manager._run_generation_loop = run_generation_loop


def one_packed_run_at_a_time(model: nn.Module, init_continuous_batching: Callable) -> Callable:
    """`init_continuous_batching` for `model` such that runs that switch it to packed attention (it runs sdpa) go
    one at a time: a second waits, with a log line, until the first's manager has stopped (and put the model's
    implementation back). A run must wait: transformers' manager refuses to start on a model switched by another
    run, and the first run's stop would switch the model back under the second."""
    lock = threading.Lock()

    @functools.wraps(init_continuous_batching)
    def wrapper(*args, **kwargs):
        switches = runs_packed(model)
        if switches and not lock.acquire(blocking=False):
            logger.warning("hf_moe_offload continuous batching: another generate_batch is running on this model; "
                           "this one waits for it to finish (a run switches the whole model to %s attention, and "
                           "transformers' manager starts no other run meanwhile). Plain generate calls are not held "
                           "up", ATTN_IMPLEMENTATION)
            lock.acquire()
        try:
            manager = init_continuous_batching(*args, **kwargs)
        except BaseException:
            if switches:
                lock.release()
            raise
        if switches:
            _release_on_stop(model, manager, lock.release)
        return manager

    return wrapper


def _release_on_stop(model: nn.Module, manager, release: Callable[[], None]) -> None:
    """Call `release` once `manager.stop` has returned, after putting the model's implementation back if
    transformers did not (it returns early for a manager that never started)."""
    manager._hf_moe_offload_release = release
    if "stop" in vars(manager):
        return                              # a kept manager, already wrapped: the new release is picked up
    stop = manager.stop

    def stop_then_release(*args, **kwargs):
        try:
            return stop(*args, **kwargs)
        finally:
            original = getattr(manager, "_original_attn_impl", None)
            if original is not None and model.config._attn_implementation == ATTN_IMPLEMENTATION:
                model.set_attn_implementation(original)
                manager._original_attn_impl = None
            pending = vars(manager).pop("_hf_moe_offload_release", None)
            if pending is not None:
                pending()

    manager.stop = stop_then_release
