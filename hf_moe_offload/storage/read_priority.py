"""Demand reads before speculative ones, down to the chunk.

A read the forward waits for (demand) must not queue behind a read of a guess (a prefetch, a read-ahead): the guess
should use disk time that was idle, and cost nothing more. `PriorityReaders` runs queued demand jobs first; a
speculative expert read runs under `speculative()`, which `DiskStore` sees: it then reads its chunks one at a time,
each only while no demand read is under way (`DemandGate`), so a guess being read yields to a demand read between
its chunks and holds at most one chunk in flight.

Example:
    >>> readers = PriorityReaders(1)
    >>> readers.submit(reading_speculatively, demand=False).result()
    True
    >>> reading_speculatively()
    False
    >>> readers.close()
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

_local = threading.local()


@contextlib.contextmanager
def speculative() -> Iterator[None]:
    """Reads made by this thread inside the block are for a guess: their chunks yield to demand reads."""
    before = getattr(_local, "speculative", False)
    _local.speculative = True
    try:
        yield
    finally:
        _local.speculative = before


def reading_speculatively() -> bool:
    """Whether this thread's current read is for a guess (inside `speculative()`)."""
    return getattr(_local, "speculative", False)


class DemandGate:
    """Counts the demand reads under way (`demand()`), so that a speculative read can wait until there are none
    (`wait_for_no_demand()`) before each of its chunks.

    Example:
        >>> gate = DemandGate()
        >>> with gate.demand():
        ...     pass                     # a demand read
        >>> gate.wait_for_no_demand()    # returns at once: none under way
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0

    @contextlib.contextmanager
    def demand(self) -> Iterator[None]:
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    def wait_for_no_demand(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._active == 0)


class PriorityReaders:
    """A thread pool that runs demand jobs before queued speculative jobs, first come first served within each.

    Each submission queues the job on a heap and wakes one worker, which runs the best job queued at that moment.
    The workers are a `ThreadPoolExecutor`'s: they exit once this object is closed or garbage-collected.

    Example:
        >>> readers = PriorityReaders(1)
        >>> readers.submit(lambda: 42, demand=True).result()
        42
        >>> readers.close()
    """

    def __init__(self, workers: int):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hf_moe_offload_copy")
        self._jobs: list[tuple[int, int, Callable[[], Any], Future]] = []
        self._lock = threading.Lock()
        self._order = itertools.count()

    def submit(self, job: Callable[[], Any], demand: bool) -> Future:
        future: Future = Future()
        with self._lock:
            heapq.heappush(self._jobs, (0 if demand else 1, next(self._order), job, future))
        self._pool.submit(_run_best, self._jobs, self._lock)
        return future

    def close(self) -> None:
        """Run every queued job, then stop the threads."""
        self._pool.shutdown(wait=True)


def _run_best(jobs: list, lock: threading.Lock) -> None:
    """Run the highest-priority queued job and settle its future (a module function: workers hold no pool); a
    speculative job runs under `speculative()`, so the reads it makes yield to demand reads chunk by chunk."""
    with lock:
        priority, _, job, future = heapq.heappop(jobs)
    if not future.set_running_or_notify_cancel():
        return
    try:
        if priority:
            with speculative():
                result = job()
        else:
            result = job()
    except BaseException as err:   # the waiter re-raises it; the worker stays alive for the next job
        future.set_exception(err)
    else:
        future.set_result(result)
