"""Demand reads before speculative ones, down to the chunk.

A read the forward waits for (demand) must not queue behind a read of a guess (a prefetch, a read-ahead): the guess
should use disk time that was idle, and cost nothing more. `PriorityReaders` runs queued demand jobs first; a
speculative expert read runs under `speculative()`, which `DiskStore` sees: it then reads smaller chunks, a few in
flight, each started only while no demand read is under way (`DemandGate`), so a guess being read yields to a
demand read between its chunks.

A guess that turns out right is waited for by the forward: `ReadFuture.promote()` then makes it a demand read. A
job still queued runs next, as a demand job; a read under way reads its remaining chunks as a demand read does
(all at once, on the chunk readers), instead of one by one behind the demand reads it would otherwise yield to.

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
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

_local = threading.local()


class Promotion:
    """Whether a speculative read has become a demand read (the forward now waits for it), and who to tell."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._promoted = False
        self._listeners: list[Callable[[], None]] = []

    @property
    def promoted(self) -> bool:
        return self._promoted

    def promote(self) -> bool:
        """Promote (once); whether this call did."""
        with self._lock:
            if self._promoted:
                return False
            self._promoted = True
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener()
        return True

    def on_promote(self, listener: Callable[[], None]) -> None:
        """Call `listener` once promoted (now, if it already is)."""
        with self._lock:
            if not self._promoted:
                self._listeners.append(listener)
                return
        listener()


@contextlib.contextmanager
def speculative(promotion: Promotion | None = None) -> Iterator[None]:
    """Reads made by this thread inside the block are for a guess: their chunks yield to demand reads, until
    `promotion` (if given) is promoted."""
    before = getattr(_local, "speculative", None)
    _local.speculative = promotion or Promotion()
    try:
        yield
    finally:
        _local.speculative = before


def reading_speculatively() -> bool:
    """Whether this thread's current read is for a guess (inside `speculative()`, not promoted)."""
    promotion = getattr(_local, "speculative", None)
    return promotion is not None and not promotion.promoted


def current_promotion() -> Promotion | None:
    """The promotion of this thread's speculative read (None outside `speculative()`)."""
    return getattr(_local, "speculative", None)


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

    def wait_for_no_demand(self, promotion: Promotion | None = None) -> None:
        """Return once no demand read is under way, or once `promotion` is promoted."""
        if promotion is not None:
            promotion.on_promote(self._wake)
        with self._cond:
            self._cond.wait_for(lambda: self._active == 0 or (promotion is not None and promotion.promoted))

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class ReadFuture(Future):
    """The future of a `PriorityReaders` job; `promote()` makes a speculative job a demand job (a no-op for a
    demand job, or one already done)."""

    def __init__(self, promotion: Promotion | None = None):
        super().__init__()
        self.promotion = promotion

    def promote(self) -> bool:
        """Whether this call promoted a speculative job still queued or under way."""
        if self.promotion is None or self.done():
            return False
        return self.promotion.promote()


def promote_read(future: Future | None) -> bool:
    """`future.promote()` for a `PriorityReaders` job; False for any other future (a read already done, or one
    run on the caller's thread) or None."""
    return isinstance(future, ReadFuture) and future.promote()


class _Job:
    """A queued job, pushed once more (as a demand job) when promoted; whichever push a worker pops first runs it."""

    __slots__ = ("run", "future", "claimed")

    def __init__(self, run: Callable[[], Any], future: ReadFuture):
        self.run, self.future, self.claimed = run, future, False


def submit_or_run(pool: ThreadPoolExecutor, work: Callable[..., Any], *args: Any) -> Future:
    """`pool.submit(work, *args)`; where the pool takes no more work (closed, or the interpreter exiting while
    other threads still generate: its exit hook stops every pool first) `work` runs on this thread instead, and
    the future returned is already settled. Nothing submitted is left that nothing will finish."""
    try:
        return pool.submit(work, *args)
    except RuntimeError:
        done: Future = Future()
        try:
            done.set_result(work(*args))
        except BaseException as err:      # the future carries it, as the pool's would
            done.set_exception(err)
        return done


class PriorityReaders:
    """A thread pool that runs demand jobs before queued speculative jobs, first come first served within each.

    Each submission queues the job on a heap and wakes one worker, which runs the best job queued at that moment.
    A promoted speculative job (`ReadFuture.promote`) is queued again as a demand job. The workers are a
    `ThreadPoolExecutor`'s: they exit once this object is closed or garbage-collected.

    Example:
        >>> readers = PriorityReaders(1)
        >>> readers.submit(lambda: 42, demand=True).result()
        42
        >>> readers.close()
    """

    def __init__(self, workers: int):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hf_moe_offload_copy")
        self._jobs: list[tuple[int, int, _Job]] = []
        self._lock = threading.Lock()
        self._order = itertools.count()

    def submit(self, job: Callable[[], Any], demand: bool) -> ReadFuture:
        future = ReadFuture(None if demand else Promotion())
        entry = _Job(job, future)
        self._push(entry, demand)
        if future.promotion is not None:
            readers = weakref.ref(self)      # a future kept after the pool is dropped does not keep it alive
            future.promotion.on_promote(lambda: (r := readers()) is not None and r._push(entry, True))
        return future

    def _push(self, entry: _Job, demand: bool) -> None:
        with self._lock:
            if entry.claimed:        # promoted while running: the read itself switches to demand
                return
            heapq.heappush(self._jobs, (0 if demand else 1, next(self._order), entry))
        try:
            self._pool.submit(_run_best, self._jobs, self._lock)
        except RuntimeError:
            # Closed, or the interpreter is exiting (its hook stops every pool while other threads still generate):
            # queued jobs run here until this one has run, or is running elsewhere. Nothing is left unfinished.
            while True:
                with self._lock:
                    if entry.claimed or not self._jobs:
                        return
                _run_best(self._jobs, self._lock)

    def close(self) -> None:
        """Run every queued job, then stop the threads."""
        self._pool.shutdown(wait=True)


def _run_best(jobs: list, lock: threading.Lock) -> None:
    """Run the highest-priority queued job and settle its future (a module function: workers hold no pool); a
    speculative job runs under `speculative()`, so the reads it makes yield to demand reads chunk by chunk."""
    with lock:
        _, _, entry = heapq.heappop(jobs)
        if entry.claimed:                 # the other push of a promoted job ran it
            return
        entry.claimed = True
    future = entry.future
    if not future.set_running_or_notify_cancel():
        return
    try:
        if future.promotion is not None and not future.promotion.promoted:
            with speculative(future.promotion):
                result = entry.run()
        else:
            result = entry.run()
    except BaseException as err:   # the waiter re-raises it; the worker stays alive for the next job
        future.set_exception(err)
    else:
        future.set_result(result)
