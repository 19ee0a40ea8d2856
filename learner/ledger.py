"""The learner's exactly-once bookkeeping (rank 0): what it read, trained, dropped and
acknowledged, kept apart from the training loop (learner/train.py).

- **Acknowledged only once durable.** Trained entries wait in ``unacked`` until a
  checkpoint holding their step starts (``being_written``) and is durable
  (:meth:`Ledger.durable`); then XACK + XDEL, counted as trained. The checkpoint lists the
  group ids it trained since the previous one, so a restarted learner acknowledges those
  and trains the rest (:meth:`Ledger.take_over_pending`).
- **Each prompt settled once.** ``trained_indices`` (the lineage's, in every checkpoint)
  and ``dropped_indices`` (the run's, in Redis): a second group for a settled prompt is a
  duplicate, acknowledged untrained.
- **Redis restarts.** A restarted Redis may have lost the last second of writes: reads,
  acknowledgements, pushes. :meth:`Ledger.after_redis_restart` redoes them.
- **Poison.** An entry that kills the learner on every delivery would crash-loop it: each
  restart takes it over again. Deliveries are counted by the consumer group, but only when
  an entry goes into a batch (take-overs count none), and an entry that was delivered more
  than once is first tried alone (``try_alone``, a forward of that group) and its count
  reset if the learner survives. So a crash loop is pinned on the entry that causes it,
  which is dead-lettered as poison after ``queue.max_deliveries`` deliveries, and the
  innocent entries of the batches it crashed are trained.
- **Fenced.** Every acknowledgement and dead letter carries the lease epoch
  (rlpipe/fence.py): a learner that lost its lease cannot settle what its successor owns.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from learner import checkpoint
from learner.checkpoint import RunCounters
from rlpipe.index_set import IndexSet
from rlpipe.queue import Entry, TrajectoryQueue
from rlpipe.redis_link import RestartWatch

log = logging.getLogger(__name__)

RECENT_ACKS_S = 30.0  # how long the learner remembers what it acknowledged (a lost write is redone)


class Ledger:
    consumer = "learner-0"

    def __init__(self, cfg, queue: TrajectoryQueue, counters: RunCounters, dropped_stale_metric,
                 try_alone: Callable[[Entry], None]):
        self.cfg, self.queue, self.counters = cfg, queue, counters
        self.dropped_stale_metric, self.try_alone = dropped_stale_metric, try_alone
        self.redis_restarts = RestartWatch(queue.r)
        self.trained_indices, self.dropped_indices = IndexSet(), IndexSet()
        self.dropped_this_step = 0  # while collecting the next batch: the drop rate per step
        self.filtered_this_step = 0  # groups with equal rewards settled while collecting it (dynamic sampling)
        self.filtered_rewards: list[float] = []  # their samples' rewards: the reward of all that was sampled
        self.backlog: list[Entry] = []  # read (or taken over), not in a batch yet
        self.unacked: list[Entry] = []  # trained, waiting for a checkpoint
        self.being_written: list[Entry] = []  # trained, in the checkpoint being written
        self.suspects: set[str] = set()  # taken-over entries delivered more than once: tried alone first
        self.trained_before_restart: set[str] = set()  # the restored checkpoint's group ids
        # The entries acknowledged lately (id -> how), to acknowledge again the same way if a
        # restarted Redis lost the acknowledgement; and when dead workers' leases may be re-issued.
        self.recent_acks: dict[str, tuple[str, float]] = {}
        self.reclaim_after = 0.0

    # -- reading ------------------------------------------------------------------------
    def collect(self, want: int, stopping: Callable[[], bool], between_reads: Callable[[], None],
                make_durable: Callable[[], None]) -> list[Entry] | None:
        """Block until ``want`` groups fresh enough to train on are in hand (None if a stop
        was requested meanwhile; what was read stays pending). Too-stale groups are dropped
        and duplicates acknowledged on the way; ``make_durable`` checkpoints what is trained
        when a duplicate's twin is not durable yet."""
        batch: list[Entry] = []
        deferred: list[Entry] = []
        while len(batch) < want:
            if stopping():
                return None
            between_reads()
            if self.backlog:
                entries, self.backlog = self.backlog[: want - len(batch)], self.backlog[want - len(batch):]
                entries = self._deliver_again(entries)
            else:
                entries = self.queue.read(self.consumer, want - len(batch), self.cfg.learner.read_block_ms)
            if self.redis_restarts.restarted():  # Redis restarted meanwhile: these may be replays
                self.backlog, deferred = entries + deferred + self.backlog, []
                self.after_redis_restart(batch)
                continue
            fresh, stale, duplicate, later, filtered = self._sort(entries, batch)
            deferred += later
            not_durable = {u.record.prompt_index for u in self.not_durable()} if duplicate else set()
            if any(e.record.prompt_index in not_durable for e in duplicate):
                # A twin trained since the last durable checkpoint may be the prompt's only copy
                # (Redis lost its push): make it durable before the duplicate goes.
                make_durable()
            if stale or duplicate or filtered:
                self._drop(stale, duplicate, filtered)
            batch += fresh
        self.backlog = list({e.entry_id: e for e in deferred + self.backlog}.values())
        return batch

    def _sort(self, entries: list[Entry], batch: list[Entry]):
        """``entries`` as (fresh, stale, duplicate, later, filtered): a twin of a prompt already
        in the batch waits (decided after this batch); with ``learner.dynamic_sampling`` a fresh
        group whose rewards are all equal is filtered (it carries no advantage, whatever the
        weights: settling it at once is final)."""
        fresh, stale, duplicate, later, filtered = [], [], [], [], []
        dynamic = self.cfg.learner.dynamic_sampling
        in_batch = {e.record.prompt_index for e in batch}
        for e in entries:
            index = e.record.prompt_index
            if index >= 0 and index in in_batch:
                later.append(e)
            elif index >= 0 and (index in self.trained_indices or index in self.dropped_indices):
                duplicate.append(e)
            else:
                in_batch.add(index)
                too_old = self.counters.version - e.record.oldest_version > self.cfg.queue.staleness_bound
                no_signal = dynamic and not too_old and len(set(e.record.rewards)) <= 1
                (stale if too_old else filtered if no_signal else fresh).append(e)
        return fresh, stale, duplicate, later, filtered

    def _drop(self, stale: list[Entry], duplicate: list[Entry], filtered: list[Entry] = ()) -> None:
        """A drop is final whatever happens to the weights later: acknowledged at once. So is a
        filtered group's (its prompt marked settled like a drop's: never trained, never lost)."""
        self.ack([], stale, duplicate, filtered)
        for e in [*stale, *filtered]:
            self.dropped_indices.add(e.record.prompt_index)
        self.filtered_this_step += len(filtered)
        self.filtered_rewards += [r for e in filtered for r in e.record.rewards]
        self.counters.filtered_total += len(filtered)
        self.counters.dropped_stale_total += len(stale)
        self.dropped_this_step += len(stale)
        for e in stale:
            by = self.counters.dropped_stale_by_precision
            by[e.record.precision] = by.get(e.record.precision, 0) + 1
        self.dropped_stale_metric.inc(len(stale))
        if stale:
            log.info("dropped %d groups older than %d versions", len(stale), self.cfg.queue.staleness_bound)
        if duplicate:
            log.warning("acknowledged %d duplicate groups (prompts %s already settled) without training them",
                        len(duplicate), sorted(e.record.prompt_index for e in duplicate))

    def _deliver_again(self, entries: list[Entry]) -> list[Entry]:
        """Backlog entries going into a batch: each counts a delivery. A suspect (delivered
        more than once without an acknowledgement) is tried alone first; if that kills the
        learner, its count alone grows, and its next take-over dead-letters it as poison."""
        for e in sorted((e for e in entries if e.entry_id in self.suspects), key=lambda e: e.entry_id):
            self.queue.deliver(self.consumer, [e.entry_id])
            self.try_alone(e)
            self.queue.set_deliveries(self.consumer, [e.entry_id], 1)  # innocent: as if read once
            self.suspects.discard(e.entry_id)
        self.queue.deliver(self.consumer, [e.entry_id for e in entries])
        return entries

    def sampling_metrics(self, entries: list[Entry]) -> dict:
        """Dynamic sampling's books for the step just trained: the groups filtered while
        collecting it (equal rewards), the informative fraction, and groups sampled per group
        trained, whose smoothed value the learner publishes as ``sample_ratio``: it scales the
        fleet's allowance (rlpipe/queue.py), so the fleet generates enough groups for the next
        steps while the learner trains, instead of idling behind a stream of groups to filter."""
        filtered, self.filtered_this_step = self.filtered_this_step, 0
        trained = len(entries)
        sampled = trained + filtered
        # The trained groups' reward is conditioned on a spread; this one, over everything the step
        # read, is the policy's own (the trend to watch under dynamic sampling).
        rewards = [r for e in entries for r in e.record.rewards] + self.filtered_rewards
        self.filtered_rewards = []
        ratio = sampled / max(trained, 1)
        c = self.counters
        if self.cfg.learner.dynamic_sampling:
            # The first step's ratio is the first measurement: it replaces the prior of 1 rather than
            # being smoothed into it (a SmolLM2 run at 1 in 4 took 8 steps to let its fleet run ahead,
            # and its learner waited 100 s for step 1's groups).
            c.sample_ratio = ratio if c.step <= 1 else 0.7 * c.sample_ratio + 0.3 * ratio
        return {"groups_filtered_step": filtered, "groups_filtered_total": c.filtered_total,
                "informative_fraction": trained / max(sampled, 1), "groups_sampled_per_trained": ratio,
                "reward_sampled_mean": sum(rewards) / max(len(rewards), 1),
                "sample_ratio_smoothed": c.sample_ratio}

    # -- settling -----------------------------------------------------------------------
    def trained(self, entries: list[Entry]) -> None:
        self.unacked += entries
        self.counters.trained_groups += len(entries)
        for e in entries:
            self.trained_indices.add(e.record.prompt_index)
            by = self.counters.trained_by_precision
            by[e.record.precision] = by.get(e.record.precision, 0) + 1
        self.counters.trained_digest = (self.counters.trained_digest + checkpoint.group_digest(
            e.record.group_id for e in entries)) % (1 << 64)

    def checkpoint_started(self) -> None:
        """A checkpoint of the current step is being written (one at a time): what it
        covers waits in ``being_written`` until :meth:`durable`."""
        assert not self.being_written, "one checkpoint write at a time"
        self.being_written, self.unacked = self.unacked, []

    def durable(self) -> None:
        """The checkpoint being written is durable: acknowledge what it covers."""
        entries, self.being_written = self.being_written, []
        self.ack(entries)

    def not_durable(self) -> list[Entry]:
        """Trained entries no durable checkpoint covers yet."""
        return self.unacked + self.being_written

    def ack(self, trained: list[Entry], stale: list[Entry] = (), duplicate: list[Entry] = (),
            filtered: list[Entry] = ()) -> None:
        self.queue.ack([e.entry_id for e in trained], stale, [e.entry_id for e in duplicate], filtered)
        now = time.monotonic()  # the last RECENT_ACKS_S of them: far more than an AOF can lose
        self.recent_acks = {k: (how, t) for k, (how, t) in self.recent_acks.items() if now - t < RECENT_ACKS_S}
        for how, entries in (("trained", trained), ("stale", stale), ("duplicate", duplicate),
                             ("filtered", filtered)):
            self.recent_acks.update((e.entry_id, (how, now)) for e in entries)

    # -- restarts -----------------------------------------------------------------------
    def take_over_pending(self) -> None:
        """Entries read by a previous learner and never acknowledged: the ones its last
        checkpoint trained are acknowledged now; poison is dead-lettered; the rest are
        trained again, suspects tried alone first."""
        self.queue.ensure_consumer_group()
        pending = self.queue.claim_pending(self.consumer, min_idle_ms=0)
        deliveries = self.queue.deliveries(self.consumer)
        done = [e for e in pending if e.record.group_id in self.trained_before_restart]
        rest = [e for e in pending if e.record.group_id not in self.trained_before_restart]
        self.queue.ack([e.entry_id for e in done])
        limit = self.cfg.queue.max_deliveries
        for e in rest:
            times = deliveries.get(e.entry_id, 0)
            if times >= limit:
                log.error("entry %s (group %s from %s) was delivered %d times and never acknowledged: the learner "
                          "died with it every time; dead-lettered as poison", e.entry_id, e.record.group_id,
                          e.record.worker_id, times)
                self.queue.dead_letter(e.entry_id, self.queue.fields(e.entry_id),
                                       f"poison: delivered {times} times without an acknowledgement")
            else:
                self.backlog.append(e)
                if times >= 2:
                    self.suspects.add(e.entry_id)
        self.dropped_indices = self.queue.dropped_indices()
        was_t, now_t, was_p, now_p = self.queue.rederive_counters(self.counters.trained_groups)
        if (was_t, was_p) != (now_t, now_p):
            log.warning("counters re-derived from the lineage and the stream: trained %d -> %d, produced %d -> %d",
                        was_t, now_t, was_p, now_p)
        if pending:
            log.info("took over %d pending groups: %d already trained, %d to train (%d to try alone first)",
                     len(pending), len(done), len(self.backlog), len(self.suspects))

    def after_redis_restart(self, batch: list[Entry]) -> None:
        """Redis restarted: its AOF may have lost the last second of writes (everysec).
        Put things back as they were:

        - entries this learner read or acknowledged, whose read or acknowledgement was lost,
          are pending for it again: acknowledged the same way again, or trained;
        - what it holds untrained whose push Redis lost is pushed again;
        - the books are re-derived from the lineage and the stream (``lost_writes``);
        - dead workers' leases wait a heartbeat TTL, so a live worker whose heartbeat was
          lost is not taken for dead.
        """
        self.reclaim_after = time.monotonic() + self.cfg.rollout.heartbeat_ttl_s
        self.on_redis_restart()
        held = {e.entry_id for e in self.not_durable() + batch}
        seen: dict[str, Entry] = {}
        for e in self.backlog + self.queue.claim_pending(self.consumer, min_idle_ms=0) + self._read_all_new():
            if e.entry_id not in held:
                seen.setdefault(e.entry_id, e)
        again = {how: [e for e in seen.values() if self.recent_acks.get(e.entry_id, ("",))[0] == how]
                 for how in ("trained", "stale", "duplicate", "filtered")}
        self.ack(again["trained"], again["stale"], again["duplicate"], again["filtered"])
        self.backlog = [e for e in seen.values() if e.entry_id not in self.recent_acks]
        # What this learner holds untrained (the batch it is collecting, its backlog) whose
        # stream entry Redis lost goes back into the stream and is read again like any other
        # entry. Trained from memory, its acknowledgement would count nothing while the
        # lineage's consumed count grew: one back-pressure place too many for the rest of
        # the run (measured: a group at staleness max_lag + 1 in every later step).
        lost = self.queue.missing([e.entry_id for e in batch + self.backlog])
        for e in batch + self.backlog:
            if e.entry_id in lost:
                self.queue.push(e.record)
        batch[:] = [e for e in batch if e.entry_id not in lost]
        self.backlog = [e for e in self.backlog if e.entry_id not in lost]
        # Before anything else is acknowledged: what the lineage trained that Redis forgot
        # (its push was lost after this learner read it) is counted as produced and trained.
        was_t, now_t, was_p, now_p = self.queue.rederive_counters(self.counters.trained_groups,
                                                                  [e.entry_id for e in self.not_durable()])
        log.warning("Redis restarted: %d acknowledgements redone, %d entries to read, %d it lost pushed again; "
                    "counters trained %d -> %d, produced %d -> %d", sum(map(len, again.values())),
                    len(self.backlog), len(lost), was_t, now_t, was_p, now_p)

    def on_redis_restart(self) -> None:
        """Set by the learner: what else a Redis restart resets (the weight sync re-forms)."""

    def _read_all_new(self) -> list[Entry]:
        out = []
        while chunk := self.queue.read(self.consumer, 1000, block_ms=None):
            out += chunk
        return out
