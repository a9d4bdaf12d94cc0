"""Where transformers' KV cache argument is, across its versions.

transformers 5.24 renamed the cache argument of every model, decoder layer and attention module from
`past_key_values` to `cache` (the old name is still accepted, renamed with a deprecation warning, and outputs keep a
`.past_key_values` alias). Up to 5.23 a keyword named `cache` reached the layers only under continuous batching (its
`PagedAttentionCache`). Hooks that read or replace a pass's cache find it under either name with these helpers,
and tell a continuous-batching pass by its packed-request boundaries or its paged cache.

Example:
    >>> kv_cache({"cache": None, "past_key_values": "c"})
    ('past_key_values', 'c')
    >>> kv_cache({})
    (None, None)
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from transformers.generation.continuous_batching import PagedAttentionCache

CACHE_NAMES = ("cache", "past_key_values")       # 5.24+, then <= 5.23


def kv_cache(kwargs: dict) -> tuple[str | None, Any]:
    """(keyword, cache) of the KV cache a call got, or (None, None) when it got none."""
    for name in CACHE_NAMES:
        if kwargs.get(name) is not None:
            return name, kwargs[name]
    return None, None


def cache_keyword(forward: Callable) -> str:
    """The keyword under which `forward` (a model's or layer's forward, decorated or not) takes its KV cache."""
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def is_continuous_batching(kwargs: dict) -> bool:
    """Whether a forward or attention call belongs to transformers' continuous batching: packed requests
    (`cu_seq_lens_q`) or its paged KV cache (under `cache` in every version)."""
    return kwargs.get("cu_seq_lens_q") is not None or isinstance(kwargs.get("cache"), PagedAttentionCache)
