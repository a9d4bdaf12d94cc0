"""How long compute waits for expert loads (`stall_s` in the stats).

On the CPU a wait blocks the host, so it is timed on the host. On CUDA a wait blocks the compute stream, not the
host: one wait in `SAMPLE_EVERY` is bracketed by a pair of timing events on that stream and counts for that many
(timing events are the costly kind), added to the stats once both have run (`settle`; the pass scheduler settles
the finished ones at every pass, so that `prefetch="auto"` decides on measured stalls).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..stats import OffloadStats

MAX_PENDING = 4096      # event pairs kept before the finished ones are settled, so they do not pile up
SAMPLE_EVERY = 4        # CUDA: one wait timed in this many, weighted by it
_UNSAMPLED: Any = object()   # `start` of a CUDA wait that is not timed


class StallClock:
    """Times the waits of one cache's device.

    Example:
        >>> clock = StallClock(torch.device("cpu"), stats)            # doctest: +SKIP
        >>> started = clock.start(); load.wait(); clock.stop(0, started)  # doctest: +SKIP
    """

    def __init__(self, device: torch.device, stats: OffloadStats):
        self.device, self.stats = device, stats
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._waits = 0

    def start(self) -> tuple[float, torch.cuda.Event | None]:
        return time.perf_counter(), self._event()

    def stop(self, layer: int, started: tuple[float, torch.cuda.Event | None]) -> None:
        """The wait for an expert of `layer`, begun at `started`, is over."""
        start, before = started
        if before is _UNSAMPLED:
            return
        if before is None:
            self.stats.record_stall(layer, time.perf_counter() - start)
            return
        self._pending.append((layer, before, self._event(sampled=True)))
        if len(self._pending) > MAX_PENDING:
            self.settle(block=False)

    def settle(self, block: bool = True) -> None:
        """Add the measured device waits to the stats: all of them when `block`, else those finished."""
        pending = []
        for layer, before, after in self._pending:
            if block:
                after.synchronize()
            if block or after.query():
                self.stats.record_stall(layer, SAMPLE_EVERY * before.elapsed_time(after) / 1e3)
            else:
                pending.append((layer, before, after))
        self._pending = pending

    def clear(self) -> None:
        """Drop the waits so far (the resident layers' loads at construction are not a forward's stalls)."""
        self._pending.clear()

    def _event(self, sampled: bool = False) -> torch.cuda.Event | None:
        """A timing event on the compute stream (CUDA, for one wait in `SAMPLE_EVERY`), else None."""
        if self.device.type != "cuda":
            return None
        if not sampled:
            self._waits += 1
            if (self._waits - 1) % SAMPLE_EVERY:
                return _UNSAMPLED
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event
