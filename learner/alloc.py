"""Memory a step frees goes back to the system (``learner.release_memory``).

torch's CPU tensors come from glibc's malloc. glibc serves an allocation from mmap only above a
threshold that it raises to the size of every mmapped block freed (up to 32 MiB), so after the
first step a learner's large tensors (logits chunks, gradients, Adam's temporaries) come from the
heap, and freed heap memory stays in the process, scattered where the next step's differently
sized tensors do not fit. Measured on SmolLM2-135M: the resident set grew step after step with no
more live tensors (bench/learner.py's peak memory). Fixing the threshold (``M_MMAP_THRESHOLD``, which
also stops glibc raising it) sends every block of at least :data:`MMAP_THRESHOLD` to mmap, unmapped
when freed, and ``malloc_trim`` after each step hands back the heap's free pages. Elsewhere than
glibc (musl, macOS) both are absent and nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 4 << 20  # a SmolLM2 activation of 1,000 tokens (2.3 MB) stays on the heap; logits do not


@functools.lru_cache(maxsize=1)
def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Large blocks from mmap from now on; False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        log.info("learner.release_memory: not glibc, the allocator is left as it is")
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim() -> None:
    """Hand the heap's free pages back (after a step, when its temporaries are freed)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
