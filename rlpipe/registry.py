"""Who is alive: the worker registry (hashes with a TTL), the learner's state hash and its lease.

A worker re-writes ``rlpipe:{run}:workers:{id}`` every ``heartbeat_s`` with a TTL of
``heartbeat_ttl_s``; a worker that stops heart-beating disappears by itself, and with it
its ``inflight`` count from the back-pressure sum.

One learner per run: it holds ``rlpipe:{run}:learner:lease`` (a random token with a TTL,
renewed in the background). A second learner (an impatient restart, a duplicated pod)
waits until the lease is free instead of consuming the same stream, which would train
groups twice; a learner that finds its lease taken stops.
"""

from __future__ import annotations

import time
import uuid

import redis

from rlpipe.queue import Keys


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


def set_learner_state(r: redis.Redis, keys: Keys, **fields) -> None:
    r.hset(keys.learner, mapping={**fields, "heartbeat": time.time()})


def learner_state(r: redis.Redis, keys: Keys) -> dict[str, str]:
    return _decode(r.hgetall(keys.learner))


def learner_version(r: redis.Redis, keys: Keys) -> int:
    v = r.hget(keys.learner, "version")
    return int(v) if v is not None else 0


_RENEW = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"""
_RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"""


class LearnerLease:
    def __init__(self, r: redis.Redis, keys: Keys, ttl_s: float):
        self.r, self.key, self.ttl_ms = r, keys.learner + ":lease", int(ttl_s * 1000)
        self.token = uuid.uuid4().hex

    def try_acquire(self) -> bool:
        return bool(self.r.set(self.key, self.token, nx=True, px=self.ttl_ms))

    def renew(self) -> bool:
        """False if the lease was lost (expired and taken by another learner)."""
        return bool(self.r.eval(_RENEW, 1, self.key, self.token, self.ttl_ms))

    def release(self) -> None:
        self.r.eval(_RELEASE, 1, self.key, self.token)
