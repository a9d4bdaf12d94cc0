"""Where experts live when they are not on the device: one contiguous slab per expert.

- `DiskStore`: experts stay in the checkpoint's safetensors files; `read_into` preads one expert's bytes straight
  into a destination buffer (a pinned staging buffer or a CPU cache slot). Host memory holds no expert. Fine-grained
  FP8 experts (pieces with block scales) and MXFP4 experts (GPT-OSS, `Mxfp4Scales`) are dequantized into the model
  dtype as they are read, so every slab is dense.
- `CpuStore`: every expert in host memory as rows of one [E, slab] tensor per layer, page-locked in place when the
  device is CUDA (`HostMemory`), so a slab goes to the device in a single asynchronous copy.

Example:
    >>> store = CpuStore.from_reader(DiskStore(layers, pieces, torch.bfloat16))                 # doctest: +SKIP
    >>> store.host_slab(layer=0, expert=3).shape                                              # doctest: +SKIP
    >>> CpuStore.from_reader(DiskStore(layers, pieces, dtype), device=torch.device("cuda:1"))  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import resource
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence

import torch

from .._logging import progress
from ..layout import ExpertPiece, ExpertTensors, MoELayer, SlabLayout
from .checkpoint import Mxfp4Scales, pread_exact, read_fp8_into, read_into, read_mxfp4_into, split_range
from .direct_io import AlignedBuffers, open_direct, pread_direct
from .gguf_layout import GGUFSlabLayout
from .integrity import ExpertChecksums, FileIdentity, check_identity
from .packed_layout import PackedSlabLayout
from .pages import release_pages
from .quantize import QuantizedSlabLayout
from .read_priority import DemandGate, Promotion, current_promotion, reading_speculatively, submit_or_run

# cudaHostRegister pins whole pages; a buffer owns the pages it registers so that no two registrations overlap.
PAGE = mmap.PAGESIZE


class HostMemory:
    """Host buffers for one owner, page-locked in place (cudaHostRegister) when a CUDA device is given.

    torch's pinned allocator rounds every request up to a power of two (a 2.63 GiB layer would pin 4 GiB);
    registering ordinary memory pins the requested bytes rounded to a page. The registration is made under
    `torch.cuda.device(device)`, so no context appears on another GPU. Buffers are allocated outside inference
    mode: worker threads and `generate` (no_grad) must be able to write into them. `close()` (or garbage
    collection) unregisters everything, after the device has finished any copy out of it.

    Example:
        >>> memory = HostMemory(None)                        # no device: ordinary memory, nothing pinned
        >>> memory.empty((2, 3), torch.float32).shape, memory.pinned_bytes
        (torch.Size([2, 3]), 0)
    """

    def __init__(self, device: torch.device | None):
        self.device = device
        self.pinned_bytes = 0
        # (registered address, bytes, the allocation holding it): the memory stays alive until it is unregistered.
        self._registered: list[tuple[int, int, torch.Tensor]] = []
        # Every device whose copy engine reads these buffers (a host store serves the caches of several GPUs):
        # each must be idle before the memory is unregistered.
        self._readers: set[torch.device] = set() if device is None else {device}
        self._unregister = weakref.finalize(self, _unregister_all, self._registered, self._readers)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor, pinned when this memory has a device."""
        nbytes = math.prod(shape) * dtype.itemsize
        with torch.inference_mode(False):
            if self.device is None or nbytes == 0:
                return torch.empty(shape, dtype=dtype)
            size = -(-nbytes // PAGE) * PAGE
            # An anonymous mapping starts on a page, so the tensor's storage begins where the registration does:
            # torch's `is_pinned()` looks at the storage's first byte, and no other allocation shares these pages.
            raw = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
            _register(raw.data_ptr(), size, self.device)
            self._registered.append((raw.data_ptr(), size, raw))
            self.pinned_bytes += size
            return raw[:nbytes].view(dtype).view(shape)

    def note_reader(self, device: torch.device) -> None:
        """`device`'s copy engine reads these buffers: unregistering waits for it too."""
        if self.device is not None:
            self._readers.add(device)

    def release(self, tensor: torch.Tensor) -> None:
        """Unregister and forget the buffer `tensor` came from (`empty`), so that it is freed with its last
        reference instead of with this memory; nothing happens for a buffer this memory does not hold."""
        storage = tensor.untyped_storage().data_ptr()
        entry = next((e for e in self._registered if e[2].untyped_storage().data_ptr() == storage), None)
        if entry is None:
            return
        self._registered.remove(entry)
        _unregister_all([entry], self._readers)
        self.pinned_bytes -= entry[1]

    def close(self) -> None:
        """Unregister every buffer (they stay valid as ordinary memory while referenced)."""
        self._unregister()
        self.pinned_bytes = 0


def _register(address: int, nbytes: int, device: torch.device) -> None:
    with torch.cuda.device(device):
        result = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        code = int(result)
        if code:
            # The runtime also left the error as this thread's last error, which torch's next kernel launch check
            # (cudaGetLastError) would raise as its own: clear it while still on this device.
            _clear_last_cuda_error()
            _absorb_launch_error(device)
    if code:
        raise RuntimeError(f"cannot pin {nbytes} bytes of host memory for {device} (CUDA error {code}: "
                           f"{_cuda_error_name(result)}): the host may be out of lockable memory (see `ulimit -l`); "
                           f"use store='disk' or free host memory")


def _cuda_error_name(result) -> str:
    try:
        return torch.cuda.cudart().cudaGetErrorString(result)
    except Exception:            # the name is only for the message
        return str(result)


def _clear_last_cuda_error() -> None:
    """`cudaGetLastError()` in the CUDA runtime torch loaded (the error state is that library's, per thread)."""
    runtime = _loaded_cudart()
    if runtime is not None:
        runtime.cudaGetLastError()


def _absorb_launch_error(device: torch.device) -> None:
    """Let torch's own launch check take a last error still set: torch may link a CUDA runtime of its own (static)
    that `_clear_last_cuda_error` cannot reach, and its check after a kernel launch reads and clears the error."""
    if not torch.cuda.is_available():
        return
    try:
        torch.zeros(1, device=device)
    except RuntimeError:         # the registration's error, raised once here instead of by the caller's next launch
        pass


def _loaded_cudart():
    """The CUDA runtime library already loaded in this process (ctypes), or None when none is found."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart" in line.rsplit("/", 1)[-1]), None)
    except OSError:
        path = None
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def _unregister_all(registered: list[tuple[int, int, torch.Tensor]], readers: set[torch.device]) -> None:
    """Unregister after every device that reads the buffers is idle: a DMA may still read a slab or staging
    buffer."""
    if not registered:
        return
    for device in readers:
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)
    device = next(iter(readers))
    with torch.cuda.device(device):
        results = [torch.cuda.cudart().cudaHostUnregister(address) for address, _, _ in registered]
    registered.clear()
    for result in results:
        torch.cuda.check_error(result)


def pinning_device(pin: bool | None, device: torch.device | None) -> torch.device | None:
    """The CUDA device under which host memory is pinned, or None for ordinary memory.

    `pin=None` pins exactly when `device` is a CUDA device; `pin=True` without a device pins for the current one.

    Example:
        >>> pinning_device(None, torch.device("cpu")) is None
        True
    """
    if pin is None:
        pin = device is not None and device.type == "cuda"
    if not pin:
        return None
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        raise ValueError(f"pinned host memory needs a CUDA device, got device={device}; pass a 'cuda:N' device "
                         f"or pin=False")
    return device


class ExpertStore:
    """Common shape of both stores: per-layer slab layouts, one dtype.

    `dtype` is what a slab is made of (the cache allocates slots of it); `compute_dtype` the dtype the experts
    compute in. They differ for quantized experts (`QuantizedSlabLayout`): uint8 slabs, model-dtype compute."""

    def __init__(self, layouts: Sequence[SlabLayout | QuantizedSlabLayout], num_experts: Sequence[int],
                 dtype: torch.dtype, compute_dtype: torch.dtype | None = None):
        self.layouts = list(layouts)
        self.num_experts = list(num_experts)
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype

    @property
    def quantized(self) -> bool:
        return isinstance(self.layouts[0], (QuantizedSlabLayout, GGUFSlabLayout, PackedSlabLayout)) if self.layouts \
            else False

    def slab_bytes(self, layer: int) -> int:
        return self.layouts[layer].numel * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return sum(self.slab_bytes(i) * n for i, n in enumerate(self.num_experts))

    @property
    def in_host_memory(self) -> bool:
        """Whether every slab is in host memory (`host_slab`), rather than read on demand (`read_into`)."""
        return False

    @property
    def plain_in_memory(self) -> bool:
        """Whether `host_slab` holds every expert's plain bytes to read. False where they are read with `read_into`:
        a store on disk, or a CPU store whose experts compute from packed copies only (`CpuStore.release_plain`)."""
        return self.in_host_memory

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this store holds page-locked (0 when nothing is pinned)."""
        return 0

    def host_slab(self, layer: int, expert: int) -> torch.Tensor | None:
        """The expert's slab in host memory, or None when it must be read (`read_into`)."""
        return None

    def release_layer(self, layer: int) -> None:
        """Free the host copy of `layer`'s experts (`disable()`, once they are back in the model); the store is
        closed next and must not be read for that layer again. Nothing to do for a store that holds none."""

    def read_into(self, layer: int, expert: int, dst: torch.Tensor) -> None:
        raise NotImplementedError

    def read_directly(self, on: bool = True) -> None:
        """Read files around the page cache (policy `disk_reads`). Nothing to do for a store that reads none."""

    @property
    def reads_directly(self) -> bool:
        """Whether this store's expert reads bypass the page cache now."""
        return False

    def close(self) -> None:
        """Release what the store holds (files, pinned memory); the owner calls it once it is done reading."""


READ_CHUNK_BYTES = 4 << 20   # one expert's bytes are read in pieces of this size ...
CHUNK_READERS = 4            # ... by this many threads at once
# A guess read ahead is read in smaller pieces, CHUNK_READERS of them in flight while no demand read is under way:
# the disk needs several reads in flight for its bandwidth, and a demand read that arrives waits only for those.
SPECULATIVE_CHUNK_BYTES = 1 << 20


class DiskStore(ExpertStore):
    """Experts read on demand, per expert, from the checkpoint's safetensors files.

    Every file is opened when the store is made (a file renamed over or deleted later is still the one read) and
    its identity compared with the one recorded when its header was read; before each read the file is checked
    again, so a checkpoint rewritten in place is refused, naming it, rather than read. The descriptors are shared
    by the reader threads, and closed by `close()` or, for a store dropped without it, when the store is
    garbage-collected.
    """

    def __init__(self, layers: Sequence[MoELayer], pieces: list[list[list[ExpertPiece]]], dtype: torch.dtype,
                 layouts: Sequence[QuantizedSlabLayout] | None = None, checksums: ExpertChecksums | None = None):
        """`pieces[layer][expert]`: where each expert's bytes are (`MoEArch.locate_expert`). With quantized
        `layouts`, each piece is a whole quantized slab ("slab", from a quantized folder), stored in the layout's
        packing and read as uint8; `dtype` is then the compute dtype. `checksums`: each expert's checksum (files
        the library wrote), checked at the expert's first read in this process."""
        if layouts is None:
            super().__init__([lay.layout for lay in layers], [lay.num_experts for lay in layers], dtype)
        else:
            super().__init__(layouts, [lay.num_experts for lay in layers], torch.uint8, compute_dtype=dtype)
        self.pieces = pieces
        self.checksums = checksums
        # Each file's identity when its header was read (a range built without one: the file as first opened).
        self._identities: dict[str, FileIdentity | None] = {}
        for rng in (r for layer in self.pieces for exp in layer for p in exp
                    for r in (p.source, p.scales.source if p.scales else p.source)):
            if self._identities.get(rng.path) is None:
                self._identities[rng.path] = rng.identity
        self.files = sorted(self._identities)
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()   # several reader threads share the file descriptors
        self._bounce = threading.local()    # per reader thread: raw bytes awaiting dtype conversion
        self._chunk_pool: ThreadPoolExecutor | None = None   # parallel chunk reads, started on first use
        self._demand = DemandGate()          # demand reads under way: speculative chunks wait for none
        # Direct reads (`read_directly`): their descriptors (None: the file system refused one), aligned buffers.
        self._direct_fds: dict[str, int | None] = {}
        self._aligned: AlignedBuffers | None = None
        # Holds the fd dicts, not the store, so that it runs when the store is collected.
        weakref.finalize(self, _close_fds, self._fds, self._fds_lock)
        weakref.finalize(self, _close_fds, self._direct_fds, self._fds_lock)
        try:
            for path in self.files:
                self._fd(path)
        except BaseException:
            self.close()
            raise

    def read_into(self, layer: int, expert: int, dst: torch.Tensor) -> None:
        """Fill the flat CPU tensor `dst` (numel >= slab) with the expert's slab.

        Bytes that need no dtype conversion are read in chunks by several threads at once: one expert's read then
        reaches the disk's parallel bandwidth (several reads in flight are faster than one), which lets a streaming
        window of one or two slots keep the disk busy."""
        layout = self.layouts[layer]
        parts = layout.regions(dst) if self.quantized else layout.views(dst[:layout.numel])
        chunks, interleaved, read = [], [], []
        chunk_bytes = SPECULATIVE_CHUNK_BYTES if reading_speculatively() else READ_CHUNK_BYTES
        for piece in self.pieces[layer][expert]:
            if isinstance(piece.scales, Mxfp4Scales):    # MXFP4 (GPT-OSS): dequantized, transposed, whole part
                read_mxfp4_into(piece.source, piece.scales, parts[piece.part], self._fd(piece.source.path),
                                self._fd(piece.scales.source.path), self._bounce_buffer(piece.source.nbytes))
                continue
            rows = piece.source.shape[0]
            target = parts[piece.part][piece.row:piece.row + rows]
            if piece.interleaved:
                interleaved.append(target)
            read.append(target)
            fd = self._fd(piece.source.path)
            if piece.scales is not None:        # fine-grained FP8: dequantized on the way in (CPU work, per read)
                read_fp8_into(piece.source, piece.scales, target, fd, self._fd(piece.scales.source.path),
                              self._bounce_buffer(piece.source.nbytes))
                continue
            if piece.source.dtype != self.dtype:
                read_into(piece.source, target, fd, self._bounce_buffer(piece.source.nbytes))
                continue
            raw = memoryview(target.reshape(-1).view(torch.uint8).numpy())
            reader = self._chunk_reader(piece.source.path, fd)
            chunks += [(reader, rng, raw[start:start + rng.nbytes])
                       for rng, start in split_range(piece.source, chunk_bytes)]
        self._read_chunks(chunks)
        if self.checksums is not None:        # the bytes as they are in the file, before any reordering
            path = self.pieces[layer][expert][0].source.path
            self.checksums.verify(layer, expert, [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in read],
                                  path, self._identities[path])
        for target in interleaved:      # rows (gate 0, up 0, gate 1, ...) -> gate rows, then up rows
            target.copy_(target.view(target.shape[0] // 2, 2, *target.shape[1:]).transpose(0, 1).flatten(0, 1))

    def read_directly(self, on: bool = True) -> None:
        """Read the experts' bytes around the page cache (`disk_reads="direct"`), where the file system allows it;
        a file whose file system refuses is read through the page cache, as before. Loading and the engine both
        set it: a second call in the same state changes nothing."""
        if on == (self._aligned is not None):
            return
        self._aligned = AlignedBuffers() if on else None
        if not on:
            _close_fds(self._direct_fds, self._fds_lock)
        for path in self.files if on else ():
            self._direct_fd(path)

    @property
    def reads_directly(self) -> bool:
        """Whether expert reads bypass the page cache (on, and some file took a direct descriptor)."""
        return self._aligned is not None and any(fd is not None for fd in self._direct_fds.values())

    def _chunk_reader(self, path: str, fd: int) -> Callable:
        """How the chunks of `path` are read: `(range, buffer)` -> filled buffer, directly when that is on."""
        direct = self._direct_fd(path) if self._aligned is not None else None
        if direct is None:
            return lambda rng, buf: pread_exact(rng, buf, fd)
        aligned = self._aligned
        return lambda rng, buf: pread_direct(rng, buf, direct, aligned)

    def _direct_fd(self, path: str) -> int | None:
        """`path` opened for direct reads (once), checked to be the file indexed; None: its file system refuses."""
        if path in self._direct_fds:
            return self._direct_fds[path]
        buffered = self._fd(path)               # the file open since the store was made, whatever its name holds now
        with self._fds_lock:
            if path not in self._direct_fds:
                direct = open_direct(path, buffered)
                if direct is not None:       # opened again: the file indexed, or refused as such
                    try:
                        check_identity(path, direct, self._identities[path])
                    except BaseException:
                        os.close(direct)
                        raise
                self._direct_fds[path] = direct
            return self._direct_fds[path]

    def _read_chunks(self, chunks: list) -> None:
        """Read every (read, range, buffer). A demand read takes the first chunk on this thread and the rest on the
        chunk readers at once; a speculative read (`read_priority.speculative`) keeps a few in flight
        (`_read_yielding`), each started once no demand read is under way; once promoted (the forward waits for
        it), the rest is read as a demand read."""
        if reading_speculatively():
            chunks = self._read_yielding(chunks, current_promotion())
            if not chunks:
                return
        with self._demand.demand():
            self._read_at_once(chunks)

    def _read_at_once(self, chunks: list) -> None:
        """The first chunk on this thread, the rest on the chunk readers, all at once."""
        futures = [submit_or_run(self._chunk_readers(), read, rng, buf) for read, rng, buf in chunks[1:]]
        try:
            if chunks:
                read, rng, buf = chunks[0]
                read(rng, buf)
        finally:
            _wait_all(futures)

    def _read_yielding(self, chunks: list, promotion: Promotion) -> list:
        """Read `chunks` on the chunk readers, up to `CHUNK_READERS` in flight, each started once no demand read is
        under way; the chunks not started once `promotion` is promoted (none when all were read)."""
        in_flight: deque = deque()
        try:
            for i, (read, rng, buf) in enumerate(chunks):
                if len(in_flight) == CHUNK_READERS:
                    in_flight.popleft().result()
                self._demand.wait_for_no_demand(promotion)
                if promotion.promoted:
                    return chunks[i:]
                in_flight.append(submit_or_run(self._chunk_readers(), read, rng, buf))
            return []
        finally:
            _wait_all(in_flight)

    def _chunk_readers(self) -> ThreadPoolExecutor:
        if self._chunk_pool is None:
            with self._fds_lock:
                if self._chunk_pool is None:
                    self._chunk_pool = ThreadPoolExecutor(CHUNK_READERS, thread_name_prefix="hf_moe_offload_chunk")
        return self._chunk_pool

    def _bounce_buffer(self, nbytes: int) -> torch.Tensor:
        """This thread's bounce buffer, grown to at least `nbytes` (reused across pieces and experts)."""
        buffer = getattr(self._bounce, "buffer", None)
        if buffer is None or buffer.numel() < nbytes:
            with torch.inference_mode(False):
                buffer = self._bounce.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return buffer

    def _fd(self, path: str) -> int:
        """The open file `path`, checked to be the file indexed (an `IntegrityError` naming it otherwise)."""
        with self._fds_lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = _open_shard(path)
                try:
                    self._identities[path] = check_identity(path, fd, self._identities[path])
                except BaseException:
                    os.close(fd)
                    raise
                self._fds[path] = fd
            else:
                check_identity(path, fd, self._identities[path])
            return fd

    def close(self) -> None:
        """Close the open files (a later read opens them again)."""
        _close_fds(self._fds, self._fds_lock)
        _close_fds(self._direct_fds, self._fds_lock)


def _open_shard(path: str) -> int:
    """`os.open(path)` for reading; running out of file descriptors is named as such, with the limit.

    Kernel read-ahead is turned off for the file: reads are whole experts in large pieces already, and read-ahead
    past a piece's end pulls in bytes nobody asked for."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        if err.errno != errno.EMFILE:
            raise
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise OSError(errno.EMFILE, f"cannot open checkpoint shard {path}: too many files are open in this process "
                                    f"(RLIMIT_NOFILE soft limit {soft}, hard limit {hard}); raise the limit "
                                    f"(`ulimit -n`, resource.setrlimit) or call hf_moe_offload.disable(model) on "
                                    f"offloaded models no longer used") from err
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def _close_fds(fds: dict[str, int | None], lock: threading.Lock) -> None:
    with lock:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
        fds.clear()


class CpuStore(ExpertStore):
    """All experts in host memory, one [E, slab] tensor per layer (pinned for fast, asynchronous copies)."""

    def __init__(self, slabs: list[torch.Tensor], layouts: Sequence[SlabLayout], dtype: torch.dtype,
                 memory: HostMemory | None = None, compute_dtype: torch.dtype | None = None,
                 reader: "DiskStore | None" = None):
        """`memory`: the `HostMemory` the slabs come from, released by `close()` (None: ordinary tensors);
        `reader`: the checkpoint the slabs were read from, kept open so that their plain bytes can be handed back
        (`release_plain`) and read from it again."""
        super().__init__(layouts, [s.shape[0] for s in slabs], dtype, compute_dtype)
        self.slabs = slabs
        self.memory = memory if memory is not None else HostMemory(None)
        self.reader = reader
        self._released: set[int] = set()       # layers whose slab pages were handed back

    @classmethod
    def allocate(cls, layouts: Sequence[SlabLayout], num_experts: Sequence[int], dtype: torch.dtype,
                 pin: bool | None = None, device: torch.device | None = None,
                 compute_dtype: torch.dtype | None = None) -> "CpuStore":
        """Uninitialised slabs, pinned for `device` when it is a CUDA device (see `pinning_device`)."""
        memory = HostMemory(pinning_device(pin, device))
        slabs = [memory.empty((n, lay.numel), dtype) for lay, n in zip(layouts, num_experts)]
        return cls(slabs, layouts, dtype, memory, compute_dtype)

    @classmethod
    def build_quantized(cls, read_expert: Callable[[int, int], dict[str, torch.Tensor]],
                        layouts: Sequence[QuantizedSlabLayout], num_experts: Sequence[int],
                        compute_dtype: torch.dtype, pin: bool | None = None, device: torch.device | None = None,
                        desc: str = "Quantizing experts into host memory") -> "CpuStore":
        """Quantize every expert (`read_expert(layer, expert)` -> its dense parts, e.g. `dense_expert` on a
        checkpoint reader) into host slabs, one expert at a time (progress bar over layers).

        Example:
            >>> CpuStore.build_quantized(lambda l, e: dense_expert(reader, l, e), layouts, reader.num_experts,
            ...                          reader.dtype)                                           # doctest: +SKIP
        """
        store = cls.allocate(layouts, num_experts, torch.uint8, pin, device, compute_dtype=compute_dtype)
        try:
            for layer in progress(range(len(store.slabs)), desc=desc, unit="layer"):
                for e in range(store.num_experts[layer]):
                    layouts[layer].quantize_into(read_expert(layer, e), store.slabs[layer][e])
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def from_reader(cls, reader: DiskStore, pin: bool | None = None, device: torch.device | None = None,
                    keep_reader: bool = False) -> "CpuStore":
        """Read every expert from the checkpoint into host memory (progress bar over layers). `keep_reader`: the
        store keeps `reader` open (closed with the store), to hand its slabs back later (`release_plain`)."""
        store = cls.allocate(reader.layouts, reader.num_experts, reader.dtype, pin, device, reader.compute_dtype)
        try:
            for layer in progress(range(len(store.slabs)), desc="Loading experts into host memory", unit="layer"):
                for e in range(store.num_experts[layer]):
                    reader.read_into(layer, e, store.slabs[layer][e])
        except BaseException:
            store.close()
            reader.close()
            raise
        if keep_reader:
            store.reader = reader
        else:
            reader.close()
        return store

    @classmethod
    def from_modules(cls, layers: Sequence[MoELayer], expert_tensors: ExpertTensors, dtype: torch.dtype,
                     pin: bool | None = None, device: torch.device | None = None) -> "CpuStore":
        """Copy the experts of a built model into host slabs; `expert_tensors(module, e)` gives one expert's
        tensors by slab part name (the model family's `MoEArch.expert_tensors`)."""
        store = cls.allocate([lay.layout for lay in layers], [lay.num_experts for lay in layers], dtype, pin,
                             device)
        for lay in layers:
            for e in range(lay.num_experts):
                views = lay.layout.views(store.slabs[lay.index][e])
                for part, tensor in expert_tensors(lay.module, e).items():
                    views[part].copy_(tensor)
        return store

    @property
    def in_host_memory(self) -> bool:
        return True

    @property
    def pinned_bytes(self) -> int:
        return self.memory.pinned_bytes

    def host_slab(self, layer: int, expert: int) -> torch.Tensor:
        return self.slabs[layer][expert]

    @property
    def plain_in_memory(self) -> bool:
        return not self._released

    def release_plain(self, layer: int) -> None:
        """Hand the pages of `layer`'s slabs back to the system: its experts compute from their packed copies only
        (`memory.cpu_kernels`), and their plain bytes are read from the checkpoint again (`read_into`). The slabs'
        addresses stay as the copies' keys; their bytes read as zeros."""
        if self.reader is None:
            raise RuntimeError("CpuStore.release_plain needs the checkpoint's reader (from_reader(keep_reader=True))")
        self._released.add(layer)
        release_pages(self.slabs[layer])

    def read_into(self, layer: int, expert: int, dst: torch.Tensor) -> None:
        if layer in self._released:
            self.reader.read_into(layer, expert, dst)
        else:
            dst[:self.layouts[layer].numel].copy_(self.slabs[layer][expert])

    def release_layer(self, layer: int) -> None:
        self.memory.release(self.slabs[layer])
        self.slabs[layer] = self.slabs[layer].new_empty((0, self.slabs[layer].shape[1]))   # no view: freed

    def close(self) -> None:
        """Unpin the slabs (they stay readable as ordinary memory: `disable()` reads them before closing); close the
        kept reader."""
        self.memory.close()
        if self.reader is not None:
            self.reader.close()


def dense_expert(store: ExpertStore, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """One expert of a dense store as named views (read into a fresh buffer unless it is in host memory)."""
    slab = store.host_slab(layer, expert) if store.plain_in_memory else None
    if slab is None:
        slab = torch.empty(store.layouts[layer].numel, dtype=store.dtype)
        store.read_into(layer, expert, slab)
    return store.layouts[layer].views(slab)


def _wait_all(futures) -> None:
    """Wait for every chunk read, then re-raise the first failure: a read still running after its expert's load
    failed would write into a slot the cache has already given to another expert."""
    futures = list(futures)
    wait(futures)
    for future in futures:
        future.result()
