"""Bring one expert slab from the store into a device cache slot, asynchronously.

- `CudaCopyEngine`: copies run on a dedicated CUDA stream from pinned host memory; an event marks each copy's end
  and the compute stream waits on it (the host does not block). Disk reads go through reader threads into pinned
  staging buffers first; a reader waits for its read only, and a staging buffer is reused once the copy out of it
  has finished. Before a slot is overwritten, the copy stream waits for the compute that last read it.
- `CpuCopyEngine`: the CPU twin, for machines without a GPU: reader threads fill CPU cache slots, so disk reads
  overlap with expert compute on the CPU.

Both serve demand loads before queued prefetch loads (`load(..., demand=False)`; a prefetch's disk read yields to
demand reads between its chunks: `storage/read_priority.py`), and a failed read is raised by
every `wait()` of its handle while the engine goes on serving other loads. Each engine measures its own copies
(`meter`, a `TransferMeter`): the host-to-device bandwidth that `expert_compute="auto"` weighs against
CPU compute. `read_host` reads an expert into a host buffer on the same readers, for an expert computed on the CPU.

Example:
    >>> engine = make_copy_engine(store, torch.device("cpu"))    # doctest: +SKIP
    >>> engine.load(layer=0, expert=2, slot=cache_slot).wait()   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from ..storage.read_priority import PriorityReaders, promote_read
from ..storage.store import ExpertStore, HostMemory

EWMA = 0.3                 # weight of a new transfer measurement

# Disk reads of different experts run in parallel: SSDs serve several requests at once far faster than one.
DISK_READERS = 4
# One CUDA copy in this many is timed (a pair of timing events); the others get one plain event, the cheap kind to
# wait on and to query.
TIME_EVERY = 8


class TransferMeter:
    """Bytes per second of the copies a copy engine made (an EWMA, thread-safe): `record(nbytes, seconds)`.

    Example:
        >>> meter = TransferMeter(); meter.record(1000, 0.001); round(meter.bytes_per_s)
        1000000
    """

    def __init__(self) -> None:
        self.bytes_per_s: float | None = None
        self.count = 0
        self._lock = threading.Lock()
        self._pending: deque = deque()     # CUDA (start, end, nbytes) event pairs not known to be done yet

    def record(self, nbytes: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            self.bytes_per_s = rate if self.bytes_per_s is None else (1 - EWMA) * self.bytes_per_s + EWMA * rate
            self.count += 1

    def record_events(self, start: Any, end: Any, nbytes: int) -> None:
        """A CUDA copy timed by an event pair; settled once the end event has run (`settle`)."""
        with self._lock:
            self._pending.append((start, end, nbytes))
            if len(self._pending) > 1024:      # nobody settles (no "auto" decision asked): keep the newest
                self._pending.popleft()

    def settle(self) -> None:
        """Fold in the event-timed copies that have finished (never blocks)."""
        while True:
            with self._lock:
                if not self._pending or not self._pending[0][1].query():
                    return
                start, end, nbytes = self._pending.popleft()
            self.record(nbytes, start.elapsed_time(end) / 1e3)


class ReadClock:
    """How long at least one store read was in flight, and the bytes read: the disk's busy time, so a benchmark
    can tell a schedule that leaves the disk idle (busy share of a step below 1) from a disk that reads slowly
    while busy (bytes / busy seconds). Thread-safe; reads on several readers at once count once.

    Example:
        >>> clock = ReadClock()
        >>> with clock.reading(1 << 20): pass
        >>> clock.bytes
        1048576
    """

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.bytes = 0
        self._in_flight = 0
        self._since = 0.0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reading(self, nbytes: int):
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self.bytes += nbytes
                if self._in_flight == 0:
                    self.busy_s += time.perf_counter() - self._since

    def read(self, store: ExpertStore, layer: int, expert: int, buffer: torch.Tensor) -> None:
        """`store.read_into(layer, expert, buffer)`, counted."""
        with self.reading(store.slab_bytes(layer)):
            store.read_into(layer, expert, buffer)

    def snapshot(self) -> tuple[float, int]:
        """(busy seconds, bytes) so far, counting a read still in flight up to now."""
        with self._lock:
            busy = self.busy_s + (time.perf_counter() - self._since if self._in_flight else 0.0)
            return busy, self.bytes


class CpuLoad:
    """Handle of one CPU load: `wait()` blocks until the slot is filled (or raises the read's error)."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def promote(self) -> bool:
        """The forward needs it now: a speculative read still queued or under way goes on as a demand read (True
        when this call did that)."""
        return promote_read(self._future)

    def done(self) -> bool:
        """Finished, successfully or not (a failure is raised by `wait`)."""
        return self._future.done()


class CpuCopyEngine:
    """Loads run on reader threads (reads and copies release the GIL, so they overlap with compute).

    Example:
        >>> engine = CpuCopyEngine(store)                           # doctest: +SKIP
        >>> engine.load(0, 3, slot, demand=False).wait()            # doctest: +SKIP
    """

    def __init__(self, store: ExpertStore, readers: int | None = None):
        """`readers`: threads reading at once (default: 1 for a host store, `DISK_READERS` for a disk store)."""
        self.store = store
        self.meter = TransferMeter()
        self.read_clock = ReadClock()
        self._readers = PriorityReaders(readers or (1 if store.in_host_memory else DISK_READERS))

    def load(self, layer: int, expert: int, slot: torch.Tensor, after: object | None = None,
             demand: bool = True) -> CpuLoad:
        """Fill `slot` with the expert's slab; `demand=False` (a prefetch) yields to queued demand loads."""
        return CpuLoad(self._readers.submit(lambda: self._timed_read(layer, expert, slot), demand))

    def read_host(self, layer: int, expert: int, buffer: torch.Tensor) -> CpuLoad:
        """Read the expert into the host `buffer` (an expert computed on the CPU), as a demand load."""
        return CpuLoad(self._readers.submit(lambda: self.read_clock.read(self.store, layer, expert, buffer), True))

    def _timed_read(self, layer: int, expert: int, slot: torch.Tensor) -> None:
        start = time.perf_counter()
        self.read_clock.read(self.store, layer, expert, slot)
        self.meter.record(self.store.slab_bytes(layer), time.perf_counter() - start)

    def release_marker(self, device: torch.device) -> None:
        return None   # compute on the CPU is synchronous: a slot is free as soon as its expert returned

    @property
    def pinned_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self._readers.close()


class CudaLoad:
    """Handle of one CUDA load: `wait()` makes the caller's current stream wait for the copy (the host waits only
    for a disk read still running, and raises its error); `done()` is True once the slab is on the device or the
    read has failed."""

    def __init__(self, device: torch.device, event: torch.cuda.Event | None = None, future: Future | None = None):
        self.device, self._event, self._future = device, event, future

    def promote(self) -> bool:
        """The forward needs it now: a speculative disk read still queued or under way goes on as a demand read (True
        when this call did that)."""
        return promote_read(self._future)

    def wait(self) -> None:
        event = self._future.result() if self._future is not None else self._event
        torch.cuda.current_stream(self.device).wait_event(event)   # compute waits, the host does not

    def done(self) -> bool:
        if self._future is None:
            return self._event.query()
        if not self._future.done():
            return False
        return self._future.exception() is not None or self._future.result().query()


class StagingBuffers:
    """Pinned host buffers that disk reads land in before their copy to the device.

    A buffer comes back with the event of the copy out of it; its next user waits for that copy, so a reader
    never waits for its own copy. FIFO order hands out the buffer whose copy was issued first.

    Example:
        >>> staging = StagingBuffers(count=5, numel=1 << 20, dtype=torch.bfloat16, memory=memory)  # doctest: +SKIP
        >>> buffer = staging.acquire(); ...; staging.release(buffer, copy_event)                  # doctest: +SKIP
    """

    def __init__(self, count: int, numel: int, dtype: torch.dtype, memory: HostMemory):
        self._free: queue.Queue[tuple[torch.Tensor, torch.cuda.Event | None]] = queue.Queue()
        for _ in range(count):
            self._free.put((memory.empty((numel,), dtype), None))

    def acquire(self) -> torch.Tensor:
        buffer, copied = self._free.get()
        try:
            if copied is not None:
                copied.synchronize()   # the previous copy out of this buffer has finished
        except BaseException:
            self._free.put((buffer, copied))
            raise
        return buffer

    def release(self, buffer: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        """Give `buffer` back; `copied`: the event after the copy that reads it (None: no copy was issued)."""
        self._free.put((buffer, copied))


class CudaCopyEngine:
    """Host-to-device copies on their own stream, ordered against compute by events.

    Example:
        >>> engine = CudaCopyEngine(store, torch.device("cuda:1"))               # doctest: +SKIP
        >>> engine.load(0, 3, slot, after=[engine.release_marker(slot.device)]).wait()  # doctest: +SKIP
    """

    def __init__(self, store: ExpertStore, device: torch.device, readers: int = DISK_READERS):
        """`readers`: disk reads at once (a disk store gets `readers + 1` pinned staging buffers of one slab)."""
        self.store, self.device = store, device
        self.meter = TransferMeter()
        self.read_clock = ReadClock()     # disk reads only (a host store's copies are timed by `meter`)
        self._memory = HostMemory(device)
        self._copies = itertools.count()
        memory = getattr(store, "memory", None)
        if isinstance(memory, HostMemory):
            memory.note_reader(device)    # its slabs are unregistered only after this device's copies are done
        self._readers: PriorityReaders | None = None
        self._staging: StagingBuffers | None = None
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
        if not store.in_host_memory:
            numel = max(lay.numel for lay in store.layouts)
            # One more buffer than readers: a reader starts its next read while the last copy drains.
            self._staging = StagingBuffers(readers + 1, numel, store.dtype, self._memory)
            self._readers = PriorityReaders(readers)

    def load(self, layer: int, expert: int, slot: torch.Tensor, after: Sequence[torch.cuda.Event] | None = None,
             demand: bool = True) -> CudaLoad:
        """Copy the expert's slab into `slot` once the compute behind every event of `after` is done;
        `demand=False` (a prefetch) yields to queued demand reads."""
        host = self.store.host_slab(layer, expert)
        if host is not None:
            return CudaLoad(self.device, event=self._copy(host, slot, after))
        future = self._readers.submit(lambda: self._read_and_copy(layer, expert, slot, after), demand)
        return CudaLoad(self.device, future=future)

    def read_host(self, layer: int, expert: int, buffer: torch.Tensor) -> CpuLoad:
        """Read the expert into the host `buffer` (an expert computed on the CPU), on the disk readers as a demand
        read (on the calling thread for a host store, which has no readers and needs none: `host_slab`)."""
        if self._readers is None:
            future: Future = Future()
            future.set_result(self.store.read_into(layer, expert, buffer))
            return CpuLoad(future)
        return CpuLoad(self._readers.submit(lambda: self.read_clock.read(self.store, layer, expert, buffer), True))

    def _copy(self, host: torch.Tensor, slot: torch.Tensor, after: Sequence[torch.cuda.Event] | None
              ) -> torch.cuda.Event:
        """Issue the copy on the copy stream (under this device, so a reader thread touches no other GPU)."""
        # Timed copies feed the bandwidth that expert_compute="auto" and the look-ahead gate weigh; a sample is
        # enough, and the compute stream never waits on a timing event.
        timed = next(self._copies) % TIME_EVERY == 0
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for marker in after or ():
                self.stream.wait_event(marker)     # the compute that last read this slot, on every stream, is done
            start = torch.cuda.Event(enable_timing=True) if timed else None
            if start is not None:
                start.record(self.stream)
            slot[:host.numel()].copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.stream)
                self.meter.record_events(start, end, host.nbytes)
        return event

    def _read_and_copy(self, layer: int, expert: int, slot: torch.Tensor,
                       after: Sequence[torch.cuda.Event] | None) -> torch.cuda.Event:
        """On a reader thread: read into a staging buffer, issue its copy, return at once (the copy's event)."""
        buffer = self._staging.acquire()
        copied = None
        try:
            self.read_clock.read(self.store, layer, expert, buffer)
            copied = self._copy(buffer[:self.store.layouts[layer].numel], slot, after)
            return copied
        finally:
            self._staging.release(buffer, copied)

    def release_marker(self, device: torch.device) -> torch.cuda.Event:
        """An event on the compute stream after the work that reads a slot; the next copy into it waits on it."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    @property
    def pinned_bytes(self) -> int:
        """Host bytes pinned for staging (0 for a host store)."""
        return self._memory.pinned_bytes

    def close(self) -> None:
        """Finish queued reads, let the copies land, then unpin the staging buffers."""
        if self._readers is not None:
            self._readers.close()
        self.stream.synchronize()
        self._memory.close()


def make_copy_engine(store: ExpertStore, device: torch.device) -> CpuCopyEngine | CudaCopyEngine:
    """The engine for `device`: CUDA stream and events for a CUDA device, reader threads otherwise.

    Example:
        >>> engine = make_copy_engine(store, torch.device("cuda:0"))   # doctest: +SKIP
    """
    return CudaCopyEngine(store, device) if device.type == "cuda" else CpuCopyEngine(store)
