"""What one forward pass of an offloaded model costs, measured on this machine, for sizing its tokens per pass.

Two numbers (`PassCosts`):
- **R, seconds per pass, whatever its token count:** a pass that touches every expert moves the experts that are not
  resident (all expert bytes less the cache) over the slowest link they cross (the disk store's reads, host to
  device, or host memory when the experts are used in place). The rate is this model's own reads so far when it has
  read enough, else a few experts read (or copied) now through the same store.
- **α, seconds per (query, key) entry of the attention mask, over all attention layers:** transformers' paged
  attention with sdpa or eager (continuous batching) masks each pass's queries densely against the keys of every
  sequence in the pass, so a pass of T tokens spends about α·T·(KV + T) in attention. Timed with
  `scaled_dot_product_attention` at the model's head shape, dtype and device.

A pass then costs each of its T tokens about R/T + α·(KV + T), which is lowest at T = √(R/α)
(`PassCosts.amortizing_tokens`); docs/continuous_batching.md gives the values measured on the benchmark's model.

Example:
    >>> costs = PassCosts(fixed_s=0.6, attention_s_per_entry=6e-7, moved_bytes=10**9, bytes_per_s=1.7e9,
    ...                   rate_source="test")
    >>> costs.amortizing_tokens
    1000
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MIN_MEASURED_EXPERTS = 4       # the model's own reads count as a rate once they cover this many experts
SAMPLE_BYTES = 64 << 20        # a rate measured now reads (or copies) about this many bytes ...
SAMPLE_MAX_EXPERTS = 8         # ... in at most this many experts
ATTENTION_QUERIES, ATTENTION_KEYS = 128, 1024   # the timed attention: big enough that per-call costs vanish


@dataclass(frozen=True)
class PassCosts:
    """The two measured costs of an offloaded forward pass (module docstring) and where the rate came from."""

    fixed_s: float                   # R: seconds to move `moved_bytes` at `bytes_per_s`
    attention_s_per_entry: float     # α: seconds per (query, key) mask entry, summed over the attention layers
    moved_bytes: int                 # bytes a pass that touches every expert moves
    bytes_per_s: float               # the rate they move at
    rate_source: str                 # how that rate was measured

    @property
    def amortizing_tokens(self) -> int:
        """Tokens per pass that minimise R/T + α·T: √(R/α), at least 1."""
        if self.attention_s_per_entry <= 0:
            raise ValueError(f"attention_s_per_entry={self.attention_s_per_entry!r}: must be > 0")
        return max(1, round(math.sqrt(self.fixed_s / self.attention_s_per_entry)))


def measure_pass_costs(model: torch.nn.Module, engine: Any) -> PassCosts:
    """R and α for `model`, offloaded by `engine` (an `OffloadEngine`), on its compute device.

    Example:
        >>> costs = measure_pass_costs(model, hf_moe_offload.get_engine(model))     # doctest: +SKIP
        >>> costs.amortizing_tokens                                                 # doctest: +SKIP
        1093
    """
    device = _compute_device(engine)
    moved, rate, source = moved_bytes_and_rate(engine, device)
    alpha = attention_seconds_per_entry(model.config, model.dtype, device)
    costs = PassCosts(fixed_s=moved / rate, attention_s_per_entry=alpha, moved_bytes=moved, bytes_per_s=rate,
                      rate_source=source)
    logger.info("hf_moe_offload pass costs: R = %.3f s (%d bytes at %.2f GB/s, %s), alpha = %.3g s per mask entry "
                "over the attention layers -> %d tokens per pass amortize best", costs.fixed_s, moved, rate / 1e9,
                source, alpha, costs.amortizing_tokens)
    return costs


def moved_bytes_and_rate(engine: Any, device: torch.device) -> tuple[int, float, str]:
    """(bytes a pass touching every expert moves, the rate they move at, how it was measured)."""
    store, cache = engine.store, engine.cache
    if getattr(cache, "zero_copy", False):
        # Experts used in place in host memory: nothing crosses a link, but every pass reads all expert weights.
        return store.total_bytes, _host_copy_rate(store), "host memory copy of expert bytes, timed now"
    moved = max(store.total_bytes - cache.num_slots * cache.slot_bytes, 0)
    copy = cache.copy
    if not store.in_host_memory:
        clock = getattr(copy, "read_clock", None)
        busy, read = clock.snapshot() if clock is not None else (0.0, 0)
        if read >= MIN_MEASURED_EXPERTS * max(store.slab_bytes(i) for i in range(len(store.layouts))) and busy > 0:
            return moved, read / busy, f"this model's {read / 1e9:.2f} GB of store reads so far"
        rate, sampled = _store_read_rate(store)
        return moved, rate, f"{sampled} experts read from the store now"
    if device.type == "cuda":
        return moved, _host_to_device_rate(store, device), "host-to-device copy of one expert, timed now"
    return moved, _host_copy_rate(store), "host memory copy of expert bytes, timed now"


def attention_seconds_per_entry(config: Any, dtype: torch.dtype, device: torch.device) -> float:
    """Seconds sdpa spends per (query, key) entry of a dense mask in one attention layer at the model's head shape,
    times its attention layers (best of three after a warm-up)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or 1
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    q = torch.randn(1, heads, ATTENTION_QUERIES, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(1, heads, ATTENTION_KEYS, head_dim, dtype=dtype, device=device) for _ in range(2))
    mask = torch.zeros(1, 1, ATTENTION_QUERIES, ATTENTION_KEYS, dtype=dtype, device=device)

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    seconds = _best_of(run, device, repeats=3)
    return seconds / (ATTENTION_QUERIES * ATTENTION_KEYS) * attention_layers(text)


def attention_layers(config: Any) -> int:
    """Decoder layers with softmax attention: all of them, less linear-attention / state-space layers where the config
    lists `layer_types` (Qwen3-Next, Jamba-like hybrids).

    Example:
        >>> from types import SimpleNamespace
        >>> attention_layers(SimpleNamespace(num_hidden_layers=4, layer_types=["linear_attention", "full_attention",
        ...                                                                    "linear_attention", "full_attention"]))
        2
    """
    types = getattr(config, "layer_types", None)
    if types:
        return max(1, sum(1 for t in types if "attention" in str(t) and "linear" not in str(t)))
    return getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers", 1)


def _compute_device(engine: Any) -> torch.device:
    cache = engine.cache
    if hasattr(cache, "device"):
        return cache.device
    return next(iter(cache.caches.values())).device          # several devices: the first one's


def _sample_experts(store: Any) -> list[tuple[int, int]]:
    """Experts spread over the layers whose bytes add up to about `SAMPLE_BYTES` (at least one)."""
    keys, total, layers = [], 0, len(store.layouts)
    for i in range(sum(store.num_experts)):
        layer = i % layers
        expert = (i // layers) % store.num_experts[layer]
        keys.append((layer, expert))
        total += store.slab_bytes(layer)
        if total >= SAMPLE_BYTES or len(keys) >= SAMPLE_MAX_EXPERTS:
            break
    return keys


def _store_read_rate(store: Any) -> tuple[float, int]:
    """Bytes per second of the store's own reads (its chunked, threaded pread) of a few experts, into host memory.
    One expert at a time: the store's own chunked reads already keep the disk busy (2 or 4 experts at once read no
    faster)."""
    keys = _sample_experts(store)
    buffer = torch.empty(max(store.layouts[layer].numel for layer, _ in keys), dtype=store.dtype)
    start = time.perf_counter()
    for layer, expert in keys:
        store.read_into(layer, expert, buffer[:store.layouts[layer].numel])
    seconds = time.perf_counter() - start
    return sum(store.slab_bytes(layer) for layer, _ in keys) / max(seconds, 1e-9), len(keys)


def _host_copy_rate(store: Any) -> float:
    """Bytes per second of a host memory copy of expert slabs (how fast a pass can stream them from RAM)."""
    slab = store.host_slab(0, 0) if store.plain_in_memory else None
    if slab is None:
        slab = torch.empty(max(1, min(store.layouts[0].numel, SAMPLE_BYTES // store.dtype.itemsize)),
                           dtype=store.dtype)
    slab = slab[:max(1, SAMPLE_BYTES // slab.element_size())]
    out = torch.empty_like(slab)
    return slab.nbytes / _best_of(lambda: out.copy_(slab), torch.device("cpu"), repeats=3)


def _host_to_device_rate(store: Any, device: torch.device) -> float:
    """Bytes per second of a pinned host-to-device copy of (up to `SAMPLE_BYTES` of) one expert slab."""
    slab = store.host_slab(0, 0)
    slab = slab[:max(1, SAMPLE_BYTES // slab.element_size())]
    out = torch.empty(slab.shape, dtype=slab.dtype, device=device)
    return slab.nbytes / _best_of(lambda: out.copy_(slab, non_blocking=True), device, repeats=3)


def _best_of(run, device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed runs after one untimed warm-up (synchronized on CUDA)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    run()
    sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)
