"""The streams rlpipe reads beside ``traj``: held-out evaluation's requests (the workers read
them in a consumer group, rollout_service/evals.py) and results (the learner reads them,
learner/evals.py).

Whoever can write to Redis can add to them: a result that was not JSON crash-looped the
learner, forged results were logged as real, and forged requests each held a worker's
evaluator for a minute. So each has what ``traj`` has (rlpipe/queue.py): its reader checks
every entry against the run, an entry is delivered at most ``queue.max_deliveries`` times
(one that kills its reader every time is given up on, not read forever), and an entry given
up on goes to the stream's dead letters (``<stream>:dead``, as ``traj``'s go to
``traj:dead``) with its reason. The reader then goes on: no entry of a side stream stops,
stalls or crash-loops training. A dead letter keeps a bounded copy of the entry, and the
dead-letter stream its newest :data:`DEAD_MAXLEN` entries, so a flood of forged entries
cannot grow Redis through them.
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger(__name__)

DEAD_MAXLEN = 1000  # dead letters kept per stream (approximately: Redis trims whole nodes)
FIELDS_KEPT = 16  # of a dead entry's fields
FIELD_BYTES = 1024  # of each kept field's name and value


class Rejected(ValueError):
    """An entry that is not what its reader expects of this run: the reason."""


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def dead_letter(r: redis.Redis, stream: str, entry_id: str, fields: dict, reason: str,
                group: str | None = None) -> None:
    """Move an entry of ``stream`` to ``<stream>:dead`` with ``reason`` and ``source_id``
    (acknowledged first in consumer group ``group``, if given), atomically."""
    kept = {_text(k)[:FIELD_BYTES]: _text(v)[:FIELD_BYTES] for k, v in list(fields.items())[:FIELDS_KEPT]}
    pipe = r.pipeline(transaction=True)
    pipe.xadd(f"{stream}:dead", {**kept, "reason": reason[:FIELD_BYTES], "source_id": entry_id},
              maxlen=DEAD_MAXLEN, approximate=True)
    if group is not None:
        pipe.xack(stream, group, entry_id)
    pipe.xdel(stream, entry_id)
    pipe.hdel(f"{stream}:deliveries", entry_id)
    pipe.execute()
    log.warning("dead-lettered %s entry %s: %s", stream, entry_id, reason)


def delivered(r: redis.Redis, stream: str, entry_id: str) -> int:
    """Count one more delivery of an entry read without a consumer group (XREAD keeps no
    count); returns how many so far. Counted before the entry is handled, so that an entry
    that kills its reader is counted once per reader's life; :func:`settled` forgets it."""
    return int(r.hincrby(f"{stream}:deliveries", entry_id, 1))


def settled(r: redis.Redis, stream: str, entry_id: str) -> None:
    """The reader is done with an entry :func:`delivered` counted."""
    r.hdel(f"{stream}:deliveries", entry_id)
