"""Measuring this machine for its `MachineProfile`: every number is what this package's own work sees (see
`profile`), timed with the best of several runs (`_timing.best_rate`). `hf-moe-offload profile` runs it.

Example (tiny sizes, as the tests run it):
    >>> p = measure(disk_piece_bytes=1 << 16, disk_pieces=4, memcpy_bytes=1 << 20, matmul_hidden=64,
    ...             matmul_large_rows=8, seconds_per_kernel=0.001, device="cpu")
    >>> p.disk_read_bytes_per_s > 0 and not p.has_device
    True
"""

from __future__ import annotations

import logging
import math
import os
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from .._logging import progress
from .._timing import best_rate
from ..memory import cpu_kernels
from ..memory.cpu_kernels import PrepackedWeights, prepack_supported
from ..storage.quantize import to_cpu_int4
from .footprint import host_memory_bytes
from .profile import EXPERT_CURVE_ROWS, MachineProfile

logger = logging.getLogger(__name__)

# (device, seconds) -> (seconds per MoE layer, seconds per generate step outside the layers)
LayerOverhead = Callable[[str, float], tuple[float, float]]


def measure(disk_piece_bytes: int = 16 << 20, disk_pieces: int = 16, disk_threads: int = 4,
            memcpy_bytes: int = 256 << 20, matmul_hidden: int = 2048, matmul_large_rows: int = 256,
            seconds_per_kernel: float = 0.25, device: str | None = None, name: str | None = None,
            layer_overhead: LayerOverhead | None = None, expert_hidden: int = 1024,
            expert_rows: tuple[int, ...] = EXPERT_CURVE_ROWS,
            cold_bytes: int = 256 << 20) -> MachineProfile:
    """Measure this machine with torch's current thread count. `layer_overhead(device, seconds)`, when given,
    times the framework's share of a decode step on a real offloaded model (the CLI passes the demo model's,
    `hf_moe_offload.demo.layer_overhead`); without it those optional fields stay unset.

    Example (tiny sizes, as the tests run it):
        >>> p = measure(disk_piece_bytes=1 << 16, disk_pieces=4, memcpy_bytes=1 << 20, matmul_hidden=64,
        ...             matmul_large_rows=8, seconds_per_kernel=0.001, device="cpu")
        >>> p.disk_read_bytes_per_s > 0 and not p.has_device
        True
    """
    for arg, value in (("disk_piece_bytes", disk_piece_bytes), ("disk_pieces", disk_pieces),
                       ("disk_threads", disk_threads), ("memcpy_bytes", memcpy_bytes),
                       ("matmul_hidden", matmul_hidden), ("matmul_large_rows", matmul_large_rows),
                       ("expert_hidden", expert_hidden), ("cold_bytes", cold_bytes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"measure: {arg} must be an int >= 1, got {value!r}")
    use_cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    if not expert_rows or any(not isinstance(r, int) or r < 1 for r in expert_rows):
        raise ValueError(f"measure: expert_rows must be row counts >= 1, got {expert_rows!r}")
    steps = (["disk", "memcpy", "cpu matmul", "cpu expert and elementwise", "weight reads"]
             + (["device"] if use_cuda else [])
             + (["overhead"] if layer_overhead is not None else []))
    values: dict[str, Any] = {}
    bar = progress(total=len(steps), desc="profiling this machine")
    try:
        values["disk_read_bytes_per_s"] = _disk_bandwidth(disk_piece_bytes, disk_pieces, disk_threads)
        bar.update(1)
        values["host_memcpy_bytes_per_s"] = _memcpy_bandwidth(memcpy_bytes, seconds_per_kernel)
        bar.update(1)
        for dtype, key in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            for rows, size in ((1, "batch1"), (matmul_large_rows, "large")):
                values[f"cpu_flops_{key}_{size}"] = _matmul_flops(rows, matmul_hidden, dtype, "cpu",
                                                                  seconds_per_kernel)
        bar.update(1)
        for dtype, key in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            values[f"cpu_expert_flops_{key}"] = _expert_curve(expert_hidden, dtype, expert_rows, cold_bytes,
                                                              seconds_per_kernel / 2)
            values[f"cpu_elementwise_{key}_per_s"] = _elementwise_rate(dtype, seconds_per_kernel / 2)
        if prepack_supported(torch.bfloat16):
            values["cpu_expert_flops_bf16_packed"] = _expert_curve(expert_hidden, torch.bfloat16, expert_rows,
                                                                   cold_bytes, seconds_per_kernel / 2, packed=True)
        bar.update(1)
        values["weight_read_bytes_per_s"] = weight_read_rates(cold_bytes, expert_hidden, seconds_per_kernel)
        bar.update(1)
        if use_cuda:
            dev = torch.device(device or "cuda:0")
            values.update(_device_numbers(dev, memcpy_bytes, matmul_hidden, seconds_per_kernel))
            bar.update(1)
        if layer_overhead is not None:
            values["layer_overhead_s"], values["step_overhead_s"] = layer_overhead(
                "cuda:0" if use_cuda else "cpu", seconds_per_kernel)
            bar.update(1)
    finally:
        bar.close()
    host = name or platform.node() or "this machine"
    load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs" if hasattr(os, "getloadavg") else ""
    profile = MachineProfile(name=host, source=f"measured by hf_moe_offload.planning.measure.measure() on "
                                                    f"{time.strftime('%Y-%m-%d')}{load}",
                             cpu_threads=torch.get_num_threads(), host_memory_bytes=host_memory_bytes(),
                             **values)
    logger.info("hf_moe_offload profile: %s", profile.summary().replace("\n", ";"))
    return profile


BUSY_LOAD_SHARE = 0.5   # a 1-minute load average above this share of the CPUs: other work takes the cores


def busy_machine(after_measuring: bool = False, load: float | None = None, cpus: int | None = None) -> str | None:
    """A sentence saying that the machine is busy, or None. Busy: the 1-minute load average is above half the CPU
    count; `after_measuring` first takes away the measurement's own threads (torch's thread count). None also when
    the system gives no load average. `load` and `cpus` replace the system's numbers (tests).

    Example:
        >>> busy_machine(load=7.5, cpus=8)
        'the machine is busy (load average 7.5 over the last minute on 8 CPUs)'
        >>> busy_machine(load=1.0, cpus=8) is None
        True
    """
    cpus = cpus or os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):   # no load average on this system (Windows)
            return None
    others = load - (min(torch.get_num_threads(), cpus) if after_measuring else 0)
    if others <= BUSY_LOAD_SHARE * cpus:
        return None
    return f"the machine is busy (load average {load:.1f} over the last minute on {cpus} CPUs)"


def format_duration(seconds: float) -> str:
    """A duration as people read it.

    Example:
        >>> format_duration(103.4), format_duration(7.26), format_duration(3 * 86400 + 7200)
        ('1m43s', '7.3 s', '3 days')
    """
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


def _disk_bandwidth(piece: int, pieces: int, threads: int) -> float:
    """Cold `pread`s of expert-sized pieces from `threads` threads, the way `DiskStore` reads experts."""
    directory = os.environ.get("HF_MOE_OFFLOAD_CACHE") or None
    if directory:
        os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="hfmo_profile_", suffix=".bin") as f:
        block = os.urandom(min(piece, 1 << 20))
        for _ in range(math.ceil(piece * pieces / len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        fd = f.fileno()
        if hasattr(os, "posix_fadvise"):   # drop the file from the page cache: the read is cold, as after loading
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buffers = [bytearray(piece) for _ in range(threads)]

        def read(i: int) -> None:
            view = memoryview(buffers[i % threads])
            done = 0
            while done < piece:
                done += os.preadv(fd, [view[done:]], i * piece + done) if hasattr(os, "preadv") else \
                    _pread_into(fd, view[done:], i * piece + done)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(pieces)))
        return piece * pieces / max(time.perf_counter() - t0, 1e-9)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[:len(data)] = data
    return len(data)


def _memcpy_bandwidth(nbytes: int, seconds: float) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return best_rate(2 * src.nbytes, lambda: dst.copy_(src), seconds)   # read + write, as STREAM counts copy


def _matmul_flops(rows: int, hidden: int, dtype: torch.dtype, device: str, seconds: float) -> float:
    """FLOP/s of [rows, hidden] x [hidden, 4 hidden] (an expert's shape: intermediate about 3.5-4x hidden)."""
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    w = torch.randn(4 * hidden, hidden, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run() -> None:
        torch.nn.functional.linear(x, w)
        sync()

    run()   # warm-up: first-call kernel selection
    return best_rate(2.0 * rows * hidden * 4 * hidden, run, seconds)


def _expert_curve(hidden: int, dtype: torch.dtype, rows_list: tuple[int, ...], cold_bytes: int,
                  seconds: float, packed: bool = False) -> dict[str, float]:
    """FLOP/s of the engine's expert loop body (`execute.offloaded_experts_forward`: gather the rows, gate_up,
    SiLU x up, down, scale by the routing weight, scatter) on an expert of Mixtral's proportions (intermediate =
    3.5 x hidden), per row count. Few rows read the weights once per call: several experts are rotated through
    `cold_bytes`, more than a last-level cache, so they come from DRAM as in a decode step over the whole model.
    `packed`: the products through prepacked oneDNN copies (`cpu_kernels.linear`), as a CPU store's experts run."""
    inter = hidden * 7 // 2
    expert_bytes = 3 * hidden * inter * dtype.itemsize
    gen = torch.Generator().manual_seed(0)
    curve = {}
    for rows in rows_list:
        # Many rows reuse each weight enough that its first read does not matter: one expert is enough there.
        count = max(1, math.ceil(cold_bytes / expert_bytes)) if rows < 64 else 1
        experts = [(torch.randn(2 * inter, hidden, generator=gen, dtype=dtype),
                    torch.randn(hidden, inter, generator=gen, dtype=dtype)) for _ in range(count)]
        k = 2
        states = torch.randn(rows * k, hidden, dtype=dtype)                # the layer's input, T = rows x k
        picked = torch.randperm(rows * k, generator=gen)[:rows]            # this expert's (token, slot) rows
        weights = torch.rand(rows * k, dtype=dtype)
        out = torch.empty(rows * k, hidden, dtype=dtype)
        registration = PrepackedWeights([w for pair in experts for w in pair],
                                        budget_bytes=2 * expert_bytes * count) if packed else None
        linear = cpu_kernels.linear if packed else torch.nn.functional.linear

        def run() -> None:
            for gate_up, down in experts:
                x = states[picked // k]
                gate, up = linear(x, gate_up).chunk(2, dim=-1)
                y = linear(torch.nn.functional.silu(gate) * up, down)
                out[picked] = y * weights[picked, None]

        try:
            run()   # warm-up (and the packed copies)
            curve[str(rows)] = best_rate(2.0 * 3 * rows * hidden * inter * count, run, seconds)
        finally:
            if registration is not None:
                registration.close()
        experts.clear()   # free these weights before the next row count's are allocated
    return curve


def _elementwise_rate(dtype: torch.dtype, seconds: float, numel: int = 1 << 21) -> float:
    """Element operations per second of SiLU(a) x b (two operations per element), as an activation takes them."""
    a = torch.randn(numel, dtype=dtype)
    b = torch.randn(numel, dtype=dtype)
    return best_rate(2.0 * numel, lambda: torch.nn.functional.silu(a) * b, seconds)


def _device_numbers(dev: torch.device, nbytes: int, hidden: int, seconds: float) -> dict[str, Any]:
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    on_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    other = torch.empty_like(on_dev)

    def h2d() -> None:
        on_dev.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(dev)

    def d2d() -> None:
        other.copy_(on_dev)
        torch.cuda.synchronize(dev)

    h2d_rate = best_rate(nbytes, h2d, seconds)
    mem_rate = best_rate(2 * nbytes, d2d, seconds)
    flops = _matmul_flops(max(4096, hidden), 4 * hidden, torch.bfloat16, str(dev), seconds)
    return {"h2d_bytes_per_s": h2d_rate, "device_flops": flops, "device_memory_bytes_per_s": mem_rate,
            "device_memory_bytes": torch.cuda.get_device_properties(dev).total_memory,
            "device_name": torch.cuda.get_device_name(dev)}


def weight_read_rates(nbytes: int = 256 << 20, hidden: int = 1024, seconds: float = 0.25,
                      threads: tuple[int, ...] | None = None) -> dict[str, float]:
    """Bytes of weights per second this machine reads, the bound of a batch-1 decode step on the CPU: a streaming
    read of a large tensor (`stream`), and one-row matrix-vector products through the kernels the engine uses
    (`bf16`: prepacked oneDNN, `memory.cpu_kernels`; `int8`, `int4`: torch's CPU kernels, group 64), on weights
    rotated through `nbytes` (more than a last-level cache: cold, as a decode step walks the model). Keys are
    `<kind>_<threads>t`, at 1 and at torch's current thread count by default.

    Example:
        >>> r = weight_read_rates(nbytes=1 << 20, hidden=64, seconds=0, threads=(1,))
        >>> sorted(r) == ['bf16_1t', 'int4_1t', 'int8_1t', 'stream_1t'] and min(r.values()) > 0
        True
    """
    threads = threads or tuple(sorted({1, torch.get_num_threads()}))
    before = torch.get_num_threads()
    kernels, packed = _gemv_kernels(nbytes, hidden)
    stream = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    rates: dict[str, float] = {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            rates[f"stream_{n}t"] = best_rate(stream.nbytes, stream.sum, seconds)
            for kind, (run, read) in kernels.items():
                run()   # warm-up: kernel selection, the packed copies
                rates[f"{kind}_{n}t"] = best_rate(read, run, seconds)
    finally:
        torch.set_num_threads(before)
        if packed is not None:
            packed.close()
    return rates


def _gemv_kernels(nbytes: int, hidden: int
                  ) -> tuple[dict[str, tuple[Callable[[], None], int]], PrepackedWeights | None]:
    """{kind: (one row through every weight of `nbytes`, bytes it reads)} for [4 hidden, hidden] weights, and the
    registration of the bf16 weights for prepacking (to close when done; None where oneDNN has no bf16)."""
    n, k = 4 * hidden, hidden
    x = torch.randn(1, k, dtype=torch.bfloat16)
    count = max(1, nbytes // (n * k * 2))
    slab = torch.randn(count, n * k).to(torch.bfloat16)
    packed = PrepackedWeights([slab], budget_bytes=slab.numel() * 2) if prepack_supported(torch.bfloat16) else None
    q8 = torch.randint(-127, 128, (max(1, nbytes // (n * k)), n, k), dtype=torch.int8)
    s8 = torch.rand(n, dtype=torch.bfloat16)
    q4 = [to_cpu_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8)) for _ in range(max(1, 2 * nbytes // (n * k)))]
    group = min(64, k)
    sz4 = torch.rand(k // group, n, 2, dtype=torch.bfloat16)

    def bf16() -> None:
        for i in range(count):
            cpu_kernels.linear(x, slab[i].view(n, k))

    def int8() -> None:
        for w in q8:
            torch._weight_int8pack_mm(x, w, s8)

    def int4() -> None:
        for w in q4:
            torch._weight_int4pack_mm_for_cpu(x, w, group, sz4)

    kernels = {"bf16": (bf16, slab.numel() * 2), "int8": (int8, q8.numel()),
               "int4": (int4, sum(w.numel() for w in q4))}
    return kernels, packed
