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

import psutil
import torch

from .._logging import progress
from .._timing import best_rate
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
    steps = (["disk", "memcpy", "cpu matmul", "cpu expert and elementwise"] + (["device"] if use_cuda else [])
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
                             cpu_threads=torch.get_num_threads(), host_memory_bytes=psutil.virtual_memory().total,
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
                  seconds: float) -> dict[str, float]:
    """FLOP/s of the engine's expert loop body (`execute.offloaded_experts_forward`: gather the rows, gate_up,
    SiLU x up, down, scale by the routing weight, scatter) on an expert of Mixtral's proportions (intermediate =
    3.5 x hidden), per row count. Few rows read the weights once per call: several experts are rotated through
    `cold_bytes`, more than a last-level cache, so they come from DRAM as in a decode step over the whole model."""
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

        def run() -> None:
            for gate_up, down in experts:
                x = states[picked // k]
                gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
                y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down)
                out[picked] = y * weights[picked, None]

        run()   # warm-up
        curve[str(rows)] = best_rate(2.0 * 3 * rows * hidden * inter * count, run, seconds)
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
