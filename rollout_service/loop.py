"""The rollout loop of one worker: take prompts, generate groups, push them to the stream.
What one prompt's group is made of (generated, scored, written as a record) is
rollout_service/groups.py's; this module decides when groups start, and what becomes of them.

Three asyncio tasks share the engine:

- the dispatcher keeps up to ``max_inflight_groups`` groups generating at once
  (continuous batching happens inside vLLM), within the back-pressure allowance, less the
  slots ``/v1/generate`` requests hold (at most the part ``rollout.loop_share`` leaves them);
- the sync follower (weight_sync/follower.py) joins new sync generations and applies
  new versions in flight;
- the heartbeat keeps this worker in the registry.

Redis calls are synchronous (they take well under a millisecond on loopback) and run in
a thread so the event loop never waits on the network.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

import redis

from rlpipe import checkpoints, registry
from rlpipe.config import RunConfig
from rlpipe.faults import GROUP_DELAY_ENV, injected_delay
from rlpipe.queue import TrajectoryQueue
from rlpipe.redis_link import RedisUnavailable, RestartWatch
from rollout_service.engine import RolloutEngine, WeightsCorrupted
from rollout_service.groups import Group, GroupGenerator
from rollout_service.metrics import RolloutMetrics
from rollout_service.tasks import BadRewardResult, RewardError, RewardUnavailable, Task
from weight_sync.follower import Checkpoint, Synced, WeightFollower

log = logging.getLogger(__name__)

# A loop that generates without pushing a group for STALL_FLOOR_S plus a sample's longest
# generation at MIN_TOKENS_PER_S is stuck (/healthz says so); a reward or environment whose
# abandoned calls stay at their bound for STUCK_EXIT_S stops the worker, for a restart: only
# a new process frees threads that never end.
STALL_FLOOR_S = 600.0
MIN_TOKENS_PER_S = 10.0
STUCK_EXIT_S = 30.0  # then the supervisor (rlpipe up, a Kubernetes pod) restarts it within the minute


class Watchdog:
    """Whether a rollout loop makes progress, for /healthz (issue 33 item 12: a hung reward
    stopped training for good while the probes said ok)."""

    def __init__(self, loop: RolloutLoop):
        self.loop = loop
        self.progress = (time.time(), 0.0)  # (wall-clock time, the loop's idle seconds) at the last push
        self.calls_stuck_since: float | None = None  # monotonic time the reward's or environment's calls stuck

    def progressed(self) -> None:
        """A group was pushed or settled: the stall clock starts again."""
        self.progress = (time.time(), self.loop.idle_seconds())

    def busy_without_push(self, now: float | None = None) -> float:
        """Seconds with groups in flight (idle time not counted) since a group was last pushed
        or settled: it grows while every group hangs or fails, and only then."""
        now = now or time.time()
        at, idle = self.progress
        return max(0.0, (now - at) - (self.loop.idle_seconds(now) - idle))

    def stall_limit_s(self) -> float:
        """How long :meth:`busy_without_push` may grow before the loop counts as stuck."""
        cfg = self.loop.cfg
        turns = cfg.rollout.session_max_turns if self.loop.generator.episodes is not None else 1
        return STALL_FLOOR_S + cfg.sampling.max_tokens * turns / MIN_TOKENS_PER_S

    def calls_stuck(self) -> str | None:
        """Why the task's reward or the environment takes no more calls (too many abandoned, still running)."""
        return getattr(self.loop.task, "stuck", None) or getattr(self.loop.generator.episodes, "stuck", None)

    def stuck(self, now: float | None = None) -> str | None:
        """Why the loop cannot make progress, or None: its reward's or environment's calls are
        stuck, or it has generated for :meth:`stall_limit_s` without pushing a group."""
        why = self.calls_stuck()
        if why:
            return why
        busy, limit = self.busy_without_push(now), self.stall_limit_s()
        if busy > limit:
            return f"no group pushed or settled in {busy:.0f} s of generating (over {limit:.0f} s)"
        return None

    def check_calls(self) -> None:
        """Stop the worker when the reward's or environment's calls stayed stuck STUCK_EXIT_S
        (the heartbeat calls it)."""
        why, now = self.calls_stuck(), time.monotonic()
        if why is None:
            self.calls_stuck_since = None
        elif self.calls_stuck_since is None:
            self.calls_stuck_since = now
            log.error("%s: calls are refused until they end", why)
        elif now - self.calls_stuck_since > STUCK_EXIT_S:
            self.loop.on_fatal(f"{why} for {STUCK_EXIT_S:.0f} s: a restart frees them")


class FailedGroups:
    """What becomes of a prompt whose group will not be pushed: it goes back to be handed out
    again, or is settled for good (skipped, or dead-lettered) when it cannot succeed."""

    def __init__(self, loop: RolloutLoop):
        self.loop = loop
        self.here: set[int] = set()  # prompt indices whose group failed once on this worker
        # Whether the reward (or environment) has worked on a group here since a failure last counted
        # against its prompt: a failure counts only then, so an outage counts once at most (reward_failed).
        self.reward_worked = False

    async def __call__(self, group: Group, e: Exception) -> None:
        """A reward or environment that timed out or raised is :meth:`reward_failed`'s; any other
        failure gives the prompt back once: a prompt that failed twice here (one the engine or the
        record cannot take, or whose reward's result no record can take) is skipped."""
        loop, index = self.loop, group.index
        loop.last_error = f"prompt {index}: {e!r}"
        log.error("group for prompt %d failed: %r", index, e)
        group.phase = "failed"
        if isinstance(e, RewardError):
            loop.metrics.reward_errors.inc()
        if isinstance(e, RewardError) and not isinstance(e, BadRewardResult):
            await self.reward_failed(group, e)
            return
        if index in self.here:
            loop.metrics.prompts_skipped.inc()
            await asyncio.to_thread(loop.queue.skip, loop.worker_id, index)
            return
        self.here.add(index)
        await asyncio.to_thread(loop.queue.give_back, loop.worker_id, [index])
        loop.metrics.prompts_given_back.inc()

    async def reward_failed(self, group: Group, e: RewardError) -> None:
        """The reward or environment timed out or raised on a group: the prompt goes back, and
        after ``queue.max_deliveries`` failures counted against it (on any worker) it is settled
        as dead, with a dead letter naming the error (TrajectoryQueue.reward_failed); it was
        given back for ever, pausing its worker 2 s each time (issue 33 item 12). A failure
        counts only if the reward has worked on a group here since one last counted, and never
        while it takes no calls (RewardUnavailable): a verifier that is down fails on every
        prompt, which says nothing about them, and counts once at most per outage."""
        loop = self.loop
        loop.pause_until = time.monotonic() + 2.0  # let the verifier recover
        counts = self.reward_worked and not isinstance(e, RewardUnavailable)
        if counts:
            self.reward_worked = False
        limit = loop.cfg.queue.max_deliveries
        reason = f"{e} ({limit} failures, queue.max_deliveries)"
        fields = {"reason": reason, "prompt_id": self.prompt_id(group.index), "worker_id": loop.worker_id}
        failures = await asyncio.to_thread(loop.queue.reward_failed, loop.worker_id, group.index, counts, limit, fields)
        if failures is None:
            return  # re-issued meanwhile (this worker's heartbeat had expired): not ours to settle
        if failures < 0:
            loop.metrics.prompts_dead.inc()
            loop.watch.progressed()  # settled
            log.error("prompt %d dead-lettered: %s", group.index, reason)
        else:
            loop.metrics.prompts_given_back.inc()

    def prompt_id(self, index: int) -> str:
        """The dataset row id of prompt ``index``, for its dead letter ('' if the task cannot say)."""
        try:
            return str(self.loop.task.prompt(index).prompt_id)
        except Exception:  # noqa: BLE001 - a dead letter is written whatever the task says
            return ""


class RolloutLoop:
    """Leases prompts within the back-pressure allowance, keeps their groups in flight, pushes or
    gives back what they become, and keeps this worker's weight sync and registry entry going."""

    def __init__(self, cfg: RunConfig, worker_id: str, address: str, engine: RolloutEngine,
                 queue: TrajectoryQueue, task: Task, tokenizer, metrics: RolloutMetrics,
                 on_fatal: Callable[[str], None], api_slots: Callable[[], int] = lambda: 0):
        self.cfg = cfg
        self.worker_id = worker_id
        self.address = address
        self.engine = engine
        self.queue = queue
        self.r = queue.r
        self.keys = queue.keys
        self.task = task
        self.metrics = metrics
        # what a prompt becomes: its group, generated, scored and written as a record (rollout_service/groups.py)
        self.generator = GroupGenerator(cfg, worker_id, engine, task, tokenizer, metrics)
        self.on_fatal = on_fatal  # called once when this worker cannot go on (its engine died)
        self.api_slots = api_slots  # group slots /v1/generate holds now (rollout_service.worker.ApiShare)
        # Weight sync: follows the learner's generations on this precision's channel.
        self.follower = WeightFollower(
            self.r, self.keys.sync_channel(cfg.rollout.channel(cfg.rollout.precision)), worker_id, engine,
            cfg.sync.timeout_s, self._latest_checkpoint, self._synced, self._sync_failed, self._publish_incarnation,
            fatal=(WeightsCorrupted,))
        self.last_sync: dict = {}
        self.stopping = asyncio.Event()
        self.groups: dict[asyncio.Task, Group] = {}
        self.tasks: list[asyncio.Task] = []
        self.last_error: str | None = None
        self.backlog: dict = {}  # what the last back-pressure check saw (for /v1/status)
        self.pause_until = 0.0  # monotonic time before which no group starts (after a reward error)
        self.failed = FailedGroups(self)  # what becomes of a prompt whose group will not be pushed
        self.redis_restarts = RestartWatch(self.r, every_s=0.25)  # see _after_redis_restart
        # Idle time: seconds with no group in flight while serving (held by back-pressure, or
        # waiting for weights), as (ended periods' total, wall-clock start of the current one or
        # None), replaced as one tuple so a thread publishing it never sees half an update.
        self._idle: tuple[float, float | None] = (0.0, time.time())
        self._idle_exported = 0.0  # how much of it the Prometheus counter holds
        self.watch = Watchdog(self)

    def start(self) -> None:
        # Prompts leased by this worker id's previous life (killed before it pushed them) go back now.
        reissued = self.queue.reissue_all(self.worker_id)
        if reissued:
            log.warning("re-issued %d prompts my previous run leased and never pushed", reissued)
        self.dispatcher = asyncio.create_task(self._dispatch())
        self.tasks = [self.dispatcher] + [asyncio.create_task(c) for c in (self._follow_sync(), self._heartbeat())]

    async def stop(self, deadline_s: float | None = None) -> None:
        """Graceful shutdown: take no more prompts, give in-flight groups ``deadline_s``
        to finish and be pushed, abort the rest and give their prompts back to the cursor.
        Groups already being pushed always complete."""
        deadline_s = self.cfg.rollout.shutdown_deadline_s if deadline_s is None else deadline_s
        self.stopping.set()
        log.info("stopping: %d groups in flight, %.1fs to finish", len(self.groups), deadline_s)
        # The dispatcher may be between taking an index and starting its group: let it finish.
        await asyncio.wait([self.dispatcher], timeout=5)
        if self.groups:
            await asyncio.wait(list(self.groups), timeout=deadline_s)
        aborted = [(t, g) for t, g in self.groups.items() if g.phase in ("generating", "scoring")]
        for t, _ in aborted:
            t.cancel()
        await asyncio.gather(*self.groups, return_exceptions=True)
        if aborted:
            indices = [g.index for _, g in aborted]
            await asyncio.to_thread(self.queue.give_back, self.worker_id, indices)
            self.metrics.prompts_given_back.inc(len(indices))
            log.info("shutdown: gave back %d unfinished prompts %s", len(indices), indices)
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.task.aclose()
        await asyncio.to_thread(registry.remove_worker, self.r, self.keys, self.worker_id)

    # -- dispatcher -------------------------------------------------------------------
    async def _dispatch(self) -> None:
        while not self.stopping.is_set():
            if self.engine.errored:
                self.on_fatal(f"engine died: {self.engine.llm.dead_error!r}")
                return
            # The API's requests count against the same slots; ApiShare bounds them so that
            # ceil(rollout.loop_share * max_inflight_groups) slots always stay the loop's.
            free = self.cfg.rollout.max_inflight_groups - len(self.groups) - self.api_slots()
            if free <= 0 or not self.engine.synced or time.monotonic() < self.pause_until:
                await asyncio.sleep(0.02)
                continue
            try:
                if await asyncio.to_thread(self.redis_restarts.restarted):
                    await asyncio.to_thread(self._after_redis_restart)
                leased = await asyncio.to_thread(self._lease, free)
                if not leased:
                    self.metrics.backpressure_waits.inc()
                    await asyncio.sleep(0.05)
                    continue
                for index, attempt in leased:
                    group = Group(index, attempt)
                    task = asyncio.create_task(self._run_group(group))
                    self._enter(task, group)
                    task.add_done_callback(self._group_done)
                self.metrics.inflight.set(len(self.groups))
                await asyncio.to_thread(self._publish)
            except RedisUnavailable as e:  # away longer than redis_wait_s: exit, a supervisor restarts us
                self.on_fatal(str(e))
                return
            except (redis.RedisError, OSError) as e:  # Redis away for a moment: keep the engine, retry
                log.warning("dispatcher: %r; retrying", e)
                await asyncio.sleep(1.0)
            await asyncio.sleep(0)

    def _after_redis_restart(self) -> None:
        """A restarted Redis may have lost its last second of writes (AOF everysec). A lease
        this worker holds for a prompt it no longer has in flight means its push (or
        give-back) was lost: the prompt is re-issued and counted in ``lost_writes``. (The
        opposite, a group in flight whose lease was lost, is refused at push and counted
        in ``rejected_push``; its prompt was handed out again.) Runs in the dispatcher, the
        only task that takes leases, so no hand-out is between lease and in-flight here."""
        orphans = self.queue.leased(self.worker_id) - {g.index for g in self.groups.values()}
        if orphans:
            n = self.queue.give_back(self.worker_id, sorted(orphans), count_as="lost_writes")
            log.warning("Redis restarted and lost %d of my pushes: re-issued prompts %s", n, sorted(orphans))

    def _lease(self, free: int) -> list[tuple[int, int]]:
        """Lease up to ``free`` prompts within the back-pressure allowance (one script with
        the hand-out: rlpipe.queue.TrajectoryQueue.lease_prompts), which also waits for the
        fleet's oldest group in flight before it would be too stale to train."""
        learner_version = registry.learner_version(self.r, self.keys)
        if self.engine.weights_source != "learner" and self.engine.version < learner_version:
            return []  # a new or restarted worker waits for the current weights, not a checkpoint's older ones
        q = self.cfg.queue
        lease = self.queue.lease_prompts(
            self.worker_id, free, (self.engine.version, self.cfg.learner.groups_per_step, q.max_lag, q.staleness_bound))
        self.backlog = {"learner_version": learner_version, "unconsumed_groups": lease.unconsumed,
                        "lag_steps": round(lease.unconsumed / self.cfg.learner.groups_per_step, 3),
                        "fleet_inflight_groups": lease.fleet_leased, "allowance": lease.allowance}
        return lease.prompts

    def _enter(self, task: asyncio.Task, group: Group) -> None:
        """A group is in flight: an idle period (none were) ends now."""
        closed, since = self._idle
        if since is not None:
            self._idle = (closed + max(0.0, time.time() - since), None)
        self.groups[task] = group

    def _leave(self, task: asyncio.Task) -> None:
        """A group left the in-flight set: with none left, an idle period begins now."""
        if self.groups.pop(task, None) is not None and not self.groups:
            self._idle = (self._idle[0], time.time())

    def idle_seconds(self, now: float | None = None) -> float:
        """Seconds this worker has had no group in flight since it began serving, up to ``now``;
        brings the Prometheus counter ``rlpipe_rollout_idle_seconds_total`` up to date."""
        closed, since = self._idle
        total = closed + (max(0.0, (now or time.time()) - since) if since is not None else 0.0)
        if total > self._idle_exported:
            self.metrics.idle_seconds.inc(total - self._idle_exported)
            self._idle_exported = total
        return total

    def _group_done(self, task: asyncio.Task) -> None:
        self._leave(task)
        self.metrics.inflight.set(len(self.groups))
        if not task.cancelled() and task.exception() is not None:  # Redis gone past redis_wait_s mid-push
            self.last_error = repr(task.exception())
            log.error("group task failed: %r", task.exception())

    async def _run_group(self, group: Group) -> None:
        """Generate, score and push one group. A group that fails before its push is done
        gives its prompt back (FailedGroups), whatever failed, the push included: a push
        refused before it reached Redis (msgpack or the schema refused the record) once kept
        its lease for good, and 32 of them held the whole allowance (issue 33 item 12)."""
        index = group.index
        try:
            record = await self.generator(group)
            await asyncio.sleep(injected_delay(GROUP_DELAY_ENV))
        except asyncio.CancelledError:
            raise  # stop() gives the prompt back
        except Exception as e:
            await self.failed(group, e)
            return
        if record is None:
            await asyncio.to_thread(self.queue.skip, self.worker_id, index)
            self.watch.progressed()
            return
        self.failed.reward_worked = True
        group.phase = "pushing"
        try:
            pushed = await asyncio.to_thread(self.queue.push, record, self.worker_id)
        except RedisUnavailable:
            raise  # Redis gone: nothing can be given back; the worker's restart re-issues its leases
        except Exception as e:  # a lease given back that the push took is no harm: only held ones go back
            await self.failed(group, e)
            return
        # Leave the in-flight count now, so the registry never counts a pushed group twice.
        self._leave(asyncio.current_task())
        self.watch.progressed()
        await asyncio.to_thread(self._publish)
        if pushed is None:
            log.warning("prompt %d was re-issued while I generated it (my heartbeat had expired): not pushed", index)
            return
        self.metrics.groups.inc()
        self.metrics.tokens.inc(sum(len(x.tokens) for x in record.samples))
        self.metrics.generate_seconds.observe(record.gen_seconds)

    # -- weight sync --------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self.follower.generation

    async def _follow_sync(self) -> None:
        """weight_sync.follower does the following; an engine that cannot serve again stops the worker."""
        try:
            await self.follower.run(self.stopping)
        except WeightsCorrupted as e:
            self.on_fatal(str(e))

    def _latest_checkpoint(self) -> Checkpoint | None:
        """The newest checkpoint on disk; a quantized engine loads the learner's quantized
        tensors of its precision from it, or waits for the sync if there are none yet."""
        path = checkpoints.latest(checkpoints.checkpoint_root(self.cfg))
        if path is None:
            return None
        version = int(checkpoints.read_meta(path)["version"])
        if not self.engine.profile.checkpoint and not self.engine.lora:
            return Checkpoint(str(path), version)
        # A LoRA run's checkpoint keeps each precision's adapter as its workers load it
        path = path / "rollout" / self.engine.profile.precision
        if not path.is_dir():
            return None
        return Checkpoint(str(path), version, json.loads((path / "quant.json").read_text())["quant_profile"])

    async def _publish_incarnation(self, incarnation: str) -> None:
        await asyncio.to_thread(self._publish)  # the registry entry carries the follower's incarnation

    def _synced(self, synced: Synced) -> None:
        t = synced.timings
        self.metrics.version.set(synced.version)
        self.metrics.sync_pause_seconds.observe(t["pause_s"])
        self.metrics.paused_seconds.inc(t["pause_s"])
        for phase in ("transfer", "read", "load"):
            if f"{phase}_s" in t:
                self.metrics.sync_seconds.labels(**self.metrics.labels, phase=phase).observe(t[f"{phase}_s"])
        self.metrics.generation.set(synced.generation)
        # activated_at: when this version began being served, for the learner's fleet convergence
        # (weight_sync/convergence.py reads it, with pause_s, from the registry).
        self.last_sync = {"version": synced.version, "source": synced.source, "generation": synced.generation,
                          **{k: round(v, 6) for k, v in t.items()}, "activated_at": synced.activated_at}
        self._publish()

    def _sync_failed(self, error: str) -> None:
        self.metrics.sync_failures.inc()
        self.last_error = error
        log.warning("weight sync failed, keeping version %d: %s", self.engine.version, error)
        try:
            self._publish()  # the learner's /status shows why at once, not at the next heartbeat
        except redis.RedisError:
            pass

    # -- registry ------------------------------------------------------------------------
    def _publish(self) -> None:
        # Idle time as the ended periods and the current one's start, so a reader (the learner,
        # registry.fleet_idle_seconds) gets it exact at the moment it reads, not as of this write.
        closed, since = self._idle
        self.idle_seconds()
        registry.heartbeat_worker(
            self.r, self.keys, self.worker_id, self.cfg.rollout.heartbeat_ttl_s,
            address=self.address, version=self.engine.version, precision=self.engine.profile.precision,
            inflight=len(self.groups), incarnation=self.follower.incarnation, generation=self.generation,
            weights=self.engine.weights_source, last_sync=json.dumps(self.last_sync),
            last_error=self.last_error or "", idle_seconds=closed, idle_since=since or 0.0)

    async def _heartbeat(self) -> None:
        while not self.stopping.is_set():
            self.watch.check_calls()
            try:
                await asyncio.to_thread(self._publish)
            except Exception as e:
                log.warning("heartbeat: %r", e)
            await asyncio.sleep(self.cfg.rollout.heartbeat_s)
