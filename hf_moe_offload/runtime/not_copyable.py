"""What an offloaded model holds (its engine, the experts' runtimes, the micro-batch wrappers) refuses
`copy.deepcopy` and `pickle` with a clear error: a copy would share one store, cache and reader threads with the
original, or fail deep inside on a lock. The first of them that a copy of the model reaches raises.

Example:
    >>> copy.deepcopy(offloaded_model)                                           # doctest: +SKIP
    PolicyError: an offloaded model cannot be copied or pickled ...
"""

from __future__ import annotations

from typing import Any, NoReturn

from ..policy.offload_policy import PolicyError

MESSAGE = ("an offloaded model cannot be copied or pickled: its experts live in a store and cache that one model "
           "owns. Call hf_moe_offload.disable(model) first (the experts come back as parameters), copy it, then "
           "offload each model with hf_moe_offload.enable(model, policy)")


class NotCopyable:
    """Mixin: `copy.deepcopy`, `copy.copy` and `pickle` raise a `PolicyError` naming what to do instead."""

    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise PolicyError(MESSAGE)

    def __copy__(self) -> NoReturn:
        raise PolicyError(MESSAGE)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise PolicyError(MESSAGE)
