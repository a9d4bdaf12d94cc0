"""A memory cap for one child process through a Linux control group, the way a small machine or a container limits
it: the kernel charges the process's anonymous memory *and* the page cache it fills to the group, and reclaims
(or OOM-kills) at the limit.

cgroup v1 (a writable `memory` hierarchy, e.g. /sys/fs/cgroup/memory) and v2 (`memory.max` under a unified
hierarchy, /sys/fs/cgroup with `cgroup.controllers`) are both supported. The group is made under this process's
own group where that is writable (so the hierarchy's accounting still holds), else under the hierarchy's root.
Needs root (or a delegated subtree).

    with memory_cap(1 << 30, "bench") as cap:
        subprocess.run(cap.command(["python", "worker.py"]), check=True)
        print(cap.stats())
    # the group is removed here, also when the worker failed
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("cgroup_cap")

CGROUP_ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(RuntimeError):
    """No memory controller this process can write: neither cgroup v1 nor v2."""


@dataclass
class MemoryCap:
    """One memory-limited control group; `command` wraps a command line so that its process runs inside."""

    path: Path
    version: int           # 1 or 2
    limit_bytes: int

    def command(self, argv: list[str]) -> list[str]:
        """`argv` started by a shell that first moves itself into the group, then execs (so every byte the
        command allocates, from its first one, is charged to the group)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def read_limit(self) -> int | None:
        text = (self.path / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")).read_text().strip()
        return int(text) if text.isdigit() else None

    def stats(self) -> dict[str, int]:
        """Peak charge (anonymous + page cache), limit hits and OOM kills so far, and the major faults and page-ins
        the group's memory.stat counts (keys absent where the kernel does not report them)."""
        out: dict[str, int] = {}
        names = ({"peak_bytes": "memory.max_usage_in_bytes", "usage_bytes": "memory.usage_in_bytes",
                  "limit_hits": "memory.failcnt"} if self.version == 1 else
                 {"peak_bytes": "memory.peak", "usage_bytes": "memory.current"})
        for key, name in names.items():
            with contextlib.suppress(OSError, ValueError):
                out[key] = int((self.path / name).read_text().split()[0])
        events = self.path / ("memory.oom_control" if self.version == 1 else "memory.events")
        stat = _key_values(self.path / "memory.stat")
        with contextlib.suppress(OSError):
            kv = _key_values(events)
            out["oom_kills"] = kv.get("oom_kill", 0)
            if self.version == 2:
                out["limit_hits"] = kv.get("max", 0)
        for key in ("pgmajfault", "pgpgin", "cache", "file", "rss", "anon"):
            if key in stat:
                out[key] = stat[key]
        return out

    def remove(self, attempts: int = 50) -> None:
        """Remove the group: processes still inside go back to its parent first; rmdir is retried while the
        kernel finishes tearing down a process that just exited."""
        for attempt in range(attempts):
            with contextlib.suppress(OSError):
                for pid in (self.path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (self.path.parent / "cgroup.procs").write_text(pid)
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.1)


def _key_values(path: Path) -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[name] = int(value)
    return out


def _own_group(controller: str) -> str:
    """This process's group path in the hierarchy of `controller` ("" for v2's unified one)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            if (controller == "" and names == "") or controller in names.split(","):
                return path.lstrip("/")
    return ""


def _parents(root: Path, controller: str) -> list[Path]:
    own = root / _own_group(controller)
    return [own, root] if own != root else [root]


def _make(parents: list[Path], name: str) -> Path:
    """mkdir `name` under the first parent that allows it."""
    errors = []
    for parent in parents:
        try:
            (parent / name).mkdir()
            return parent / name
        except OSError as err:
            errors.append(f"{parent}: {err.strerror or err}")
    raise CgroupUnavailable("cannot create a control group: " + "; ".join(errors))


def create_cap(limit_bytes: int, prefix: str = "memcap", root: Path = CGROUP_ROOT) -> MemoryCap:
    """A new group limited to `limit_bytes` (swap off for it where the kernel allows), v2 if `root` is a unified
    hierarchy, else v1's `memory` controller. Raises `CgroupUnavailable` saying what was tried."""
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    if (root / "cgroup.controllers").exists():
        parents = _parents(root, "")
        for parent in parents:   # the memory controller must be enabled for the children of the parent
            with contextlib.suppress(OSError):
                if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                    (parent / "cgroup.subtree_control").write_text("+memory")
        path = _make(parents, name)
        cap = MemoryCap(path, 2, limit_bytes)
        limit_file, swap_files = path / "memory.max", [path / "memory.swap.max"]
    elif (root / "memory" / "memory.limit_in_bytes").exists():
        path = _make(_parents(root / "memory", "memory"), name)
        cap = MemoryCap(path, 1, limit_bytes)
        limit_file, swap_files = path / "memory.limit_in_bytes", [path / "memory.memsw.limit_in_bytes"]
    else:
        raise CgroupUnavailable(f"no memory controller under {root}: neither cgroup v2 ({root}/cgroup.controllers)"
                                f" nor v1 ({root}/memory/memory.limit_in_bytes)")
    try:
        limit_file.write_text(str(limit_bytes))
        if cap.read_limit() is None:
            raise CgroupUnavailable(f"{limit_file} did not take the limit {limit_bytes}")
    except OSError as err:
        cap.remove()
        raise CgroupUnavailable(f"cannot write {limit_file}: {err.strerror or err}") from err
    for f in swap_files:   # no swapping around the cap (v1: memory+swap = the same limit; v2: no swap)
        with contextlib.suppress(OSError):
            f.write_text(str(limit_bytes) if cap.version == 1 else "0")
    log.info("memory cap %.2f GiB: %s (cgroup v%d)", limit_bytes / 2**30, path, cap.version)
    return cap


@contextlib.contextmanager
def memory_cap(limit_bytes: int, prefix: str = "memcap", root: Path = CGROUP_ROOT) -> Iterator[MemoryCap]:
    """`create_cap` for the length of a `with` block; the group is removed on the way out, error or not."""
    cap = create_cap(limit_bytes, prefix, root)
    try:
        yield cap
    finally:
        cap.remove()


def cgroups_writable(root: Path = CGROUP_ROOT) -> str | None:
    """None when a memory cap can be made here, else why not (tests skip on it)."""
    try:
        create_cap(64 << 20, "memcap_probe", root).remove()
    except (CgroupUnavailable, OSError) as err:
        return str(err)
    return None
