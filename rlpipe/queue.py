"""Redis keys, the trajectory stream and the shared counters (DESIGN.md, 'Redis keys').

Delivery is at-least-once through a consumer group: the learner reads with XREADGROUP,
and an entry leaves the stream (XACK + XDEL) only when the learner says it is done with
it, in the same transaction that counts it as trained or dropped. So at every moment

    produced == trained + dropped_stale + len(stream)

which the end-to-end test checks. Malformed entries go to the dead-letter stream with
their reason and are counted in ``dead``; they never crash a reader.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from rlpipe.schema import GroupRecord, SchemaError, decode_group, encode_group

CONSUMER_GROUP = "learner"


class Keys:
    """Every Redis key of one run, under ``rlpipe:{run_id}:``."""

    def __init__(self, run_id: str):
        self.prefix = f"rlpipe:{run_id}:"
        self.traj = self.prefix + "traj"
        self.dead = self.prefix + "traj:dead"
        self.learner = self.prefix + "learner"
        self.sync = self.prefix + "sync"
        self.cursor = self.prefix + "prompts:cursor"
        # Not in DESIGN.md's table: prompt indices handed out but given back unfinished (a
        # worker shut down, or its reward could not be computed); handed out again first.
        self.returned = self.prefix + "prompts:returned"
        # Not in DESIGN.md's table: the counters behind the no-loss invariant above.
        self.counters = self.prefix + "counters"

    def sync_channel(self, precision: str = "") -> str:
        """The sync rendezvous of the workers of one precision: ``sync`` when every worker
        runs the same precision, ``sync:<precision>`` in a mixed fleet (``rollout.fleet``)."""
        return f"{self.sync}:{precision}" if precision else self.sync

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}workers:{worker_id}"

    @property
    def worker_pattern(self) -> str:
        return f"{self.prefix}workers:*"


@dataclass
class Entry:
    entry_id: str
    record: GroupRecord


def connect(url: str) -> redis.Redis:
    """A client whose every call has a timeout (no call may hang a process forever)."""
    return redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10, health_check_interval=30)


_NEXT_INDEX = """
local given_back = redis.call('LPOP', KEYS[1])
if given_back then return tonumber(given_back) end
return redis.call('INCR', KEYS[2]) - 1
"""


class TrajectoryQueue:
    def __init__(self, r: redis.Redis, run_id: str):
        self.r = r
        self.keys = Keys(run_id)
        self._next_index = r.register_script(_NEXT_INDEX)

    # -- producer side -------------------------------------------------------------
    def push(self, rec: GroupRecord) -> str:
        """Append one group and count it as produced, atomically."""
        data = encode_group(rec)
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.traj, {"data": data})
        pipe.hincrby(self.keys.counters, "produced", 1)
        entry_id, _ = pipe.execute()
        return entry_id.decode()

    def next_prompt_index(self) -> int:
        """The shared cursor: a given-back index if there is one, else the next new one.

        One server-side script, so across all workers every index is handed out exactly
        once (and once more for each time it is given back): no duplicates, no skips.
        """
        return int(self._next_index(keys=[self.keys.returned, self.keys.cursor]))

    def give_back(self, indices: list[int]) -> None:
        """Return prompt indices that were handed out but will not be pushed."""
        if indices:
            self.r.rpush(self.keys.returned, *indices)

    # -- consumer side -------------------------------------------------------------
    def ensure_consumer_group(self) -> None:
        try:
            self.r.xgroup_create(self.keys.traj, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def read(self, consumer: str, count: int, block_ms: int = 100) -> list[Entry]:
        """New entries for ``consumer``; malformed ones are dead-lettered on the way."""
        resp = self.r.xreadgroup(CONSUMER_GROUP, consumer, {self.keys.traj: ">"}, count=count, block=block_ms)
        return self._decode(resp[0][1] if resp else [])

    def claim_pending(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Take over entries another (dead) consumer read but never acknowledged."""
        out, start = [], "0-0"
        while True:
            start, claimed, *_ = self.r.xautoclaim(self.keys.traj, CONSUMER_GROUP, consumer, min_idle_ms, start, count=count)
            out += self._decode(claimed)
            if start in (b"0-0", "0-0") or not claimed:
                return out

    def _decode(self, raw_entries) -> list[Entry]:
        out = []
        for entry_id, fields in raw_entries:
            entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if fields is None:  # deleted while pending
                continue
            try:
                out.append(Entry(entry_id, decode_group(fields[b"data"])))
            except KeyError:
                self.dead_letter(entry_id, fields, "data: missing field")
            except SchemaError as e:
                self.dead_letter(entry_id, fields, str(e))
        return out

    def dead_letter(self, entry_id: str, fields: dict, reason: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.dead, {**fields, "reason": reason, "source_id": entry_id})
        pipe.xack(self.keys.traj, CONSUMER_GROUP, entry_id)
        pipe.xdel(self.keys.traj, entry_id)
        pipe.hincrby(self.keys.counters, "dead", 1)
        pipe.execute()

    def ack(self, trained: list[str], dropped_stale: list[str] = ()) -> None:
        """Remove finished entries and count them, in one transaction."""
        ids = list(trained) + list(dropped_stale)
        if not ids:
            return
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.keys.traj, CONSUMER_GROUP, *ids)
        pipe.xdel(self.keys.traj, *ids)
        if trained:
            pipe.hincrby(self.keys.counters, "trained", len(trained))
        if dropped_stale:
            pipe.hincrby(self.keys.counters, "dropped_stale", len(dropped_stale))
        pipe.execute()

    # -- accounting ----------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        raw = self.r.hgetall(self.keys.counters)
        out = {k: 0 for k in ("produced", "trained", "dropped_stale", "dead")}
        out.update({k.decode(): int(v) for k, v in raw.items()})
        return out

    def length(self) -> int:
        return int(self.r.xlen(self.keys.traj))

    def pending(self) -> int:
        """Entries delivered to a consumer but not yet acknowledged."""
        try:
            return int(self.r.xpending(self.keys.traj, CONSUMER_GROUP)["pending"])
        except redis.ResponseError:  # no group yet
            return 0


def rollout_allowance(
    counters: dict[str, int], inflight: int, version: int, groups_per_step: int, max_lag: int
) -> int:
    """How many more groups may be started now (back-pressure, DESIGN.md 'Staleness').

    A group started while the weights are at ``version`` is meant for one of the learner
    steps ``version+1 .. version+1+max_lag``: every group produced or in flight that has
    not been dropped occupies one of those ``(version + 1 + max_lag) * groups_per_step``
    places. With ``max_lag = 0`` this is the synchronous baseline: workers produce exactly
    one step's batch with the current weights and wait for the next version. Dropped
    groups free their place, so the learner can always fill its batch.
    """
    occupied = counters["produced"] - counters["dropped_stale"] + inflight
    return (version + 1 + max_lag) * groups_per_step - occupied

