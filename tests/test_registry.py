"""The single-learner lease (rlpipe/registry.py) on a real Redis."""

from __future__ import annotations

import socket
import subprocess

import pytest

from rlpipe.fence import Fenced
from rlpipe.keys import Keys
from rlpipe.proc import process_start_ticks
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


@pytest.mark.parametrize("forged", ["abc", "-3", "007", "1" * 25])
def test_an_overwritten_lease_epoch_starts_again_above_every_epoch_before(r, caplog, forged):
    """Issue 33, item 15: ``learner:epoch abc`` made the acquisition's INCR fail, so no learner
    could ever start again. It starts again from the clock, above any epoch taken before, so
    a zombie holding an old one stays fenced."""
    keys = Keys(free_run_id("epoch"))
    old = LearnerLease(r, keys, ttl_s=5)
    assert old.try_acquire()
    zombie = old.fence
    old.release()
    r.set(keys.epoch, forged)
    with pytest.raises(Fenced):
        zombie.check()  # refused, not a crash on the value
    lease = LearnerLease(r, keys, ttl_s=5)
    assert lease.try_acquire() and lease.epoch > old.epoch and r.get(keys.epoch) == str(lease.epoch).encode()
    assert f"the lease epoch was {forged!r}, not a counter" in caplog.text
    lease.fence.check()
    with pytest.raises(Fenced):
        zombie.check()
    lease.release()
    after = LearnerLease(r, keys, ttl_s=5)
    assert after.try_acquire() and after.epoch == lease.epoch + 1
