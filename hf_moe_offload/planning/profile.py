"""The machine profile the planner predicts with: measured once (`planning.measure`), cached as JSON, or given as a file
for another machine (the shipped `profiles/t4.json`, `profiles/l4.json`).

Every number is what this package's own work sees, not a datasheet peak where it can be measured:
- disk: `os.pread` of expert-sized pieces from several threads, cold (a temporary file, `posix_fadvise DONTNEED`),
  as `DiskStore` reads;
- host memcpy: a large tensor `copy_`;
- CPU matmul FLOP/s in bf16 and fp32 at batch 1 (bound by reading the weight) and at a large batch (bound by
  arithmetic): the planner times a matmul of n rows as max(2W/F_1, 2nW/F_large);
- with CUDA: host-to-device from pinned memory, device matmul FLOP/s, device memory;
- what a matmul's FLOP/s misses (optional fields, older files load without them): the engine's whole expert forward
  (gather, gate_up, SiLU x up, down, scatter) at several row counts with weights cold in the caches, the elementwise
  rate (norms, RoPE, residuals), and the framework's time per layer and per `generate` step on the demo model;
- the memory-bandwidth bound of a batch-1 decode step (optional): bytes of weights per second read by a streaming
  read and by one-row bf16/int8/int4 matrix-vector products, at 1 and all threads (`measure.weight_read_rates`).

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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..storage.folders import write_json

logger = logging.getLogger(__name__)

PROFILE_VERSION = 1
PROFILE_FILE = "profile.json"
SHIPPED_PROFILES = ("t4", "l4")

# Fields that must be present and > 0; the device group is either all null (no GPU) or all > 0.
_HOST_FIELDS = ("disk_read_bytes_per_s", "host_memcpy_bytes_per_s", "cpu_flops_bf16_batch1", "cpu_flops_bf16_large",
                "cpu_flops_fp32_batch1", "cpu_flops_fp32_large", "cpu_threads", "host_memory_bytes")
_DEVICE_FIELDS = ("h2d_bytes_per_s", "device_flops", "device_memory_bytes", "device_memory_bytes_per_s")
# Optional (null or absent in older files): numbers > 0, and {rows: FLOP/s} curves.
_OPTIONAL_FIELDS = ("layer_overhead_s", "cpu_elementwise_bf16_per_s", "cpu_elementwise_fp32_per_s",
                    "step_overhead_s")
_CURVE_FIELDS = ("cpu_expert_flops_bf16", "cpu_expert_flops_fp32", "cpu_expert_flops_bf16_packed")
EXPERT_CURVE_ROWS = (1, 4, 16, 64, 256, 1024)   # row counts the expert curve is measured at


class ProfileError(ValueError):
    """A profile file that is missing, malformed, of another version, or has a field out of range."""


class ProfileMissingError(ProfileError):
    """No profile file where one was looked for (not measured yet, rather than damaged)."""


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
    # Optional (older files lack them; the planner then falls back to the two-point matmul roofline):
    # FLOP/s of the engine's whole expert forward on the CPU (gather the rows, gate_up, SiLU x up, down, scale,
    # scatter: `execute.offloaded_experts_forward`'s loop body) per row count, with weights cold in the caches
    # (rotated through more bytes than the last-level cache, as a decode step walks the model's weights).
    # JSON: {"rows": FLOP/s}; the planner interpolates in log-log between the measured row counts.
    cpu_expert_flops_bf16: dict[str, float] | None = None
    cpu_expert_flops_fp32: dict[str, float] | None = None
    # The same loop body through the prepacked oneDNN kernel (`memory.cpu_kernels`), as a CPU store's experts and
    # the model's own bf16 layers compute on the CPU; absent where oneDNN has no bf16 (and in older files).
    cpu_expert_flops_bf16_packed: dict[str, float] | None = None
    # Element operations per second of SiLU(a) x b (what norms, RoPE, residual adds and the sum over top-k cost
    # per element), per dtype.
    cpu_elementwise_bf16_per_s: float | None = None
    cpu_elementwise_fp32_per_s: float | None = None
    # Seconds per decode step of `generate` outside the model's layers (logits processing, argmax, input and
    # cache bookkeeping), measured on the demo model: its step time less its layers' overhead.
    step_overhead_s: float | None = None
    # Weight bytes per second a batch-1 decode step can read (its bound): {"stream_1t": ..., "bf16_2t": ...}, the
    # kind of read (a streaming read; bf16, int8, int4 one-row matrix-vector products) and the thread count.
    weight_read_bytes_per_s: dict[str, float] | None = None

    @property
    def has_device(self) -> bool:
        """Whether the profile describes an accelerator (the device fields are set)."""
        return self.h2d_bytes_per_s is not None

    def cpu_flops(self, dtype_bytes: int) -> tuple[float, float]:
        """(batch-1, large-batch) CPU matmul FLOP/s for a dtype of `dtype_bytes` (2: bf16, else fp32)."""
        if dtype_bytes == 2:
            return self.cpu_flops_bf16_batch1, self.cpu_flops_bf16_large
        return self.cpu_flops_fp32_batch1, self.cpu_flops_fp32_large

    def expert_flops(self, rows: int, dtype_bytes: int, packed: bool = False) -> float | None:
        """CPU FLOP/s of one expert's forward on `rows` rows (log-log interpolation of the measured curve; below
        its first point the rate scales with the rows, as a weight-read-bound kernel's does; beyond its last it
        stays flat). `packed`: weights with a prepacked oneDNN copy, where the profile measured that kernel (bf16).
        None when the profile has no curve.

        Example:
            >>> p = dataclasses.replace(load_profile("t4"), cpu_expert_flops_bf16={"1": 1e9, "100": 1e11})
            >>> round(p.expert_flops(10, 2) / 1e9, 1), p.expert_flops(1000, 2) / 1e9, p.expert_flops(10, 4)
            (10.0, 100.0, None)
        """
        curve = self.cpu_expert_flops_bf16 if dtype_bytes == 2 else self.cpu_expert_flops_fp32
        if packed and dtype_bytes == 2 and self.cpu_expert_flops_bf16_packed:
            curve = self.cpu_expert_flops_bf16_packed
        if not curve:
            return None
        points = sorted((int(r), float(f)) for r, f in curve.items())
        rows = max(1, rows)
        if rows <= points[0][0]:
            return points[0][1] * rows / points[0][0]
        for (r0, f0), (r1, f1) in zip(points, points[1:]):
            if rows <= r1:
                w = math.log(rows / r0) / math.log(r1 / r0)
                return math.exp((1 - w) * math.log(f0) + w * math.log(f1))
        return points[-1][1]

    def elementwise_per_s(self, dtype_bytes: int) -> float | None:
        """Measured element operations per second on the CPU for the dtype (None: not measured)."""
        return self.cpu_elementwise_bf16_per_s if dtype_bytes == 2 else self.cpu_elementwise_fp32_per_s

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
            raise ProfileError(f"{where}: field 'version' is {_short(data.get('version'))}; this hf_moe_offload reads "
                               f"version {PROFILE_VERSION} (re-run `hf-moe-offload profile`)")
        for name in ("name", "source"):
            if not isinstance(data.get(name), str):
                raise ProfileError(f"{where}: field {name!r} must be a string, got {_short(data.get(name))}")
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
        for name in _OPTIONAL_FIELDS:
            if data.get(name) is not None:
                _positive(where, name, data[name])
        for name in _CURVE_FIELDS:
            if data.get(name) is not None:
                _curve(where, name, data[name])
        reads = data.get("weight_read_bytes_per_s")
        if reads is not None and not isinstance(reads, dict):
            raise ProfileError(f"{where}: field 'weight_read_bytes_per_s' must be an object of read kind -> "
                               f"bytes/s, got {_short(reads)}")
        for key, rate in (reads or {}).items():
            _positive(where, f"weight_read_bytes_per_s[{key!r}]", rate)
        values = {k: v for k, v in data.items() if k in known}
        for name in ("cpu_threads", "host_memory_bytes", "device_memory_bytes"):
            if values.get(name) is not None:
                values[name] = int(values[name])
        for name in _CURVE_FIELDS:
            if values.get(name) is not None:
                values[name] = {str(int(r)): float(f) for r, f in values[name].items()}
        return cls(**values)

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the profile as JSON (default: `default_profile_path()`); returns the path. Written to a new
        temporary file beside it (an unpredictable name, created exclusively: no planted file or link is followed)
        and renamed over it, so a reader never sees half a file."""
        path = Path(path) if path is not None else default_profile_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(str(path.parent), path.name, self.to_dict(), indent=1)
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
            raise ProfileMissingError(f"profile file {str(path)!r} does not exist; run `hf-moe-offload profile` or "
                                      f"give one of the shipped profiles {list(SHIPPED_PROFILES)}")
        where = f"profile file {str(path)!r}"
        try:
            text = path.read_bytes().decode("utf-8")
            data = json.loads(text)
        except OSError as err:
            raise ProfileError(f"{where} cannot be read ({err.strerror or err})") from None
        except UnicodeDecodeError as err:
            raise ProfileError(f"{where} is not UTF-8 text ({err.reason} at byte {err.start}); re-run "
                               f"`hf-moe-offload profile`") from None
        except (ValueError, RecursionError) as err:   # JSONDecodeError, or nesting deeper than the parser's stack
            reason = err if isinstance(err, ValueError) else "nested too deeply"
            raise ProfileError(f"{where} is not valid JSON ({reason}); re-run `hf-moe-offload profile`") from None
        try:
            return cls.from_dict(data, where=where)
        except ProfileError:
            raise
        except (ValueError, TypeError, OverflowError, RecursionError) as err:   # a check this code lacks
            raise ProfileError(f"{where} has a field this hf_moe_offload cannot use ({type(err).__name__}: "
                               f"{err}); re-run `hf-moe-offload profile`") from None

    def summary(self) -> str:
        """One line per number, for `hf-moe-offload profile --show`."""
        lines = [f"{self.name} ({self.source})",
                 f"  disk read {self.disk_read_bytes_per_s / 1e9:.2f} GB/s, host memcpy "
                 f"{self.host_memcpy_bytes_per_s / 1e9:.2f} GB/s, host memory {self.host_memory_bytes / 2**30:.1f} GiB",
                 f"  CPU ({self.cpu_threads} threads) matmul bf16 {self.cpu_flops_bf16_batch1 / 1e9:.1f} / "
                 f"{self.cpu_flops_bf16_large / 1e9:.1f} GFLOP/s, fp32 {self.cpu_flops_fp32_batch1 / 1e9:.1f} / "
                 f"{self.cpu_flops_fp32_large / 1e9:.1f} GFLOP/s (batch 1 / large batch)"]
        if self.cpu_expert_flops_bf16:
            lines.append("  CPU expert forward bf16 (rows: GFLOP/s) " + ", ".join(
                f"{r}: {f / 1e9:.0f}" for r, f in sorted(self.cpu_expert_flops_bf16.items(), key=lambda i: int(i[0]))))
        if self.cpu_expert_flops_bf16_packed:
            lines.append("  CPU expert forward bf16, prepacked (rows: GFLOP/s) " + ", ".join(
                f"{r}: {f / 1e9:.0f}" for r, f in sorted(self.cpu_expert_flops_bf16_packed.items(),
                                                         key=lambda i: int(i[0]))))
        if self.cpu_elementwise_bf16_per_s:
            lines.append(f"  CPU elementwise bf16 {self.cpu_elementwise_bf16_per_s / 1e9:.2f} G/s, fp32 "
                         f"{(self.cpu_elementwise_fp32_per_s or 0) / 1e9:.2f} G/s")
        if self.weight_read_bytes_per_s:
            lines.append("  weight reads (GB/s) " + ", ".join(
                f"{kind}: {rate / 1e9:.1f}" for kind, rate in self.weight_read_bytes_per_s.items()))
        if self.layer_overhead_s:
            lines.append(f"  framework overhead {self.layer_overhead_s * 1e3:.2f} ms per layer and pass, "
                         f"{(self.step_overhead_s or 0) * 1e3:.2f} ms per generate step")
        if self.has_device:
            lines.append(f"  device {self.device_name}: host-to-device {self.h2d_bytes_per_s / 1e9:.1f} GB/s, "
                         f"{self.device_flops / 1e12:.1f} TFLOP/s, memory {self.device_memory_bytes / 2**30:.1f} GiB "
                         f"at {self.device_memory_bytes_per_s / 1e9:.0f} GB/s")
        return "\n".join(lines)


def _curve(where: str, name: str, value: Any) -> None:
    """A {rows: FLOP/s} mapping: keys whole numbers >= 1 (JSON keys are strings), values numbers > 0."""
    if not isinstance(value, dict) or not value:
        raise ProfileError(f"{where}: field {name!r} must be a non-empty object {{rows: FLOP/s}} such as "
                           f"{{\"1\": 2e10, \"256\": 4e11}}, got {_short(value)}")
    for rows, flops in value.items():
        # ASCII digits only: str.isdigit() also takes "³" or "١", which int() then refuses or reads otherwise
        if not re.fullmatch(r"[0-9]{1,9}", str(rows)) or int(rows) < 1:
            raise ProfileError(f"{where}: field {name!r} has row count {_short(rows)}; allowed: whole numbers from "
                               f"1 to 999999999 written in ASCII digits")
        _positive(where, f"{name}[{rows!r}]", flops)


def _positive(where: str, name: str, value: Any) -> None:
    """A number > 0 that a float holds (JSON integers have no bound; 10**400 overflows a float)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        try:
            ok = math.isfinite(float(value)) and value > 0
        except OverflowError:
            ok = False
    if not ok:
        raise ProfileError(f"{where}: field {name!r} must be a number > 0 that fits a float, got {_short(value)}")


def _short(value: Any) -> str:
    """`repr(value)`, cut to a line (a damaged file's value may be a huge integer or a deep structure)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):      # an int past Python's digit limit, or nesting too deep
        text = f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


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
    """A profile from a file, a shipped name ("t4", "l4"), or (None) this machine's cached one. Every unreadable
    or invalid file raises `ProfileError` (`ProfileMissingError` when there is none); a damaged cached one is also
    logged as a warning naming the file, as the planner then falls back to the memory rule.

    Example:
        >>> load_profile("t4").h2d_bytes_per_s / 1e9
        12.0
    """
    if spec is None:
        try:
            return MachineProfile.load(default_profile_path())
        except ProfileMissingError:
            raise
        except ProfileError as err:
            # Read on every load with a planned field left "auto": a damaged cache must be seen, not just skipped.
            logger.warning("hf_moe_offload: ignoring the cached machine profile: %s (or delete it)", err)
            raise
    if str(spec) in SHIPPED_PROFILES:
        return MachineProfile.load(shipped_profile_path(str(spec)))
    return MachineProfile.load(spec)
