"""The median wall time of repeated calls, for the bench scripts that time a piece of work
on the CPU (bench/delta_sync.py, bench/quant_cost.py); bench/gpu.py times on the device its own way."""

from __future__ import annotations

import statistics
import time


def timed(fn, repeats: int) -> float:
    """The median over ``repeats`` calls of ``fn()``'s wall time, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
