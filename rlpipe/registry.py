"""Who is alive: the worker registry (hashes with a TTL) and the learner's state hash.

A worker re-writes ``rlpipe:{run}:workers:{id}`` every ``heartbeat_s`` with a TTL of
``heartbeat_ttl_s``; a worker that stops heart-beating disappears by itself, and with it
its ``inflight`` count from the back-pressure sum.
"""

from __future__ import annotations

import time

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
