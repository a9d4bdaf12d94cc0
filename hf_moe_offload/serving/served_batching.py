"""The served model's continuous batching: one failed expert read fails one pass's requests, not the server, and a
client that goes away leaves nothing behind.

transformers' continuous-batching loop treats any exception of a forward pass as fatal: every request fails, the
worker stops, and the server answers 503 until it is restarted. For an offloaded model, a pass can fail because an
expert read did (a disk error, a checkpoint file changed since it was indexed); the next pass may well succeed.
`ServedBatching` makes the manager the served model creates fail only the requests of that pass (transformers'
own `handle_batch_error`: their outputs carry the error, their KV blocks are freed) and go on. A request that
outgrows the whole KV cache (its prompt and tokens so far need more blocks than the cache has, so nothing can be
scheduled) fails alone with an error naming the sizes, and the others go on. Any other exception stays fatal, as in
transformers.

A streaming client that disconnects cancels its request; transformers frees its KV blocks but keeps the callback
registered for its outputs, which nothing removes. `ServedBatching` drops it once the loop has taken the
cancellation in.

`ServedBatching.snapshot()` is the state `/v1/offload/stats` reports: requests running and waiting, the KV blocks
requests hold, the free share of the KV cache (complete blocks of finished requests stay cached for prefix sharing
until they are needed), the sizes the loop runs with.

Example:
    >>> served = ServedBatching.attach(model)         # doctest: +SKIP
    >>> manager = model.init_continuous_batching()    # doctest: +SKIP
    >>> served.snapshot()["running"]                  # doctest: +SKIP
    0
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable

from torch import nn

from ..storage.checkpoint import CheckpointError
from ..storage.integrity import IntegrityError

logger = logging.getLogger(__name__)

# What a failed expert read raises: the OS's error, a shard shorter than indexed, a file changed since it was indexed.
READ_ERRORS = (OSError, CheckpointError, IntegrityError)
# What transformers' scheduler raises when no request fits the KV cache and none can be moved out of it
NO_ROOM = "No requests can be scheduled and no requests can be offloaded."
# The ContinuousBatchingConfig fields the snapshot reports (set by the --cb-* flags or sized for offloading).
REPORTED_CONFIG = ("num_blocks", "max_batch_tokens", "page_size", "scheduler_type", "safety_margin")


class ServedBatching:
    """Watches the continuous-batching manager of one served model (see the module docstring).

    `attach(model)` wraps `model.init_continuous_batching` (what transformers' server calls on the first request
    with continuous batching); the manager it returns is adopted: its loop survives failed reads, its cancelled
    requests' callbacks are dropped.
    """

    def __init__(self) -> None:
        self.manager: Any = None
        self.failed_passes = 0
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._step_error: BaseException | None = None   # the read failure of the pass now failing, if any

    @classmethod
    def attach(cls, model: nn.Module) -> "ServedBatching":
        """A `ServedBatching` adopting every manager `model.init_continuous_batching` returns from now on."""
        served = cls()
        create = model.init_continuous_batching

        @functools.wraps(create)
        def init_continuous_batching(*args: Any, **kwargs: Any):
            manager = create(*args, **kwargs)
            served.adopt(manager)
            return manager

        model.init_continuous_batching = init_continuous_batching
        return served

    def adopt(self, manager: Any) -> None:
        """Patch `manager` (a transformers `ContinuousBatchingManager`, before its loop starts) on the instance."""
        if getattr(manager, "_served_by", None) is self:
            return      # a manager kept for a next session comes back: patched already
        self.manager = manager
        manager._served_by = self
        manager._generation_step = self._step(manager._generation_step)
        manager._generation_loop_body = self._loop_body(manager._generation_loop_body)
        manager.cancel_request = self._cancel(manager.cancel_request)

    def _step(self, step: Callable[[], None]) -> Callable[[], None]:
        """transformers' forward pass, noting a read failure as the pass's own (not scheduling's or the update's)."""

        def generation_step() -> None:
            try:
                step()
            except READ_ERRORS as error:
                self._step_error = error
                raise

        return generation_step

    def _loop_body(self, body: Callable[[Any, bool], bool]) -> Callable[[Any, bool], bool]:
        """transformers' loop body, with a pass that failed on a read failing its requests only."""

        def loop_body(batch_processor: Any, bootstrapping: bool) -> bool:
            with self._lock:
                taken_in = set(self._cancelled)   # queued before this iteration drains the cancellations
            try:
                return body(batch_processor, bootstrapping)
            except READ_ERRORS as error:
                failed_pass, self._step_error = self._step_error is error, None
                if not failed_pass or batch_processor.use_async_batching:
                    # Outside the forward pass, or with transformers' double-buffered loop, whose failed pass is not
                    # the one `handle_batch_error` would fail: fatal, as in transformers.
                    raise
                self.failed_passes += 1
                logger.error("hf_moe_offload serve: a forward pass failed reading an expert (%s); its requests get "
                             "the error, the others go on", error, exc_info=logger.isEnabledFor(logging.DEBUG))
                batch_processor.handle_batch_error(error)
                return True
            except RuntimeError as error:
                if str(error) != NO_ROOM or not _fail_longest_request(batch_processor):
                    raise
                return True
            finally:
                self._forget(taken_in)

        return loop_body

    def _cancel(self, cancel_request: Callable[[str], None]) -> Callable[[str], None]:
        """transformers' `cancel_request`, noting the request so that its callback is dropped later."""

        def cancel(request_id: str) -> None:
            cancel_request(request_id)
            with self._lock:
                self._cancelled.add(request_id)

        return cancel

    def _forget(self, request_ids: set[str]) -> None:
        """Drop the result callbacks of cancelled requests the loop has removed (none of their outputs comes now)."""
        if not request_ids or self.manager is None:
            return
        router = self.manager.output_router
        with router._lock:
            for request_id in request_ids:
                router.result_handlers.pop(request_id, None)
        with self._lock:
            self._cancelled -= request_ids

    def snapshot(self) -> dict[str, Any] | None:
        """The loop's state now, as JSON-ready data; None before the first request with continuous batching."""
        manager = self.manager
        processor = getattr(manager, "batch_processor", None)
        if processor is None:
            return None
        scheduler, config = processor.scheduler, manager.continuous_batching_config
        fatal = manager.background_thread_status.fatal_error
        return {"running": len(scheduler.active_requests), "waiting": len(scheduler.waiting_requests),
                "kv_blocks_held": _blocks_held(processor.cache),
                "kv_cache_free": round(float(processor.cache.compute_free_capacity()), 4),
                "result_handlers": len(manager.output_router.result_handlers),
                "failed_passes": self.failed_passes, "alive": manager.is_running() and fatal is None,
                "config": _live_config(config, scheduler)}


def _live_config(config: Any, scheduler: Any) -> dict[str, Any]:
    """The config fields the loop runs with: a field the config left unset (None) as the scheduler resolved it."""
    fields = {name: getattr(config, name) for name in REPORTED_CONFIG}
    if fields["safety_margin"] is None:
        fields["safety_margin"] = getattr(scheduler, "safety_margin", None)
    return fields


def _blocks_held(cache: Any) -> int | None:
    """KV blocks in the block tables of live requests (every attention type's), None where transformers' cache
    keeps no `block_table` per allocator."""
    tables = [getattr(allocator, "block_table", None) for allocator in cache.cache_allocators.values()]
    if any(not isinstance(table, dict) for table in tables):
        return None
    return sum(len(blocks) for table in tables for blocks in list(table.values()))


def _fail_longest_request(processor: Any) -> bool:
    """Fail the longest request, running or waiting, when no request fits the KV cache: the one that outgrew it
    (alone, it still would not fit). False when there is none to fail."""
    scheduler = processor.scheduler
    states = list(scheduler.active_requests.values()) + list(scheduler.waiting_requests.values())
    if not states:
        return False
    state = max(states, key=lambda s: len(s.initial_tokens) + len(s.generated_tokens))
    cache = processor.cache
    capacity = cache.max_tokens_read           # the most tokens one request can hold
    error = RuntimeError(
        f"request {state.request_id} needs more KV cache than the server has ({len(state.initial_tokens)} prompt "
        f"tokens, {len(state.generated_tokens)} generated, of {capacity} tokens in {cache.num_blocks} blocks); "
        f"serve with a larger --max-seq-len or --max-batch-size, or --cb-num-blocks, or ask for fewer max_tokens")
    logger.error("hf_moe_offload serve: %s", error)
    if state.request_id in scheduler.waiting_requests:
        scheduler.waiting_requests.pop(state.request_id)
        if state.request_id in scheduler.waiting_requests_order:
            scheduler.waiting_requests_order.remove(state.request_id)
        processor.offloading_manager.free_request_cpu_cache(state)
    processor._handle_request_error(error, state)
    scheduler.finish_request(state.request_id)
    return True
