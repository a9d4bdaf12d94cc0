"""The default torch thread count for a model computing on the CPU: the cores other processes leave free.

A decode step on the CPU is hundreds of short parallel regions, and each ends at a barrier that waits for its
slowest thread. When another process holds a core, the thread that shares it runs only in its time slices, and
every barrier waits for it: with all cores as threads, a busy neighbour slows decoding several times over (numbers
in docs/benchmarks.md, "CPU kernels"); with one thread fewer, it costs that core's share. So at load, when the user
has not chosen a thread count (`OMP_NUM_THREADS`, `HF_MOE_OFFLOAD_THREADS` or `torch.set_num_threads` to something
other than torch's default), torch's thread count becomes the number of CPUs less the load other processes put on
them (the 1-minute load average, rounded up, at most what others keep busy in a short sample at load: the average
also counts this process, whose own loading may just have kept every core busy), at least 1.
`HF_MOE_OFFLOAD_THREADS=N` sets N instead; `disable()` puts the previous count back. OpenMP's wait policy is read
when the OpenMP runtime starts, before any library can set it: a process started with `OMP_WAIT_POLICY=PASSIVE`
(threads sleep at a barrier instead of spinning) keeps every core, which measured faster than fewer threads beside a
busy process (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Callable

import psutil
import torch

logger = logging.getLogger(__name__)

THREADS_ENV = "HF_MOE_OFFLOAD_THREADS"
SAMPLE_S = 0.2          # how long `others_busy` watches the CPUs (once, at load)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:    # no affinity masks on this system (macOS, Windows)
        return os.cpu_count() or 1


def others_busy(window_s: float = SAMPLE_S) -> float:
    """CPUs that other processes keep busy now: the machine's busy CPU time over a short window less this
    process's own (its threads, e.g. the load just done, are no neighbour)."""
    me = psutil.Process()
    machine, own = psutil.cpu_times(), me.cpu_times()
    time.sleep(window_s)
    machine_after, own_after = psutil.cpu_times(), me.cpu_times()

    def busy(t) -> float:
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)
    mine = (own_after.user + own_after.system) - (own.user + own.system)
    return max(0.0, (busy(machine_after) - busy(machine) - mine) / window_s)


def others_load() -> float | None:
    """The load of other processes: the 1-minute load average (which counts this process too), bounded by what
    others keep busy over a short sample now; None where the system has no load average."""
    try:
        average = os.getloadavg()[0]
    except (AttributeError, OSError):       # no load average on this system (Windows)
        return None
    return min(average, others_busy())


def free_cores(load: float | None = None, cpus: int | None = None) -> int:
    """CPUs less the load of other processes (`others_load`, rounded up), at least 1.

    Example:
        >>> free_cores(load=1.2, cpus=8), free_cores(load=0.0, cpus=2), free_cores(load=5.0, cpus=2)
        (6, 2, 1)
    """
    cpus = cpus or usable_cpus()
    if load is None:
        load = others_load()
        if load is None:
            return cpus
    return max(1, cpus - math.ceil(load - 0.05))   # 0.05: a trace of load is no process holding a core


def apply_default_threads() -> Callable[[], None] | None:
    """Set torch's thread count for CPU compute (module docstring); returns what puts the previous count back, or
    None when the user's choice stands or nothing changed."""
    before = torch.get_num_threads()
    chosen = os.environ.get(THREADS_ENV)
    if chosen is not None:
        if not chosen.isdigit() or int(chosen) < 1:
            raise ValueError(f"{THREADS_ENV}={chosen!r} is not allowed; allowed: a whole number >= 1")
        threads = int(chosen)
    elif "OMP_NUM_THREADS" in os.environ or before != usable_cpus():
        return None                       # the user chose a thread count
    elif os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive":
        return None                       # waiting threads sleep: every core keeps its speed beside a busy one
    else:
        threads = min(before, free_cores())
    if threads == before:
        return None
    torch.set_num_threads(threads)
    logger.info("hf_moe_offload: %d torch thread(s) for CPU compute (of %d; other processes load the rest; "
                "%s=N chooses)", threads, before, THREADS_ENV)
    return lambda: torch.set_num_threads(before)
