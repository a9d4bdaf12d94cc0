"""The copy engines and stores on the CPU: failed reads, demand before prefetch, resources released without
close(), running out of file descriptors, buffers built under inference mode, the dtype-conversion bounce buffer.

The CUDA twins of these checks are in tests/test_cuda.py."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from safetensors.torch import save_file

from hf_moe_offload.storage.checkpoint import CheckpointIndex, read_header
from hf_moe_offload.memory.copy_engine import CpuCopyEngine, make_copy_engine
from hf_moe_offload.layout import ExpertPiece, MoELayer, SlabLayout
from hf_moe_offload.storage.store import CpuStore, DiskStore, ExpertStore, HostMemory, pinning_device

NUMEL = 16
LAYOUT = SlabLayout((("w", (NUMEL,)),))


class FlakyStore(ExpertStore):
    """A disk-like store whose slab e holds the value e; the first read of `bad` raises."""

    def __init__(self, bad: int, num_experts: int = 4):
        super().__init__([LAYOUT], [num_experts], torch.float32)
        self.bad, self.failed = bad, False

    def read_into(self, layer, expert, dst):
        if expert == self.bad and not self.failed:
            self.failed = True
            raise OSError(f"read of expert {expert} failed")
        dst[:NUMEL].fill_(float(expert))


class GatedStore(ExpertStore):
    """A disk-like store whose reads wait for `gate`, recording the order in which experts are read."""

    def __init__(self, num_experts: int = 8):
        super().__init__([LAYOUT], [num_experts], torch.float32)
        self.gate, self.started = threading.Event(), threading.Event()
        self.order: list[int] = []

    def read_into(self, layer, expert, dst):
        self.order.append(expert)
        self.started.set()
        assert self.gate.wait(timeout=30)
        dst[:NUMEL].fill_(float(expert))


def _disk_store(folder, num_layers: int = 3, num_experts: int = 4, file_dtype=torch.float32,
                dtype=torch.float32) -> DiskStore:
    """One safetensors file per layer; expert e of layer l holds the value 100 l + e."""
    os.makedirs(folder, exist_ok=True)
    entries = {}
    for layer in range(num_layers):
        values = 100 * layer + torch.arange(num_experts, dtype=torch.float32)[:, None].expand(num_experts, NUMEL)
        path = os.path.join(folder, f"layer-{layer}.safetensors")
        save_file({f"{layer}.w": values.to(file_dtype).contiguous()}, path)
        entries.update(read_header(path))
    index = CheckpointIndex(str(folder), entries)
    layers = [MoELayer(layer, f"layers.{layer}", torch.nn.Identity(), num_experts, 1, LAYOUT)
              for layer in range(num_layers)]
    pieces = [[[ExpertPiece("w", 0, index.locate(f"{layer}.w", row=e))] for e in range(num_experts)]
              for layer in range(num_layers)]
    return DiskStore(layers, pieces, dtype)


def _open_fds(under) -> int:
    """Open file descriptors of this process on files below `under` (other tests' threads may open and close their
    own files meanwhile, so a process-wide count would not be this store's)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(under))
        except OSError:                      # closed between listing and reading
            pass
    return count


# -- failures ---------------------------------------------------------------------------------------------------

def test_a_failed_read_is_raised_by_every_wait_and_the_engine_goes_on():
    """F3 (engine side): the original error from every wait(), done() True without raising, the next load works."""
    store = FlakyStore(bad=2)
    engine = make_copy_engine(store, torch.device("cpu"))
    slot = torch.zeros(NUMEL)
    load = engine.load(0, 2, slot)
    errors = []
    for _ in range(2):
        with pytest.raises(OSError, match="read of expert 2 failed") as caught:
            load.wait()
        errors.append(caught.value)
    assert errors[0] is errors[1]                       # the original exception, not a wrapper
    assert load.done()
    engine.load(0, 2, slot).wait()                      # read again: succeeds
    assert torch.all(slot == 2)
    loads = [engine.load(0, e, torch.zeros(NUMEL)) for e in range(4)]
    for load in loads:                                  # no reader is stuck after the failure
        load.wait()
    engine.close()


# -- priority ---------------------------------------------------------------------------------------------------

def test_demand_loads_overtake_queued_prefetches():
    """F12: a demand load issued after queued prefetch loads is read before them (one reader, held by a gate)."""
    store = GatedStore()
    engine = CpuCopyEngine(store, readers=1)
    slots = [torch.zeros(NUMEL) for _ in range(8)]
    first = engine.load(0, 0, slots[0], demand=False)   # occupies the reader until the gate opens
    assert store.started.wait(timeout=30)
    prefetches = [engine.load(0, e, slots[e], demand=False) for e in (1, 2, 3)]
    demands = [engine.load(0, e, slots[e], demand=True) for e in (4, 5)]
    store.gate.set()
    for load in [first, *prefetches, *demands]:
        load.wait()
    assert store.order == [0, 4, 5, 1, 2, 3]            # demand first, each class in issue order
    assert all(torch.all(slots[e] == e) for e in range(6))
    engine.close()


# -- resources released without close() ------------------------------------------------------------------------

def test_a_disk_store_dropped_without_close_closes_its_files(tmp_path):
    """A model dropped without disable() used to leak one fd per shard: the store's finalizer closes them."""
    gc.collect()                                         # objects of earlier tests close their files now, not below
    before = _open_fds(tmp_path)
    store = _disk_store(tmp_path, num_layers=3)          # (a store opens its files when it is made)
    dst = torch.empty(NUMEL)
    for layer in range(3):
        store.read_into(layer, 1, dst)
        assert torch.all(dst == 100 * layer + 1)
    assert _open_fds(tmp_path) == before + 3
    del store
    gc.collect()
    assert _open_fds(tmp_path) == before


def test_a_closed_disk_store_reopens_its_files_and_still_closes_them_when_dropped(tmp_path):
    gc.collect()
    before = _open_fds(tmp_path)
    store = _disk_store(tmp_path, num_layers=2)
    dst = torch.empty(NUMEL)
    store.read_into(0, 3, dst)
    store.close()
    assert _open_fds(tmp_path) == before
    store.read_into(1, 3, dst)
    assert torch.all(dst == 103) and _open_fds(tmp_path) == before + 1
    del store
    gc.collect()
    assert _open_fds(tmp_path) == before


def test_reader_threads_end_when_the_engine_is_dropped_without_close():
    """An engine (of a model dropped without disable()) must not keep its reader threads alive."""
    before = set(threading.enumerate())
    engine = make_copy_engine(FlakyStore(bad=-1), torch.device("cpu"))
    for e in range(4):
        engine.load(0, e, torch.zeros(NUMEL)).wait()
    readers = [t for t in threading.enumerate() if t not in before and t.name.startswith("hf_moe_offload_copy")]
    assert readers
    del engine
    gc.collect()
    for thread in readers:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in readers)


EMFILE_PROBE = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, sys.argv[2])
    from test_copy_engine import _disk_store
    store = _disk_store(sys.argv[1], num_layers=1)
    store.close()                      # its files open again at the read below, with no descriptor left
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(open("/dev/null"))
    except OSError:
        pass
    import torch
    try:
        store.read_into(0, 0, torch.empty(16))
    except OSError as err:
        print(type(err).__name__, err.errno, err)
""")


def test_running_out_of_file_descriptors_is_named_with_the_limit(tmp_path):
    """EMFILE: the message says too many files are open and gives RLIMIT_NOFILE (not a misleading error)."""
    _disk_store(tmp_path, num_layers=1)                 # written here; the subprocess builds its own store on it
    out = subprocess.run([sys.executable, "-c", EMFILE_PROBE, str(tmp_path), os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=600)   # a hang guard: slow to start when busy
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("OSError 24 ")
    assert "too many files are open" in line and "soft limit 64" in line and "layer-0.safetensors" in line


# -- inference mode, dtype conversion, pinning arguments ---------------------------------------------------------

def test_buffers_built_under_inference_mode_are_written_outside_it(tmp_path):
    """F2: a store and buffers made under torch.inference_mode() are ordinary tensors that reader threads (not in
    inference mode) and later in-place updates can write."""
    disk = _disk_store(tmp_path, num_layers=2)
    with torch.inference_mode():
        store = CpuStore.from_reader(_disk_store(tmp_path, num_layers=2))
        buffer = HostMemory(None).empty((NUMEL,), torch.float32)
    assert not buffer.is_inference() and not any(slab.is_inference() for slab in store.slabs)
    engine = make_copy_engine(disk, torch.device("cpu"))
    engine.load(1, 2, buffer).wait()                    # written by a reader thread
    engine.load(0, 3, store.slabs[0][1]).wait()
    engine.close()
    assert torch.all(buffer == 102) and torch.all(store.host_slab(0, 1) == 3)
    store.slabs[1].add_(1)                              # outside inference mode, in place
    assert torch.all(store.host_slab(1, 0) == 101)


def test_dtype_conversion_reuses_one_bounce_buffer_per_thread(tmp_path):
    """F14: reads that convert dtype (float32 file, float16 store) go through one reused buffer per thread."""
    store = _disk_store(tmp_path, num_layers=2, file_dtype=torch.float32, dtype=torch.float16)
    dst = torch.empty(NUMEL, dtype=torch.float16)
    store.read_into(0, 1, dst)
    bounce = store._bounce.buffer.data_ptr()
    for layer, expert in ((0, 2), (1, 3)):
        store.read_into(layer, expert, dst)
        assert torch.all(dst == 100 * layer + expert)
    assert store._bounce.buffer.data_ptr() == bounce
    seen = []
    reader = threading.Thread(target=lambda: (store.read_into(1, 0, dst), seen.append(store._bounce.buffer)))
    reader.start()
    reader.join()
    assert seen[0].data_ptr() != bounce                 # another thread, its own buffer
    assert torch.all(dst == 100)


def test_host_memory_without_a_device_pins_nothing():
    """F1 on the CPU: no device, no pinning; `pinned_bytes` is what tests/test_cuda.py checks against the slabs."""
    store = CpuStore.allocate([LAYOUT], [4], torch.float32, device=torch.device("cpu"))
    assert store.pinned_bytes == 0 and store.in_host_memory
    assert pinning_device(None, None) is None
    with pytest.raises(ValueError, match="pinned host memory needs a CUDA device"):
        pinning_device(True, torch.device("cpu"))
    store.close()


def test_read_clock_counts_overlapping_reads_once():
    """The disk's busy time: two reads in flight together count their union, not their sum."""
    import threading
    import time

    from hf_moe_offload.memory.copy_engine import ReadClock

    clock = ReadClock()
    inside = threading.Barrier(2)

    def read():
        with clock.reading(100):
            inside.wait()
            time.sleep(0.05)

    threads = [threading.Thread(target=read) for _ in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    busy, nbytes = clock.snapshot()
    assert nbytes == 200
    assert 0.05 <= busy <= wall          # the union of two overlapping 50 ms reads, not 100 ms
