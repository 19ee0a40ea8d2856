"""The single-learner lease (rlpipe/registry.py) on a real Redis."""

from __future__ import annotations

import socket
import subprocess

from rlpipe.proc import process_start_ticks
from rlpipe.queue import Keys
from rlpipe.registry import LearnerLease
from tests.conftest import free_run_id


def dead_holder() -> str:
    """The lease value of a learner on this host whose process has exited."""
    proc = subprocess.Popen(["sleep", "30"])
    ticks = process_start_ticks(proc.pid)
    proc.kill()
    proc.wait()
    return f"{'0' * 32}|{socket.gethostname()}|{proc.pid}|{ticks}"


def test_renewal_takes_back_a_lease_only_from_a_dead_holder(r):
    keys = Keys(free_run_id("lease"))
    lease, other = LearnerLease(r, keys, ttl_s=5), LearnerLease(r, keys, ttl_s=5)
    assert lease.try_acquire() and not other.try_acquire()
    # A restarted Redis that lost the last second of writes: the lease names the dead learner
    # this one took it from. Renewing takes it back instead of stopping a healthy learner.
    r.set(lease.key, dead_holder())
    assert lease.renew() and r.get(lease.key).decode() == lease.token
    # The lease gone altogether: re-created.
    r.delete(lease.key)
    assert lease.renew() and r.get(lease.key).decode() == lease.token
    # Another live learner holds it: lost, and left to that learner.
    r.set(lease.key, other.token)
    assert not lease.renew() and r.get(lease.key).decode() == other.token
