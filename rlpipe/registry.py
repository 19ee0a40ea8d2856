"""Who is alive: the worker registry (hashes with a TTL), the learner's state hash and its lease.

A worker re-writes ``rlpipe:{run}:workers:{id}`` every ``heartbeat_s`` with a TTL of
``heartbeat_ttl_s``; a worker that stops heart-beating disappears by itself, and with it
its ``inflight`` count from the back-pressure sum.

One learner per run: it holds ``rlpipe:{run}:learner:lease`` (a random token with a TTL,
renewed in the background). A second learner (an impatient restart, a duplicated pod)
waits until the lease is free instead of consuming the same stream, which would train
groups twice; a learner that finds its lease taken stops. The lease names its holder
(host, pid, the process's start time): a learner restarted on the same host takes over
at once when that process is provably gone, instead of waiting out the TTL.

Each acquisition takes the next *lease epoch* (``learner:epoch``, only ever incremented).
A learner that lost its lease without noticing (paused, partitioned: a zombie) still holds
its old epoch, and every write that could undo its successor's work (acknowledgements,
dead letters, the published state and weights) is made by a script that first checks the
epoch (:class:`Fence`): Redis refuses the zombie's write, which raises :class:`Fenced`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

import redis

from rlpipe.fence import Fence
from rlpipe.keys import Keys
from rlpipe.proc import process_start_ticks
from rlpipe.readback import number

log = logging.getLogger(__name__)


def _decode(raw: dict) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


def heartbeat_worker(r: redis.Redis, keys: Keys, worker_id: str, ttl_s: float, **fields) -> None:
    key = keys.worker(worker_id)
    pipe = r.pipeline(transaction=True)
    pipe.hset(key, mapping={**fields, "heartbeat": time.time()})
    pipe.pexpire(key, int(ttl_s * 1000))
    pipe.execute()


def remove_worker(r: redis.Redis, keys: Keys, worker_id: str) -> None:
    r.delete(keys.worker(worker_id))


def live_workers(r: redis.Redis, keys: Keys) -> dict[str, dict[str, str]]:
    """Every registered worker (id -> fields) whose heartbeat has not expired."""
    out = {}
    for key in r.scan_iter(match=keys.worker_pattern, count=100):
        fields = _decode(r.hgetall(key))
        if fields:
            out[key.decode().rsplit(":", 1)[1]] = fields
    return out


def fleet_idle_seconds(r: redis.Redis, keys: Keys, now: float | None = None) -> tuple[float, int]:
    """The live workers' idle seconds summed (no group in flight while serving, see
    rollout_service.loop), exact at ``now``: each worker publishes its ended idle periods and
    when the current one began; and how many live workers there are. A bench divides the
    change over some steps by workers x wall time to get the fleet's idle fraction."""
    now = time.time() if now is None else now
    workers = live_workers(r, keys)
    total = 0.0
    for fields in workers.values():
        since = number(fields.get("idle_since"), "worker idle_since", 0.0, float)
        total += number(fields.get("idle_seconds"), "worker idle_seconds", 0.0, float, low=0) + \
            (max(0.0, now - since) if since > 0 else 0.0)
    return total, len(workers)


def worker_incarnations(r: redis.Redis, keys: Keys) -> dict[str, str]:
    """Live workers, id -> incarnation: how weight sync tells a returning worker from the
    one it left out (see weight_sync.sender)."""
    return {w: f.get("incarnation", "") for w, f in live_workers(r, keys).items()}


def set_learner_state(r: redis.Redis, keys: Keys, fence: Fence | None = None, **fields) -> None:
    (fence or Fence(r, keys.epoch)).hset(keys.learner, {**fields, "heartbeat": time.time()})


def learner_state(r: redis.Redis, keys: Keys) -> dict[str, str]:
    return _decode(r.hgetall(keys.learner))


def learner_version(r: redis.Redis, keys: Keys) -> int:
    return number(r.hget(keys.learner, "version"), "learner version", 0, low=0)


def published_version(r: redis.Redis, keys: Keys) -> int:
    """The highest weights version the learner hash or any live worker names: a restored
    learner labels its weights above it, so versions only ever grow."""
    workers = [number(f.get("version"), "worker version", 0, low=0) for f in live_workers(r, keys).values()]
    return max([learner_version(r, keys), *workers])


# Renewing also re-creates a lease that vanished (a Redis restart lost its last writes), but
# never takes one another learner holds.
_RENEW = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if not holder then return redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) and 1 or 0 end
return 0"""
_RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"""
# KEYS: lease, epoch; ARGV: token, ttl ms. The lease, the next epoch and, if the epoch was
# not a counter (overwritten: INCR would fail every start for good), what it was; or nothing.
# Such an epoch starts again from the clock in microseconds: above any epoch taken before, so
# no learner that still holds an old one (a zombie) can ever match it.
_ACQUIRE = """
if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
local epoch = redis.call('get', KEYS[2])
if epoch and not (epoch == '0' or (string.match(epoch, '^[1-9]%d*$') and #epoch <= 18)) then
  local t = redis.call('time')
  redis.call('set', KEYS[2], t[1] .. string.format('%06d', tonumber(t[2])))
else
  epoch = ''
end
return {redis.call('incr', KEYS[2]), epoch}"""


def holder_is_dead(holder: str) -> bool:
    """True only when the lease ``holder`` (``token|host|pid|start``) ran on this host and
    that process no longer exists; a holder elsewhere may be alive, so it is never dead here."""
    parts = holder.split("|")
    if len(parts) != 4 or parts[1] != socket.gethostname():
        return False
    return process_start_ticks(int(parts[2])) != parts[3]


class LearnerLease:
    """The run's single-learner lease: acquire (waiting for another holder to let go),
    renew in a daemon thread, release. Releasing also ends the renewal, so a lease that
    was let go on purpose is never mistaken for a lost one."""

    def __init__(self, r: redis.Redis, keys: Keys, ttl_s: float):
        self.r, self.key, self.ttl_s = r, keys.learner + ":lease", ttl_s
        self.keys = keys
        self.epoch: int | None = None  # this holder's lease epoch, once acquired
        self.token = f"{uuid.uuid4().hex}|{socket.gethostname()}|{os.getpid()}|{process_start_ticks(os.getpid())}"
        self._released = threading.Event()
        self.took_over_from: str | None = None  # a dead holder whose lease this one took at once

    @property
    def fence(self) -> Fence:
        return Fence(self.r, self.keys.epoch, self)

    def _take(self) -> bool:
        taken = self.r.eval(_ACQUIRE, 2, self.key, self.keys.epoch, self.token, int(self.ttl_s * 1000))
        if not taken:
            return False
        self.epoch, overwritten = int(taken[0]), taken[1]
        if overwritten:
            log.warning("the lease epoch was %r, not a counter: restarted it from the clock at %d",
                        overwritten.decode(errors="replace")[:80], self.epoch)
        return True

    def try_acquire(self) -> bool:
        if self._take():
            return True
        holder = self.r.get(self.key)
        if holder is not None and holder_is_dead(holder.decode()):
            # compare-and-delete: only the dead holder's lease, not one a third learner just took
            if self.r.eval(_RELEASE, 1, self.key, holder) and self._take():
                self.took_over_from = holder.decode()
                log.warning("the previous learner (pid %s on this host) is gone: took its lease without waiting",
                            holder.decode().split("|")[2])
                return True
        return False

    def acquire(self, on_wait: Callable[[], None], on_lost: Callable[[], None]) -> None:
        """Block until the lease is ours (``on_wait`` every 2 s meanwhile), then keep it
        renewed; ``on_lost`` runs if another learner takes it while we still want it."""
        waited = 0.0  # says so at once, then every 2 s
        while not self.try_acquire():
            if time.monotonic() - waited > 2:
                on_wait()
                waited = time.monotonic()
            time.sleep(min(0.2, self.ttl_s / 4))
        threading.Thread(target=self._renew, args=(on_lost,), name="learner-lease", daemon=True).start()

    def renew(self) -> bool:
        """False if the lease was lost (expired and taken by another learner). A lease that
        names a dead holder is taken again: a restarted Redis that lost the last second of
        writes may hold the lease this learner took over from its dead predecessor."""
        return bool(self.r.eval(_RENEW, 1, self.key, self.token, int(self.ttl_s * 1000))) or self.try_acquire()

    def _renew(self, on_lost: Callable[[], None]) -> None:
        while not self._released.wait(self.ttl_s / 3):
            try:
                held = self.renew()
            except redis.RedisError as e:  # Redis briefly unreachable: try again
                log.warning("lease renewal failed: %s", e)
                continue
            if not held and not self._released.is_set():
                on_lost()
                return

    def release(self) -> None:
        self._released.set()
        self.r.eval(_RELEASE, 1, self.key, self.token)
