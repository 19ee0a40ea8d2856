"""learner.mmap_threshold_mib: a learner's freed temporaries go back to the system instead of
staying in glibc's heap (learner/allocator.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from learner.allocator import set_mmap_threshold

GROWTH = textwrap.dedent("""
    import sys, torch
    from learner.allocator import set_mmap_threshold
    set_mmap_threshold(float(sys.argv[1]))
    def rss_mib():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
    first = torch.ones(5 * 2**20)  # a 20 MiB map freed: glibc's own threshold rises past what follows
    del first
    keep, base = [], rss_mib()
    for i in range(12):  # a step's temporaries, each a little larger, each freed under a small tensor that stays
        big = torch.ones((2 + i // 4) * 2**20)  # 8 to 16 MiB
        keep.append(torch.ones(64))
        del big
    print(rss_mib() - base)
""")


def grown_mib(threshold_mib: float) -> float:
    out = subprocess.run([sys.executable, "-c", GROWTH, str(threshold_mib)], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_temporaries_leave_the_process_with_a_fixed_threshold():
    """Under glibc's own (rising) threshold the freed tensors stay resident in the heap: tens of
    MiB here. With the learner's fixed 1 MiB threshold each got its own map and went back."""
    kept = grown_mib(0)
    returned = grown_mib(1.0)
    assert kept > 40, kept
    assert returned < 8, returned


def test_zero_leaves_the_allocator_alone():
    assert set_mmap_threshold(0) is False
