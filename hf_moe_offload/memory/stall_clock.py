"""How long compute waits for expert loads (`stall_s` in the stats).

On the CPU a wait blocks the host, so it is timed on the host. On CUDA a wait blocks the compute stream, not the
host: each wait is bracketed by a pair of events on that stream, added to the stats once both have run (`settle`).
"""

from __future__ import annotations

import time

import torch

from ..stats import OffloadStats

MAX_PENDING = 4096      # event pairs kept before the finished ones are settled, so they do not pile up


class StallClock:
    """Times the waits of one cache's device.

    Example:
        >>> clock = StallClock(torch.device("cpu"), stats)            # doctest: +SKIP
        >>> started = clock.start(); load.wait(); clock.stop(0, started)  # doctest: +SKIP
    """

    def __init__(self, device: torch.device, stats: OffloadStats):
        self.device, self.stats = device, stats
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> tuple[float, torch.cuda.Event | None]:
        return time.perf_counter(), self._event()

    def stop(self, layer: int, started: tuple[float, torch.cuda.Event | None]) -> None:
        """The wait for an expert of `layer`, begun at `started`, is over."""
        start, before = started
        if before is None:
            self.stats.record_stall(layer, time.perf_counter() - start)
            return
        self._pending.append((layer, before, self._event()))
        if len(self._pending) > MAX_PENDING:
            self.settle(block=False)

    def settle(self, block: bool = True) -> None:
        """Add the measured device waits to the stats: all of them when `block`, else those finished."""
        pending = []
        for layer, before, after in self._pending:
            if block:
                after.synchronize()
            if block or after.query():
                self.stats.record_stall(layer, before.elapsed_time(after) / 1e3)
            else:
                pending.append((layer, before, after))
        self._pending = pending

    def clear(self) -> None:
        """Drop the waits so far (the resident layers' loads at construction are not a forward's stalls)."""
        self._pending.clear()

    def _event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event
