"""A CUDA stream per micro-batch slice, so that a slice's host work waits only for its own device work (CGOPipe).

Why: with CPU attention on a CUDA model, a slice's attention copies its queries, keys and values to the host with a
blocking copy, which waits for everything queued before it on its stream. On one stream that includes the previous
slice's expert kernels: the host idled while the device computed experts, and the device idled during the host's
attention. On a stream of its own, the copy waits only for the slice's own projections, and the previous slice's
experts run on the device meanwhile. The routing sync of a slice (`arch.forward.routes_on_host`) likewise waits only
for its own router.

Ordering (torch's caching allocator hands a freed block out again on the stream that allocated it, in that stream's
order, so every read from another stream must be ordered or recorded):
- a slice's stream first waits for the layer's stream, where its inputs were made;
- the layer's stream waits for every slice's stream (`join`) before the outputs are joined and before the layer's
  held experts are released, so their release markers stand behind every slice's expert kernels;
- a tensor a slice reads that another stream made or will free (the KV cache's rows, the earlier slices' new keys
  and values) is waited for with an event and marked used on the reading stream (`record_stream`):
  `MicroBatchCacheView`.

Used only where it pays and is safe to reason about: a CUDA batch whose attention runs on the CPU. Elsewhere the
slices run one after the other on the layer's stream, as before.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from ..attention.cpu import ATTN_IMPLEMENTATION as CPU_ATTENTION

_streams: dict[torch.device, list[torch.cuda.Stream]] = {}
_lock = threading.Lock()


def side_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """`count` streams of `device`, made once per device and reused by every split layer call (threads take turns
    per call: `MicroBatchedLayers._turn`)."""
    with _lock:
        streams = _streams.setdefault(device, [])
        while len(streams) < count:
            streams.append(torch.cuda.Stream(device))
        return streams[:count]


class SliceStreams:
    """The streams one split layer call runs its slices on, and the stream it was called on (`main`).

    Example:
        >>> streams = SliceStreams(torch.device("cuda", 0), 2)                 # doctest: +SKIP
        >>> with streams.running(0): out0 = layer(slice0)                      # doctest: +SKIP
        >>> with streams.running(1): out1 = layer(slice1)                      # doctest: +SKIP
        >>> streams.join()                   # the caller's stream waits for both  # doctest: +SKIP
    """

    def __init__(self, device: torch.device, count: int):
        self.main = torch.cuda.current_stream(device)
        self.streams = side_streams(device, count)

    @contextlib.contextmanager
    def running(self, index: int) -> Iterator[None]:
        """Run the block as slice `index`: on its own stream, after what the caller's stream queued so far."""
        stream = self.streams[index]
        stream.wait_stream(self.main)
        with torch.cuda.stream(stream):
            yield

    def join(self) -> None:
        """The caller's stream waits for every slice's work."""
        for stream in self.streams:
            self.main.wait_stream(stream)


def for_layer_call(model: torch.nn.Module, hidden: torch.Tensor, count: int) -> SliceStreams | None:
    """Streams for a split layer call of `model` on `hidden`: only a CUDA batch whose attention runs on the CPU."""
    if not hidden.is_cuda or getattr(model.config, "_attn_implementation", None) != CPU_ATTENTION:
        return None
    return SliceStreams(hidden.device, count)


def ready_marker(tensor: torch.Tensor) -> torch.cuda.Event | None:
    """An event behind the work that made `tensor` on the current stream (None off CUDA), for `consume`."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def consume(tensor: torch.Tensor, made: torch.cuda.Event | None = None) -> torch.Tensor:
    """`tensor`, safe to read on the current stream: after `made` (the work that made it on another stream), and
    kept from reuse until this stream's reads are done. Off CUDA, `tensor` as it is."""
    if tensor.is_cuda:
        stream = torch.cuda.current_stream(tensor.device)
        if made is not None:
            stream.wait_event(made)
        tensor.record_stream(stream)
    return tensor
