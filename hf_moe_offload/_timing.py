"""The one timer every measurement uses: the best of several runs, since others' load only slows a run down."""

from __future__ import annotations

import math
import time
from typing import Callable


def best_rate(work: float, run: Callable[[], object], seconds: float, min_runs: int = 3) -> float:
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
