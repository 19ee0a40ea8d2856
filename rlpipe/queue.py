"""The trajectory stream, prompt leases and the shared counters (docs/design.md, 'Redis keys').

Delivery is at-least-once through a consumer group: the learner reads with XREADGROUP,
and an entry leaves the stream (XACK + XDEL) only when the learner says it is done with
it, in the same transaction that counts it as trained, dropped, a duplicate or filtered (equal rewards,
dynamic sampling). So at every moment

    produced == trained + dropped_stale + dead + duplicate + filtered + len(stream)

which the end-to-end and chaos tests check. Malformed entries go to the dead-letter stream with
their reason and are counted in ``dead``; they never crash a reader.

Prompt leases (docs/design.md, 'Prompt leases'): the cursor hands a prompt index to one worker
and, in the same script, records it in that worker's ``prompts:leases:{worker}``. A push
or a give-back clears the lease in the script that does it, and only a leased push is
accepted: so when a dead worker's leases are re-issued (:meth:`TrajectoryQueue.reclaim_dead`,
once its registry entry expired), a late push from it (a zombie: paused, partitioned) is
refused and counted in ``rejected_push``, never trained twice. Every step of this is one
server-side script, so a retried call after a lost reply cannot apply twice either.

The rest of the queue's ideas have their own modules: the key names in rlpipe/keys.py, the
connection in rlpipe/redis_link.py, the Lua scripts each step runs in rlpipe/queue_scripts.py,
and the bitmap of prompt indices in rlpipe/index_set.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import redis

from rlpipe.admission import MAX_PROMPT_INDEX, RunCheck
from rlpipe.fence import Fence
from rlpipe.index_set import IndexSet
from rlpipe.keys import CONSUMER_GROUP, COUNTERS, Keys
from rlpipe.queue_scripts import QueueScripts
from rlpipe.readback import number
from rlpipe.schema import GroupRecord, SchemaError, decode_group, encode_group

log = logging.getLogger(__name__)


@dataclass
class Entry:
    entry_id: str
    record: GroupRecord


class Lease(NamedTuple):
    """What one hand-out (:meth:`TrajectoryQueue.lease_prompts`) returns, all read in its script."""

    allowance: int  # places left before this hand-out (``wanted`` without back-pressure)
    prompts: list[tuple[int, int]]  # (index, attempt): attempt counts the earlier hand-outs of that index
    unconsumed: int  # groups produced that the learner's lineage has not consumed: in the stream, or being trained
    fleet_leased: int  # prompts in flight across the fleet, after this hand-out


class TrajectoryQueue:
    """The run's stream, leases and counters. ``check``: the reader's admission rules (the
    learner's); without it, entries are only checked to be well-formed (tools, tests)."""

    def __init__(self, r: redis.Redis, run_id: str, check: RunCheck | None = None):
        self.r = r
        self.keys = Keys(run_id)
        self.check = check
        self.fence = Fence(r, self.keys.epoch)  # the learner sets its lease's (rlpipe/fence.py)
        self.scripts = QueueScripts(r, self.keys)

    # -- producer side -------------------------------------------------------------
    def push(self, rec: GroupRecord, worker_id: str | None = None) -> str | None:
        """Append one group and count it as produced, atomically. A group for a leased
        prompt (``worker_id`` given) is only appended while ``worker_id`` still holds the
        lease, which it clears: returns None, counted in ``rejected_push``, if the prompt
        was re-issued meanwhile. Without ``worker_id``: groups that never came from the
        cursor (tests, imported data)."""
        data = encode_group(rec)
        if worker_id is not None:
            return self.scripts.leased_push(worker_id, rec.prompt_index, data)
        return self.push_data(data)

    def push_data(self, data: bytes) -> str:
        """Append an encoded group (``data``, unchecked) without a lease and count it as produced."""
        return self.scripts.push(data)

    def lease_prompts(self, worker_id: str, wanted: int, backpressure: tuple[int, ...] | None = None) -> Lease:
        """Lease up to ``wanted`` prompts to ``worker_id``, given-back indices first, then the
        cursor's next new ones (see :class:`Lease` for what comes back).

        Every index is handed out exactly once (and once more for each time it is given
        back): no duplicates, no skips.

        ``backpressure = (weights version, groups_per_step, max_lag[, max_staleness])`` caps them at the
        rollout allowance (docs/design.md 'Staleness'), computed in the same script, so two
        workers asking at once cannot both take the last places. A group started now is
        meant for one of the learner's next ``1 + max_lag`` steps, so the groups it has not
        consumed yet (in the stream or in its hands) and those in flight (the fleet's leases,
        ``leased``) must fit in ``(1 + max_lag) * groups_per_step`` places; a worker whose
        weights are some versions behind the learner's has that many steps' places fewer.
        With ``max_lag = 0`` this is the synchronous baseline. Dropped groups free their
        place, so the learner can always fill its batch.

        It counts what the learner *consumed* (``consumed`` in the learner hash, the groups
        its lineage trained), not its version: a restored learner labels its weights above
        every version it published and retrains the steps since its checkpoint, so its
        version runs ahead of its steps for the rest of the run. An allowance derived from
        the version was inflated by that gap after every restart (measured: staleness stuck
        at max_staleness and a quarter of the groups dropped).

        The places assume the learner trains groups in the order they were leased, and it
        trains them in the order they arrive: a fast worker's groups overtake a slow one's.
        With ``max_staleness`` they are also capped so that the oldest group in flight (each
        lease's version is kept in ``prompts:lease_versions``) still fits in a batch before the
        learner is more than ``max_staleness`` versions past it: at that point the fast workers
        wait and the learner waits for it. Without this, a worker slower than ``max_staleness``
        learner steps per group had every group it started dropped stale on arrival (issue 33:
        an fp16 worker beside a bf16 one trained none). So a slow worker paces the fleet, at
        worst, instead of being starved by it, and the groups it starts are trained.

        Under dynamic sampling the learner reads on past groups without a signal, so each place
        still free takes ``sample_ratio`` samples (groups sampled per group trained, as the
        learner measured it): the fleet may have ``(places - unconsumed) * sample_ratio`` in
        flight. It samples more per version, not further ahead: a step that lacks one group
        has about ``sample_ratio`` in flight for it, not ``sample_ratio`` steps' worth, whose
        surplus would arrive after the learner moved on and be dropped stale.
        """
        self._check_cursor()
        raw = self.scripts.hand_out(worker_id, wanted, backpressure)
        return Lease(allowance=int(raw[0]), prompts=[(int(raw[i]), int(raw[i + 1])) for i in range(3, len(raw), 2)],
                     unconsumed=int(raw[1]), fleet_leased=int(raw[2]))

    def _check_cursor(self) -> None:
        """Set back a cursor that is not a count below MAX_PROMPT_INDEX (rlpipe/queue_scripts.py _RESET_CURSOR)."""
        raw = self.r.get(self.keys.cursor)
        if raw is None or raw == b"0" or (raw[:1] != b"0" and raw.isdigit() and int(raw) < MAX_PROMPT_INDEX):
            return
        reset = self.scripts.reset_cursor()
        if reset is not None:
            log.warning("prompts:cursor was %r, not a count below %d: set back to %d, what the books say was handed "
                        "out at most", raw[:80], MAX_PROMPT_INDEX, reset)

    def next_prompt_index(self, worker_id: str) -> tuple[int, int]:
        """One prompt for ``worker_id``, without back-pressure (tools and tests)."""
        return self.lease_prompts(worker_id, 1).prompts[0]

    def give_back(self, worker_id: str, indices: list[int], count_as: str = "") -> int:
        """Re-issue prompt indices ``worker_id`` leased but will not push (only those it
        still holds: a zombie cannot give back what was re-issued). ``count_as``: a counter
        to add them to. Returns how many were given back."""
        if not indices:
            return 0
        return self.scripts.reissue(worker_id, "all", count_as, indices)

    def skip(self, worker_id: str, index: int) -> None:
        """Settle a leased prompt this worker cannot generate for (too long; failed twice
        here) without re-issuing it; counted in ``skipped``."""
        self.scripts.reissue(worker_id, "skip", "skipped", [index])

    def reward_failed(self, worker_id: str, index: int, counts: bool, limit: int, fields: dict) -> int | None:
        """Settle a leased prompt whose reward or environment failed, in one script: a failure that
        ``counts`` is added to the prompt's; below ``limit`` of them it goes back to be handed out
        again (any worker's), and at ``limit`` it is settled as dead: a dead letter of ``fields``
        (``reason`` among them) with its ``prompt_index`` and ``failures``, counted as produced,
        dead and ``dead_prompts``, its index marked in ``prompts:dropped``. A reward that failed on
        one prompt every time was given back and handed out again for ever (issue 33 item 12).
        Returns the prompt's counted failures, negated if it is now dead; None if ``worker_id``
        no longer held the lease (nothing to settle)."""
        return self.scripts.reward_failed(worker_id, index, counts, limit, fields)

    def reissue_all(self, worker_id: str, only_if_dead: bool = False) -> int:
        """Re-issue every lease of ``worker_id``: a restarted worker's from its previous
        life, or (``only_if_dead``) those of a worker whose registry entry expired."""
        return self.scripts.reissue(worker_id, "dead" if only_if_dead else "all", "reissued")

    def reclaim_dead(self) -> int:
        """Re-issue the leases of every worker whose heartbeat expired (SIGKILL, OOM, a
        lost node); the learner calls it while it waits for groups. Then forget lease
        versions no worker holds (rlpipe/queue_scripts.py _PRUNE_LEASE_VERSIONS): the learner may be waiting on one."""
        n = 0
        prefix = self.keys.lease_pattern[:-1]
        versions = self.r.zrange(self.keys.lease_versions, 0, 99)  # the oldest, before the leases are listed
        leases = []
        for key in self.r.scan_iter(match=self.keys.lease_pattern, count=100):
            leases.append(key)
            n += self.reissue_all(key.decode()[len(prefix):], only_if_dead=True)
        if versions and self.scripts.prune_lease_versions(leases, versions):
            log.warning("forgot lease versions no worker holds (written by hand, or by an older rlpipe)")
        return n

    def leased(self, worker_id: str) -> set[int]:
        return {int(i) for i in self.r.hkeys(self.keys.leases(worker_id))}

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

    def claim_pending(self, consumer: str, min_idle_ms: int) -> list[Entry]:
        """Take over entries another (dead) consumer read but never acknowledged, without
        counting a delivery (JUSTID): an entry counts a delivery only when it goes into a
        batch again (:meth:`deliver`), so a crash loop is pinned on the entries it trained."""
        ids = list(self._pending())
        claimed = []
        for start in range(0, len(ids), 500):
            claimed += self.r.xclaim(self.keys.traj, CONSUMER_GROUP, consumer, min_idle_ms,
                                     ids[start:start + 500], justid=True)
        pipe = self.r.pipeline(transaction=False)
        for entry_id in claimed:
            pipe.xrange(self.keys.traj, entry_id, entry_id)
        return self._decode([found[0] for found in pipe.execute() if found])

    def fields(self, entry_id: str) -> dict:
        """An entry's raw fields ({} if it is gone)."""
        found = self.r.xrange(self.keys.traj, entry_id, entry_id)
        return found[0][1] if found else {}

    def deliveries(self, consumer: str) -> dict[str, int]:
        """Entry id -> how many times it was delivered without an acknowledgement, for every
        entry pending for ``consumer``."""
        return {i: times for i, (owner, times) in self._pending().items() if owner == consumer}

    def _pending(self) -> dict[str, tuple[str, int]]:
        """Every pending entry: id -> (consumer, times delivered)."""
        out, start = {}, "-"
        while True:
            try:
                rows = self.r.xpending_range(self.keys.traj, CONSUMER_GROUP, start, "+", 1000)
            except redis.ResponseError:  # no consumer group yet
                return out
            for row in rows:
                out[_str(row["message_id"])] = (_str(row["consumer"]), int(row["times_delivered"]))
            if len(rows) < 1000:
                return out
            start = "(" + _str(rows[-1]["message_id"])

    def deliver(self, consumer: str, entry_ids: list[str]) -> None:
        """Count one more delivery of pending entries (they go into a batch, or are tried alone)."""
        if entry_ids:
            self.r.xclaim(self.keys.traj, CONSUMER_GROUP, consumer, 0, entry_ids)

    def set_deliveries(self, consumer: str, entry_ids: list[str], times: int) -> None:
        """Set pending entries' delivery count (an entry tried alone that did not crash the
        learner is as innocent as one read once)."""
        if entry_ids:
            self.r.xclaim(self.keys.traj, CONSUMER_GROUP, consumer, 0, entry_ids, retrycount=times, justid=True)

    def _counted(self, entry_ids: list[str]) -> list[bool]:
        """Whether each entry was counted as produced by a push (see ``Keys.counted``)."""
        pipe = self.r.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.sismember(self.keys.counted, entry_id)
        return [bool(x) for x in pipe.execute()]

    def _decode(self, raw_entries) -> list[Entry]:
        out = []
        handed_out = None
        raw_entries = [(_str(entry_id), fields) for entry_id, fields in raw_entries if fields is not None]
        for (entry_id, fields), counted in zip(raw_entries, self._counted([i for i, _ in raw_entries])):
            try:
                if b"data" not in fields:
                    raise SchemaError("data: missing field")
                rec = decode_group(fields[b"data"])
                if not counted:  # whatever its fields say
                    raise SchemaError("foreign entry: not added by rlpipe's push (a raw XADD?), so never counted "
                                      "as produced")
                if self.check is not None:
                    if handed_out is None:
                        # unreadable (overwritten): any index is admitted up to the limit
                        handed_out = number(self.r.get(self.keys.cursor), "prompts:cursor", MAX_PROMPT_INDEX, low=0)
                    reissued = number(self.r.hget(self.keys.attempts, rec.prompt_index), "prompts:attempts", 0,
                                      low=0) if rec.attempt else 0
                    self.check.check(rec, handed_out, reissued)
            except SchemaError as e:
                self.dead_letter(entry_id, fields, str(e))
                continue
            out.append(Entry(entry_id, rec))
        return out

    def dead_letter(self, entry_id: str, fields: dict, reason: str) -> None:
        """Move an entry to the dead letters with its reason; an entry never counted as
        produced (foreign, see ``Keys.counted``) is counted now, so the books stay balanced."""
        log.warning("dead-lettered stream entry %s: %s", entry_id, reason)
        self.scripts.dead_letter(self.fence, entry_id, fields, reason)

    def ack(self, trained: list[str], dropped_stale: list[Entry] = (), duplicate: list[str] = (),
            filtered: list[Entry] = ()) -> None:
        """Remove finished entries and count them, atomically; a dropped group's prompt is
        marked in the ``prompts:dropped`` bitmap, the run's durable record of drops (they
        are final at once, between the learner's checkpoints). ``duplicate``: groups for a
        prompt the learner's lineage already settled. Only entries still in the stream are
        counted: after a Redis restart lost an entry's push, the learner may hold it and
        acknowledge it, and counting it would break the books. ``filtered``: groups whose
        rewards are all equal (dynamic sampling), settled untrained like a drop."""
        if trained or dropped_stale or duplicate or filtered:
            self.scripts.ack(self.fence, trained, [e.entry_id for e in dropped_stale], duplicate,
                             [e.entry_id for e in filtered],
                             [e.record.prompt_index for e in [*dropped_stale, *filtered]])

    def missing(self, entry_ids: list[str]) -> set[str]:
        """Those of ``entry_ids`` no longer in the stream (after a Redis restart: pushes it lost)."""
        pipe = self.r.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xrange(self.keys.traj, entry_id, entry_id)
        return {entry_id for entry_id, found in zip(entry_ids, pipe.execute()) if not found}

    def dropped_indices(self) -> IndexSet:
        return IndexSet(self.r.get(self.keys.dropped) or b"")

    # -- accounting ----------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        raw = self.r.hgetall(self.keys.counters)
        out = dict.fromkeys(COUNTERS, 0)
        out.update({k.decode(): int(v) for k, v in raw.items()})
        return out

    def rederive_counters(self, trained: int, unacked: list[str] = ()) -> tuple[int, int, int, int]:
        """Make the books agree with what survives: ``trained`` from the learner's lineage
        (the groups it trained, less those of ``unacked``, trained but awaiting
        acknowledgement, that are still in the stream) and ``produced`` from the stream.
        After a Redis restart that lost writes (AOF everysec: up to about a second) they may
        not agree; each difference is added to ``lost_writes``. A trained group whose push
        Redis lost counts as produced and trained, so back-pressure, which compares the
        lineage's consumed count with the counters, stays exact. Returns
        ``(trained was, trained now, produced was, produced now)``."""
        return self.scripts.rederive(trained, unacked)

    def length(self) -> int:
        return int(self.r.xlen(self.keys.traj))

    def pending(self) -> int:
        """Entries delivered to a consumer but not yet acknowledged."""
        try:
            return int(self.r.xpending(self.keys.traj, CONSUMER_GROUP)["pending"])
        except redis.ResponseError:  # no group yet
            return 0


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else value
