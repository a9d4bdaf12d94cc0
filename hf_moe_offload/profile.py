"""The machine profile the planner predicts with: measured once (`measure()`), cached as JSON, or given as a file
for another machine (the shipped `profiles/t4.json`, `profiles/l4.json`).

Every number is what this package's own work sees, not a datasheet peak where it can be measured:
- disk: `os.pread` of expert-sized pieces from several threads, cold (a temporary file, `posix_fadvise DONTNEED`),
  as `DiskStore` reads;
- host memcpy: a large tensor `copy_`;
- CPU matmul FLOP/s in bf16 and fp32 at batch 1 (bound by reading the weight) and at a large batch (bound by
  arithmetic): the planner times a matmul of n rows as max(2W/F_1, 2nW/F_large);
- with CUDA: host-to-device from pinned memory, device matmul FLOP/s, device memory.

Example:
    >>> p = MachineProfile.from_dict(json.loads(shipped_profile_path("t4").read_text()))
    >>> p.device_memory_bytes // (1 << 30)
    16
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from ._logging import progress

logger = logging.getLogger(__name__)

PROFILE_VERSION = 1
PROFILE_FILE = "profile.json"
SHIPPED_PROFILES = ("t4", "l4")

# Fields that must be present and > 0; the device group is either all null (no GPU) or all > 0.
_HOST_FIELDS = ("disk_read_bytes_per_s", "host_memcpy_bytes_per_s", "cpu_flops_bf16_batch1", "cpu_flops_bf16_large",
                "cpu_flops_fp32_batch1", "cpu_flops_fp32_large", "cpu_threads", "host_memory_bytes")
_DEVICE_FIELDS = ("h2d_bytes_per_s", "device_flops", "device_memory_bytes", "device_memory_bytes_per_s")


class ProfileError(ValueError):
    """A profile file that is missing, malformed, of another version, or has a field out of range."""


@dataclass(frozen=True)
class MachineProfile:
    """Measured speeds of one machine (bytes/s, FLOP/s, bytes).

    Example:
        >>> p = MachineProfile(name="x", source="test", disk_read_bytes_per_s=2e9, host_memcpy_bytes_per_s=1e10,
        ...                    cpu_flops_bf16_batch1=5e9, cpu_flops_bf16_large=1e11, cpu_flops_fp32_batch1=5e9,
        ...                    cpu_flops_fp32_large=1e11, cpu_threads=2, host_memory_bytes=1 << 34)
        >>> p.has_device, MachineProfile.from_dict(p.to_dict()) == p
        (False, True)
    """

    name: str
    source: str                      # how the numbers were obtained (measured here, or the paper/datasheet)
    disk_read_bytes_per_s: float
    host_memcpy_bytes_per_s: float
    cpu_flops_bf16_batch1: float
    cpu_flops_bf16_large: float
    cpu_flops_fp32_batch1: float
    cpu_flops_fp32_large: float
    cpu_threads: int
    host_memory_bytes: int
    h2d_bytes_per_s: float | None = None       # pinned host -> device
    device_flops: float | None = None          # half precision matmul
    device_memory_bytes: int | None = None
    device_memory_bytes_per_s: float | None = None
    device_name: str | None = None
    # Framework time per layer and pass that no FLOP or byte count explains (Python, module dispatch, kernel
    # launches): measured on the demo model, whose layers are too small to cost anything else. None: not measured.
    layer_overhead_s: float | None = None
    version: int = PROFILE_VERSION

    @property
    def has_device(self) -> bool:
        """Whether the profile describes an accelerator (the device fields are set)."""
        return self.h2d_bytes_per_s is not None

    def cpu_flops(self, dtype_bytes: int) -> tuple[float, float]:
        """(batch-1, large-batch) CPU matmul FLOP/s for a dtype of `dtype_bytes` (2: bf16, else fp32)."""
        if dtype_bytes == 2:
            return self.cpu_flops_bf16_batch1, self.cpu_flops_bf16_large
        return self.cpu_flops_fp32_batch1, self.cpu_flops_fp32_large

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> "MachineProfile":
        """Validate and build; every error names the field and what is allowed."""
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - {"notes"})
        if unknown:
            raise ProfileError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(known)}")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{where}: field 'version' is {data.get('version')!r}; this hf_moe_offload reads "
                               f"version {PROFILE_VERSION} (re-run `hf-moe-offload profile`)")
        for name in ("name", "source"):
            if not isinstance(data.get(name), str):
                raise ProfileError(f"{where}: field {name!r} must be a string, got {data.get(name)!r}")
        for name in _HOST_FIELDS:
            if name not in data:
                raise ProfileError(f"{where}: missing field {name!r} (a number > 0)")
            _positive(where, name, data[name])
        given = [n for n in _DEVICE_FIELDS if data.get(n) is not None]
        if given and len(given) != len(_DEVICE_FIELDS):
            missing = [n for n in _DEVICE_FIELDS if n not in given]
            raise ProfileError(f"{where}: device field(s) {missing} missing; give all of {list(_DEVICE_FIELDS)} "
                               f"(an accelerator) or none (CPU only)")
        for name in given:
            _positive(where, name, data[name])
        if data.get("layer_overhead_s") is not None:
            _positive(where, "layer_overhead_s", data["layer_overhead_s"])
        values = {k: v for k, v in data.items() if k in known}
        for name in ("cpu_threads", "host_memory_bytes", "device_memory_bytes"):
            if values.get(name) is not None:
                values[name] = int(values[name])
        return cls(**values)

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the profile as JSON (default: `default_profile_path()`); returns the path."""
        path = Path(path) if path is not None else default_profile_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)   # a reader never sees half a file
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "MachineProfile":
        """Read and validate a profile file (this machine's, or another's such as the shipped `t4`/`l4`).

        Example:
            >>> MachineProfile.load(shipped_profile_path("l4")).name
            'L4'
        """
        path = Path(path)
        if not path.is_file():
            raise ProfileError(f"profile file {str(path)!r} does not exist; run `hf-moe-offload profile` or give "
                               f"one of the shipped profiles {list(SHIPPED_PROFILES)}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ProfileError(f"profile file {str(path)!r} is not valid JSON: {err}") from None
        return cls.from_dict(data, where=f"profile file {str(path)!r}")

    def summary(self) -> str:
        """One line per number, for `hf-moe-offload profile --show`."""
        lines = [f"{self.name} ({self.source})",
                 f"  disk read {self.disk_read_bytes_per_s / 1e9:.2f} GB/s, host memcpy "
                 f"{self.host_memcpy_bytes_per_s / 1e9:.2f} GB/s, host memory {self.host_memory_bytes / 2**30:.1f} GiB",
                 f"  CPU ({self.cpu_threads} threads) matmul bf16 {self.cpu_flops_bf16_batch1 / 1e9:.1f} / "
                 f"{self.cpu_flops_bf16_large / 1e9:.1f} GFLOP/s, fp32 {self.cpu_flops_fp32_batch1 / 1e9:.1f} / "
                 f"{self.cpu_flops_fp32_large / 1e9:.1f} GFLOP/s (batch 1 / large batch)"]
        if self.has_device:
            lines.append(f"  device {self.device_name}: host-to-device {self.h2d_bytes_per_s / 1e9:.1f} GB/s, "
                         f"{self.device_flops / 1e12:.1f} TFLOP/s, memory {self.device_memory_bytes / 2**30:.1f} GiB "
                         f"at {self.device_memory_bytes_per_s / 1e9:.0f} GB/s")
        return "\n".join(lines)


def _positive(where: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ProfileError(f"{where}: field {name!r} must be a number > 0, got {value!r}")


def default_profile_path() -> Path:
    """`$HF_MOE_OFFLOAD_CACHE/profile.json`, else `~/.cache/hf_moe_offload/profile.json`."""
    root = os.environ.get("HF_MOE_OFFLOAD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_moe_offload")
    return Path(root) / PROFILE_FILE


def shipped_profile_path(name: str) -> Path:
    """Path of a profile shipped with the package (`"t4"`, `"l4"`; MoE-Lightning's settings)."""
    if name not in SHIPPED_PROFILES:
        raise ProfileError(f"no shipped profile {name!r}; shipped: {list(SHIPPED_PROFILES)}")
    return Path(__file__).parent / "profiles" / f"{name}.json"


def load_profile(spec: str | os.PathLike | None = None) -> MachineProfile:
    """A profile from a file, a shipped name ("t4", "l4"), or (None) this machine's cached one.

    Example:
        >>> load_profile("t4").h2d_bytes_per_s / 1e9
        12.0
    """
    if spec is None:
        return MachineProfile.load(default_profile_path())
    if str(spec) in SHIPPED_PROFILES:
        return MachineProfile.load(shipped_profile_path(str(spec)))
    return MachineProfile.load(spec)


# ----------------------------------------------------------------------------------------------------- measuring

def measure(disk_piece_bytes: int = 16 << 20, disk_pieces: int = 16, disk_threads: int = 4,
            memcpy_bytes: int = 256 << 20, matmul_hidden: int = 2048, matmul_large_rows: int = 256,
            seconds_per_kernel: float = 0.25, device: str | None = None, name: str | None = None,
            overhead: bool = True) -> MachineProfile:
    """Measure this machine (a few seconds at the defaults) with torch's current thread count.

    Example (tiny sizes, as the tests run it):
        >>> p = measure(disk_piece_bytes=1 << 16, disk_pieces=4, memcpy_bytes=1 << 20, matmul_hidden=64,
        ...             matmul_large_rows=8, seconds_per_kernel=0.001, device="cpu")
        >>> p.disk_read_bytes_per_s > 0 and not p.has_device
        True
    """
    for arg, value in (("disk_piece_bytes", disk_piece_bytes), ("disk_pieces", disk_pieces),
                       ("disk_threads", disk_threads), ("memcpy_bytes", memcpy_bytes),
                       ("matmul_hidden", matmul_hidden), ("matmul_large_rows", matmul_large_rows)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"measure: {arg} must be an int >= 1, got {value!r}")
    use_cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    steps = ["disk", "memcpy", "cpu matmul"] + (["device"] if use_cuda else []) + (["overhead"] if overhead else [])
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
        if use_cuda:
            dev = torch.device(device or "cuda:0")
            values.update(_device_numbers(dev, memcpy_bytes, matmul_hidden, seconds_per_kernel))
            bar.update(1)
        if overhead:
            values["layer_overhead_s"] = _layer_overhead("cuda:0" if use_cuda else "cpu", seconds_per_kernel)
            bar.update(1)
    finally:
        bar.close()
    host = name or platform.node() or "this machine"
    profile = MachineProfile(name=host, source=f"measured by hf_moe_offload.profile.measure() on {time.strftime('%Y-%m-%d')}",
                             cpu_threads=torch.get_num_threads(), host_memory_bytes=psutil.virtual_memory().total,
                             **values)
    logger.info("hf_moe_offload profile: %s", profile.summary().replace("\n", ";"))
    return profile


def best_rate(work: float, run, seconds: float, min_runs: int = 3) -> float:
    """Work per second of the fastest of several runs (others' load only slows a run down): at least `min_runs`,
    and more until `seconds` have passed (`seconds=0`: exactly `min_runs`)."""
    best = math.inf
    start = time.perf_counter()
    runs = 0
    while runs < min_runs or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
        runs += 1
        if runs >= 1000:
            break
    return work / max(best, 1e-9)


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


def _layer_overhead(device: str, seconds: float) -> float:
    """Seconds per MoE layer of a one-token decode step of the offloaded demo model with every expert cached: its
    layers are so small that the time is the framework's (Python, dispatch, the engine's bookkeeping)."""
    import warnings

    from . import from_pretrained
    from .demo import DEMO_MODEL
    from .engine import get_engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_pretrained(DEMO_MODEL, {"device": device, "store": "disk", "expert_cache": "100%"})
    try:
        layers = len(get_engine(model).layers)
        ids = torch.tensor([[5, 6, 7, 8]], device=device)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        with torch.no_grad():
            out = model(ids, use_cache=True)
            nxt, cache = out.logits[:, -1:].argmax(-1), out.past_key_values

            def step() -> None:
                model(nxt, past_key_values=cache, use_cache=True)   # grows by a token a step: harmless
                sync()

            for _ in range(3):   # warm-up: every expert read into the cache once
                step()
            steps_per_s = best_rate(1.0, step, seconds, min_runs=5)
        return 1.0 / steps_per_s / layers
    finally:
        from . import disable
        disable(model)


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
    del pinned, on_dev, other
    return {"h2d_bytes_per_s": h2d_rate, "device_flops": flops, "device_memory_bytes_per_s": mem_rate,
            "device_memory_bytes": torch.cuda.get_device_properties(dev).total_memory,
            "device_name": torch.cuda.get_device_name(dev)}
