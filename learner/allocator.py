"""Freed tensor memory goes back to the system (``learner.mmap_threshold_mib``).

On CPU a tensor's memory comes from glibc's ``malloc``. Allocations above its mmap threshold
get their own memory map, returned to the system on ``free``; smaller ones come from the heap,
whose freed holes stay in the process. glibc starts the threshold at 128 KiB but raises it each
time such a map is freed, up to 32 MiB, so after a few steps every temporary a learner step
makes (a head chunk's logits, a layer's recomputed activations, the optimizer's dequantized
moments) lives in the heap, and the holes they leave set the peak. For SmolLM2's leanest full
fine-tune that was 0.3-0.5 GB of a 3.0-3.4 GB peak, varying from run to run (docs/learner.md, "A full fine-tune in less
memory"). A fixed threshold stops the raising (glibc's ``mallopt`` with ``M_MMAP_THRESHOLD``).

The cost is the page faults of fresh maps for each large allocation: for that fine-tune a 1 MiB
threshold took 2.7 GB of peak instead of 3.0-3.2 GB, for 198 CPU seconds instead of 146 (the
kernel's time, zeroing fresh pages). So it is a setting, off by default, for a learner that must
fit. Where the C library is not glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def set_mmap_threshold(mib: float) -> bool:
    """Fix glibc's mmap threshold at ``mib`` MiB (0: leave glibc's own); whether it was set."""
    if mib <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("learner.mmap_threshold_mib: no glibc mallopt here; the allocator's own threshold stays")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(mib * 2**20)) == 1
