"""How one cache's slots are ordered against the CUDA streams that copy into them and read them.

A wait orders only the calling thread's current stream, and consumers may run on several (continuous batching's
compute stream in its own thread, a user's `torch.cuda.stream`). So:
- each landed slot keeps its copy's handle, and every reader's stream waits on it (`order_read`), not only the
  first one;
- a slot keeps one release marker per stream that read it, and the next copy into it waits for all of them;
- the slot memory is recorded on the copy stream and on every reader stream, so that whenever it is freed (close,
  or garbage collection) the allocator reuses it only after their queued work; `close` synchronizes the device.
Off CUDA every method is a no-op.
"""

from __future__ import annotations

from typing import Any

import torch

from .slots import Slot


class StreamOrder:
    """The stream bookkeeping of one cache's slot memory.

    Example:
        >>> order = StreamOrder(torch.empty(0), None, torch.device("cpu")); order.cuda
        False
    """

    def __init__(self, memory: torch.Tensor, copy_stream: Any, device: torch.device):
        self.memory: torch.Tensor | None = memory
        self.device = device
        self.cuda = device.type == "cuda" and copy_stream is not None
        self._reader_streams: set[int] = set()
        if self.cuda:
            memory.record_stream(copy_stream)

    def markers_for_copy(self, slot: Slot) -> list | None:
        """The release markers the next copy into `slot` waits for (all streams that read it); cleared, since
        the copy stream is ordered after them from then on."""
        if slot.release is None:
            return None
        markers, slot.release = list(slot.release.values()), None
        return markers

    def landed(self, slot: Slot, load: Any) -> None:
        """Someone waited for `load`: later readers on other streams wait on it too."""
        if self.cuda:
            slot.ready = load

    @staticmethod
    def order_read(slot: Slot) -> None:
        """Make the calling thread's stream wait for the slot's copy (a no-op once done, or off CUDA)."""
        if slot.ready is not None:
            slot.ready.wait()

    def released(self, slot: Slot, marker: Any) -> None:
        """The calling thread's stream read `slot` last up to `marker`."""
        if marker is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if stream.cuda_stream not in self._reader_streams and self.memory is not None:
            self._reader_streams.add(stream.cuda_stream)
            self.memory.record_stream(stream)
        if slot.release is None:
            slot.release = {}
        slot.release[stream.cuda_stream] = marker

    def before_free(self) -> None:
        """Every stream of the device is done with the slot memory, and this no longer holds it."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.memory = None
