"""Peak host memory of a piece of work, for the bench scripts: how far the process's resident
set rose above where it was before, at its highest. The kernel keeps that high-water mark
itself (``VmHWM``, reset through ``/proc/self/clear_refs``), so no short-lived allocation
between two samples is missed, and tracemalloc would see only Python's, not torch's. Linux only."""

from __future__ import annotations

import gc
from pathlib import Path


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rise_kib(work) -> tuple[object, int]:
    """``work()``, and how far resident memory rose above where it was before, at its peak (KiB)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current resident size
    before = status_kib("VmRSS")
    out = work()
    return out, status_kib("VmHWM") - before
