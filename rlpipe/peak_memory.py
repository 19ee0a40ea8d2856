"""Peak host memory of a piece of work, for the bench scripts and the tests: how far the
process's resident set rose above where it was before, at its highest. The kernel keeps that
high-water mark itself (``VmHWM``, reset through ``/proc/self/clear_refs``), so no short-lived
allocation between two samples is missed, and tracemalloc would see only Python's, not
torch's. Linux only."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def trim_heap() -> None:
    """Hand freed heap back to the kernel (glibc), so the rise counts what ``work()`` needs:
    memory an earlier step freed but malloc kept would otherwise be reused uncounted, and
    the rise would depend on what ran before (on CI a full checkpoint rose by 111 MiB while
    holding 198 MiB of tensors)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the rise may undercount
        pass


def peak_rise_kib(work) -> tuple[object, int]:
    """``work()``, and how far resident memory rose above where it was before, at its peak (KiB)."""
    gc.collect()
    trim_heap()
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current resident size
    before = status_kib("VmRSS")
    out = work()
    return out, status_kib("VmHWM") - before
