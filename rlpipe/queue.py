"""Redis keys, the trajectory stream, prompt leases and the shared counters (docs/design.md, 'Redis keys').

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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from rlpipe.admission import MAX_PROMPT_INDEX, RunCheck
from rlpipe.fence import FENCE_CHECK, Fence
from rlpipe.readback import number
from rlpipe.schema import GroupRecord, SchemaError, decode_group, encode_group

log = logging.getLogger(__name__)

CONSUMER_GROUP = "learner"
# Whether a stream entry was counted in ``produced`` is the queue's own record, never the
# entry's: the push that adds it also adds its id to the ``traj:counted`` set, and whatever
# removes it (acknowledgement, dead letter) removes the id. An entry whose id is not there came
# from somewhere else (a raw XADD) and was never counted, so it is dead-lettered and counted as
# produced and dead at once: the books stay balanced and it takes no worker's place under
# back-pressure. (Entries once carried a ``counted`` field that said so, and a raw XADD could
# carry it too: the books were off by one for each, issue 33 item 16.)


class Keys:
    """Every Redis key of one run, under ``rlpipe:{run_id}:``."""

    def __init__(self, run_id: str):
        self.prefix = f"rlpipe:{run_id}:"
        self.traj = self.prefix + "traj"
        self.dead = self.prefix + "traj:dead"
        # Not in docs/design.md's table: the ids of the stream's entries counted in ``produced``
        # (a set), written only by the push scripts and removed with their entries.
        self.counted = self.prefix + "traj:counted"
        self.learner = self.prefix + "learner"
        # Not in docs/design.md's table: the learner lease's epoch (rlpipe/fence.py).
        self.epoch = self.prefix + "learner:epoch"
        self.sync = self.prefix + "sync"
        # Not in docs/design.md's table: each sync hash's generation counter, only ever advanced
        # (weight_sync/rendezvous.py next_generation): numbers never repeat when a hash is lost.
        self.sync_generations = self.prefix + "sync_generations"
        self.cursor = self.prefix + "prompts:cursor"
        # Not in docs/design.md's table: prompt indices handed out but given back unfinished (a
        # worker shut down, or its reward could not be computed); handed out again first.
        self.returned = self.prefix + "prompts:returned"
        # Not in docs/design.md's table: a bitmap of the prompt indices whose group was dropped as stale.
        self.dropped = self.prefix + "prompts:dropped"
        # Not in docs/design.md's table: how many times each re-issued prompt index was handed out before.
        self.attempts = self.prefix + "prompts:attempts"
        # Not in docs/design.md's table: how many times a reward or environment failed on each prompt
        # index (counted ones only, see TrajectoryQueue.reward_failed); cleared when it is pushed or dead.
        self.reward_failures = self.prefix + "prompts:reward_failures"
        # Not in docs/design.md's table: each leased prompt index's weights version when it was handed out
        # (a sorted set): the oldest group in flight holds back the fleet's allowance (see _HAND_OUT).
        self.lease_versions = self.prefix + "prompts:lease_versions"
        # Not in docs/design.md's table: the counters behind the no-loss invariant above.
        self.counters = self.prefix + "counters"
        # Not in docs/design.md's table: held-out evaluation (rollout_service/evals.py, learner/evals.py):
        # the learner's requests (a stream read in one consumer group), the workers' results (a
        # stream), the versions already requested (a hash) and the last result the learner logged.
        self.eval_requests = self.prefix + "eval:requests"
        self.eval_results = self.prefix + "eval:results"
        self.eval_requested = self.prefix + "eval:requested"
        self.eval_logged = self.prefix + "eval:logged"
        self.eval_answered = self.prefix + "eval:answered"  # version -> the results entry logged for it

    def leases(self, worker_id: str) -> str:
        return f"{self.prefix}prompts:leases:{worker_id}"

    @property
    def lease_pattern(self) -> str:
        return f"{self.prefix}prompts:leases:*"

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


class RedisUnavailable(RuntimeError):
    """Redis stayed unreachable longer than the process may wait (``redis_wait_s``)."""


PASSWORD_ENV, PASSWORD_FILE_ENV = "RLPIPE_REDIS_PASSWORD", "RLPIPE_REDIS_PASSWORD_FILE"


def redis_password() -> str | None:
    """The password for a ``redis_url`` without one: ``RLPIPE_REDIS_PASSWORD``, or the file
    named by ``RLPIPE_REDIS_PASSWORD_FILE`` (a mounted Kubernetes secret); None for neither."""
    if os.environ.get(PASSWORD_ENV):
        return os.environ[PASSWORD_ENV]
    if os.environ.get(PASSWORD_FILE_ENV):
        return Path(os.environ[PASSWORD_FILE_ENV]).read_text().strip()
    return None


def redacted(url: str) -> str:
    """``url`` without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rsplit("@", 1)[1]))


class OutageRetry(Retry):
    """Retry every Redis call through an outage (a restart, a failover) until ``wait_s``
    have passed since it began, with capped exponential backoff; then raise
    :class:`RedisUnavailable`. It logs once when an outage begins and once when it ends,
    rather than a traceback per call, and counts outages (``outages``) so the learner and
    workers know to reconcile what a restarted Redis may have lost.

    redis-py deep-copies the retry policy into every connection; one object per client
    (``__deepcopy__`` returns itself) is what makes an outage one outage for all of them.
    """

    def __init__(self, url: str, wait_s: float, password: str | None = None):
        super().__init__(ExponentialBackoff(cap=2.0, base=0.05), retries=-1)
        self.url, self.wait_s = redacted(url), wait_s
        self._probe_url, self._password = url, password
        self.down_since: float | None = None
        self.outages = 0
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        failures = 0
        while True:
            try:
                result = do()
            except self._supported_errors as e:
                if is_retryable and not is_retryable(e):
                    raise
                failures += 1
                fail(e, failures) if with_failure_count else fail(e)
                self._down(e)
                time.sleep(self._backoff.compute(failures))
                continue
            self._up()
            return result

    def _serving(self) -> bool:
        """A success is not proof Redis is back: redis-py's ``connect()`` succeeds at once on
        a connection whose socket is still open to the dead server, and a restarted Redis
        answers a few commands while it replays its AOF, refusing the rest with LOADING (one
        thread's call succeeding while another's is refused made one outage look like
        several). Back means a fresh connection finds it done loading."""
        try:
            auth = {"password": self._password} if self._password is not None else {}
            probe = redis.Redis.from_url(self._probe_url, socket_timeout=1.0, socket_connect_timeout=1.0, **auth)
            try:
                return not int(probe.info("persistence").get("loading", 0))
            finally:
                probe.close()
        except (redis.RedisError, OSError):
            return False

    def _down(self, error: Exception) -> None:
        with self._lock:
            now = time.monotonic()
            if self.down_since is None:
                self.down_since = now
                self.outages += 1
                log.warning("Redis at %s unreachable (%s): retrying for up to %.0fs", self.url, error, self.wait_s)
            elif now - self.down_since > self.wait_s:
                raise RedisUnavailable(f"Redis at {self.url} unreachable for {now - self.down_since:.0f}s "
                                       f"(redis_wait_s {self.wait_s:g}): {error}") from error

    def _up(self) -> None:
        if self.down_since is not None and self._serving():
            with self._lock:
                if self.down_since is not None:
                    log.warning("Redis at %s is back after %.1fs", self.url, time.monotonic() - self.down_since)
                    self.down_since = None


def connect(url: str, wait_s: float = 0.0) -> redis.Redis:
    """A client whose every call has a timeout (no call may hang a process forever).

    With ``wait_s > 0`` (the services: ``redis_wait_s``) it waits for Redis, at start and
    through any later outage, up to ``wait_s`` each time (:class:`OutageRetry`); without,
    a call fails at once (tools, tests). The password comes from the URL or, failing
    that, :func:`redis_password`.
    """
    kwargs = dict(socket_timeout=30, socket_connect_timeout=10, health_check_interval=30)
    password = redis_password() if urlsplit(url).password is None else None
    if password is not None:
        kwargs["password"] = password
    if wait_s > 0:
        kwargs.update(retry=OutageRetry(url, wait_s, password), retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    client = redis.Redis.from_url(url, **kwargs)
    if wait_s > 0:
        client.ping()  # at start: waits (saying so) up to wait_s, then RedisUnavailable names the URL
    return client


class RestartWatch:
    """Whether the Redis server behind ``r`` restarted since the last look: its ``run_id``
    changed. Only a restart can lose writes Redis acknowledged (a network outage loses
    none), and a process may never see the outage itself: redis-py quietly reconnects a
    pooled connection whose server went away while the process made no call (the learner
    in a long weight sync). So the run_id, not an error, is what tells it to reconcile."""

    def __init__(self, r: redis.Redis, every_s: float = 0.0):
        self.r, self.every_s = r, every_s
        self.run_id = self._run_id()
        self.checked = time.monotonic()

    def _run_id(self) -> str:
        return self.r.info("server")["run_id"]

    def restarted(self) -> bool:
        """True once per restart (at most one look per ``every_s``)."""
        if time.monotonic() - self.checked < self.every_s:
            return False
        self.checked = time.monotonic()
        run_id = self._run_id()
        changed, self.run_id = run_id != self.run_id, run_id
        return changed


def outages(r: redis.Redis) -> int:
    """How many outages ``r`` has been through (0 for a client without OutageRetry)."""
    retry = r.get_retry()
    return retry.outages if isinstance(retry, OutageRetry) else 0


COUNTERS = ("produced", "trained", "dropped_stale", "dead", "duplicate", "filtered", "leased", "rejected_push",
            "reissued", "skipped", "lost_writes", "foreign", "dead_prompts")

# The most groups sampled per group trained that the allowance scales by (dynamic sampling): a run
# whose groups almost never carry a signal must not flood the stream with ones to throw away.
MAX_SAMPLE_RATIO = 16

# KEYS: returned, cursor, leases:{worker}, attempts, counters, learner, lease_versions
# ARGV: lease time, how many wanted, then either nothing (no back-pressure) or
#       the worker's weights version, groups_per_step, max_lag[, max_staleness] (see lease_prompts)
# Returns {allowance, unconsumed, leased after the hand-out, index, attempt, index, attempt, ...}
_HAND_OUT = """
local learner = redis.call('HMGET', KEYS[6], 'version', 'consumed', 'sample_ratio')
local version, consumed = tonumber(learner[1] or 0) or 0, tonumber(learner[2] or 0) or 0
-- groups sampled per group trained (dynamic sampling), as the learner measured it; anything else: 1
local ratio = tonumber(learner[3] or 1)
if not ratio or ratio ~= ratio or ratio < 1 then ratio = 1 elseif ratio > MAX_RATIO then ratio = MAX_RATIO end
local c = redis.call('HMGET', KEYS[5], 'produced', 'dropped_stale', 'dead', 'duplicate', 'leased', 'filtered')
for i = 1, 6 do c[i] = tonumber(c[i] or 0) or 0 end
local unconsumed = c[1] - c[2] - c[3] - c[4] - c[6] - consumed
local allowance = tonumber(ARGV[2])
-- the places left before the learner is more than `lag` versions past weights `from`
local function places(lag, from)
  local behind = version - math.min(from, version)
  return math.floor((1 + lag - behind) * tonumber(ARGV[4]) * ratio + 0.5) - unconsumed - c[5]
end
if #ARGV > 2 then
  allowance = places(tonumber(ARGV[5]), tonumber(ARGV[3]))
  if #ARGV > 5 then  -- and before the oldest group in flight (or this worker's next) is too stale to train
    local oldest = tonumber(redis.call('ZRANGE', KEYS[7], 0, 0, 'WITHSCORES')[2] or '') or tonumber(ARGV[3])
    allowance = math.min(allowance, places(tonumber(ARGV[6]), math.min(oldest, tonumber(ARGV[3]))))
  end
end
local out = {allowance, unconsumed, c[5]}
for _ = 1, math.min(tonumber(ARGV[2]), allowance) do
  local index = redis.call('LPOP', KEYS[1])
  if not index then index = tostring(redis.call('INCR', KEYS[2]) - 1) end
  redis.call('HSET', KEYS[3], index, ARGV[1])
  if #ARGV > 2 then redis.call('ZADD', KEYS[7], ARGV[3], index) end
  out[#out + 1] = tonumber(index)
  out[#out + 1] = tonumber(redis.call('HGET', KEYS[4], index) or 0)
end
if #out > 3 then
  out[3] = c[5] + (#out - 3) / 2
  redis.call('HINCRBY', KEYS[5], 'leased', (#out - 3) / 2)
end
return out
""".replace("MAX_RATIO", str(MAX_SAMPLE_RATIO))

# KEYS: cursor, counters, returned; ARGV: MAX_PROMPT_INDEX. A cursor that is not a count below
# the limit (overwritten: INCR fails on text, and a far one blows up the bitmaps of prompt
# indices) is set back to the most the books say was handed out: each index was pushed (counted
# in produced, re-issues too), is leased, was given back or was skipped (settled unpushed: too
# long, failed twice; without it a reset handed those out again), so while the books are right no
# index in use is handed out again; past the limit as well, to 0. Returns the new value.
_RESET_CURSOR = """
local cursor, limit = redis.call('GET', KEYS[1]), tonumber(ARGV[1])
local count = cursor == '0' or (string.match(cursor or '', '^[1-9]%d*$') and #cursor < 16)
if not cursor or (count and tonumber(cursor) < limit) then return false end
local c = redis.call('HMGET', KEYS[2], 'produced', 'leased', 'skipped')
local bound = (tonumber(c[1] or 0) or 0) + (tonumber(c[2] or 0) or 0) + (tonumber(c[3] or 0) or 0)
  + redis.call('LLEN', KEYS[3])
if not (bound >= 0 and bound < limit) then bound = 0 end
redis.call('SET', KEYS[1], math.floor(bound))
return math.floor(bound)
"""

# KEYS: traj, counted, counters; ARGV: data
_PUSH = """
local id = redis.call('XADD', KEYS[1], '*', 'data', ARGV[1])
redis.call('SADD', KEYS[2], id)
redis.call('HINCRBY', KEYS[3], 'produced', 1)
return id
"""

# KEYS: leases:{worker}, traj, counters, lease_versions, counted, reward_failures; ARGV: index, data
_LEASED_PUSH = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then
  redis.call('HINCRBY', KEYS[3], 'rejected_push', 1)
  return false
end
redis.call('HINCRBY', KEYS[3], 'leased', -1)
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
local id = redis.call('XADD', KEYS[2], '*', 'data', ARGV[2])
redis.call('SADD', KEYS[5], id)
redis.call('HINCRBY', KEYS[3], 'produced', 1)
return id
"""

# For the scripts that remove entries: settle(counters, counted, id), after XDEL removed entry ``id``,
# forgets it in ``counted``, or if it was never there (a raw XADD) counts it as produced now, and as foreign.
_UNCOUNTED = """
local function settle(counters, counted, id)
  if redis.call('SREM', counted, id) == 0 then
    redis.call('HINCRBY', counters, 'produced', 1)
    redis.call('HINCRBY', counters, 'foreign', 1)
  end
end
"""

# KEYS: leases:{worker}, returned, attempts, counters, workers:{worker}, lease_versions
# ARGV: 'dead' (only if the registry entry is gone) | 'all' | 'skip' (clear the leases, re-issue nothing);
#       counter to add to ('' for none); indices (none: all)
_REISSUE = """
if ARGV[1] == 'dead' and redis.call('EXISTS', KEYS[5]) == 1 then return 0 end
local indices = {}
if #ARGV > 2 then
  for i = 3, #ARGV do if redis.call('HDEL', KEYS[1], ARGV[i]) == 1 then indices[#indices + 1] = ARGV[i] end end
else
  indices = redis.call('HKEYS', KEYS[1])
  redis.call('DEL', KEYS[1])
end
if ARGV[1] ~= 'skip' then
  for _, index in ipairs(indices) do
    redis.call('RPUSH', KEYS[2], index)
    redis.call('HINCRBY', KEYS[3], index, 1)
  end
end
for _, index in ipairs(indices) do redis.call('ZREM', KEYS[6], index) end
if #indices > 0 then
  redis.call('HINCRBY', KEYS[4], 'leased', -#indices)
  if ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[4], ARGV[2], #indices) end
end
return #indices
"""

# KEYS: leases:{worker}, returned, attempts, counters, lease_versions, reward_failures, dead, dropped
# ARGV: index, whether this failure counts ('1' or '0'), the limit, then the dead letter's fields and values
# Returns nil if the lease is not held (re-issued meanwhile: nothing to settle), else the prompt's counted
# failures, negated once it reached the limit and the prompt was settled as dead: a dead letter with its
# reason, counted as produced and dead at once (the books stay balanced and the allowance is unchanged)
# and marked in prompts:dropped (settled for good); below the limit, it goes back to be handed out again.
_REWARD_FAILED = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return false end
redis.call('HINCRBY', KEYS[4], 'leased', -1)
redis.call('ZREM', KEYS[5], ARGV[1])
local failures = tonumber(redis.call('HGET', KEYS[6], ARGV[1]) or 0) or 0
if ARGV[2] == '1' then failures = failures + 1 end
if failures < tonumber(ARGV[3]) then
  if failures > 0 then redis.call('HSET', KEYS[6], ARGV[1], failures) end
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
  return failures
end
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('XADD', KEYS[7], '*', 'prompt_index', ARGV[1], 'failures', failures, unpack(ARGV, 4))
redis.call('SETBIT', KEYS[8], ARGV[1], 1)
for _, k in ipairs({'produced', 'dead', 'dead_prompts'}) do redis.call('HINCRBY', KEYS[4], k, 1) end
return -failures
"""

# KEYS: lease_versions, then every worker's leases; ARGV: lease_versions' members, oldest first, read
# before those leases were listed. Removes the oldest ones no worker holds, up to the first held:
# every script that clears a lease removes its member, so only a hand-written one, or one from an
# rlpipe without the set, is left, and it would hold back the fleet's allowance for good.
_PRUNE_LEASE_VERSIONS = """
local gone = 0
for _, index in ipairs(ARGV) do
  for i = 2, #KEYS do
    if redis.call('HEXISTS', KEYS[i], index) == 1 then return gone end
  end
  gone = gone + redis.call('ZREM', KEYS[1], index)
end
return gone
"""


# KEYS: counters, traj, counted; ARGV: the groups the learner's lineage trained, then the ids of those not
# acknowledged yet. Ids in ``counted`` whose entry is gone (lost with it, or never there) are forgotten.
_REDERIVE = """
local in_stream = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  if #redis.call('XRANGE', KEYS[2], id, id) > 0 then in_stream = in_stream + 1 else redis.call('SREM', KEYS[3], id) end
end
local c = {}
for _, k in ipairs({'produced', 'trained', 'dropped_stale', 'dead', 'duplicate', 'filtered'}) do
  c[k] = tonumber(redis.call('HGET', KEYS[1], k) or 0)
end
local trained = tonumber(ARGV[1])
for i = 2, #ARGV do  -- trained but not acknowledged yet: counted when they are, if still in the stream
  if #redis.call('XRANGE', KEYS[2], ARGV[i], ARGV[i]) > 0 then trained = trained - 1 end
end
local produced = trained + c.dropped_stale + c.dead + c.duplicate + c.filtered + in_stream
local lost = math.abs(trained - c.trained) + math.abs(produced - c.produced)
if lost > 0 then
  redis.call('HSET', KEYS[1], 'trained', trained, 'produced', produced)
  redis.call('HINCRBY', KEYS[1], 'lost_writes', lost)
end
return {c.trained, trained, c.produced, produced}
"""


# KEYS: (fence), traj, counters, dropped, counted; ARGV: (fence), consumer group, how many trained,
# dropped_stale, duplicate, filtered; their ids, then the prompt indices of the dropped and filtered ones
# (marked in the prompts:dropped bitmap: settled without training, for good)
_ACK = FENCE_CHECK + _UNCOUNTED + """
local names, pos = {'trained', 'dropped_stale', 'duplicate', 'filtered'}, 6
local marked = 6 + tonumber(A[2]) + tonumber(A[3]) + tonumber(A[4]) + tonumber(A[5])
for c = 1, 4 do
  local removed = 0
  for i = pos, pos + tonumber(A[1 + c]) - 1 do
    redis.call('XACK', K[1], A[1], A[i])
    local gone = redis.call('XDEL', K[1], A[i])
    removed = removed + gone
    if gone == 1 then settle(K[2], K[4], A[i]) end
    if (c == 2 or c == 4) then
      if gone == 1 and tonumber(A[marked]) >= 0 then redis.call('SETBIT', K[3], A[marked], 1) end
      marked = marked + 1
    end
  end
  pos = pos + tonumber(A[1 + c])
  if removed > 0 then redis.call('HINCRBY', K[2], names[c], removed) end
end
"""

# KEYS: (fence), traj, dead, counters, counted; ARGV: (fence), consumer group, entry id, reason, then the
# entry's fields and values. Counted once, by whichever reader removes the entry.
_DEAD_LETTER = FENCE_CHECK + _UNCOUNTED + """
redis.call('XACK', K[1], A[1], A[2])
if redis.call('XDEL', K[1], A[2]) == 0 then return 0 end
redis.call('XADD', K[2], '*', 'reason', A[3], 'source_id', A[2], unpack(A, 4))
redis.call('HINCRBY', K[3], 'dead', 1)
settle(K[3], K[4], A[2])
return 1
"""


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
        self._hand_out = r.register_script(_HAND_OUT)
        self._reset_cursor = r.register_script(_RESET_CURSOR)
        self._push = r.register_script(_PUSH)
        self._leased_push = r.register_script(_LEASED_PUSH)
        self._reissue = r.register_script(_REISSUE)
        self._reward_failed = r.register_script(_REWARD_FAILED)
        self._prune_lease_versions = r.register_script(_PRUNE_LEASE_VERSIONS)
        self._rederive = r.register_script(_REDERIVE)
        self._ack = r.register_script(_ACK)
        self._dead_letter = r.register_script(_DEAD_LETTER)

    # -- producer side -------------------------------------------------------------
    def push(self, rec: GroupRecord, worker_id: str | None = None) -> str | None:
        """Append one group and count it as produced, atomically. A group for a leased
        prompt (``worker_id`` given) is only appended while ``worker_id`` still holds the
        lease, which it clears: returns None, counted in ``rejected_push``, if the prompt
        was re-issued meanwhile. Without ``worker_id``: groups that never came from the
        cursor (tests, imported data)."""
        data = encode_group(rec)
        if worker_id is not None:
            entry_id = self._leased_push(keys=[self.keys.leases(worker_id), self.keys.traj, self.keys.counters,
                                               self.keys.lease_versions, self.keys.counted, self.keys.reward_failures],
                                         args=[rec.prompt_index, data])
            return entry_id.decode() if entry_id else None
        return self.push_data(data)

    def push_data(self, data: bytes) -> str:
        """Append an encoded group (``data``, unchecked) without a lease and count it as produced."""
        return self._push(keys=[self.keys.traj, self.keys.counted, self.keys.counters], args=[data]).decode()

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
        worst, instead of being starved by it, and the groups it starts are trained. (Under
        dynamic sampling, the places scale by ``sample_ratio``, so this holds on average.)
        """
        keys = self.keys
        self._check_cursor()
        raw = self._hand_out(keys=[keys.returned, keys.cursor, keys.leases(worker_id), keys.attempts, keys.counters,
                                   keys.learner, keys.lease_versions],
                             args=[time.time(), wanted, *(backpressure or ())])
        return Lease(allowance=int(raw[0]), prompts=[(int(raw[i]), int(raw[i + 1])) for i in range(3, len(raw), 2)],
                     unconsumed=int(raw[1]), fleet_leased=int(raw[2]))

    def _check_cursor(self) -> None:
        """Set back a cursor that is not a count below MAX_PROMPT_INDEX (see _RESET_CURSOR)."""
        raw = self.r.get(self.keys.cursor)
        if raw is None or raw == b"0" or (raw[:1] != b"0" and raw.isdigit() and int(raw) < MAX_PROMPT_INDEX):
            return
        reset = self._reset_cursor(keys=[self.keys.cursor, self.keys.counters, self.keys.returned],
                                   args=[MAX_PROMPT_INDEX])
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
        return int(self._reissue(keys=self._reissue_keys(worker_id), args=["all", count_as, *indices]))

    def skip(self, worker_id: str, index: int) -> None:
        """Settle a leased prompt this worker cannot generate for (too long; failed twice
        here) without re-issuing it; counted in ``skipped``."""
        self._reissue(keys=self._reissue_keys(worker_id), args=["skip", "skipped", index])

    def reward_failed(self, worker_id: str, index: int, counts: bool, limit: int, fields: dict) -> int | None:
        """Settle a leased prompt whose reward or environment failed, in one script: a failure that
        ``counts`` is added to the prompt's; below ``limit`` of them it goes back to be handed out
        again (any worker's), and at ``limit`` it is settled as dead: a dead letter of ``fields``
        (``reason`` among them) with its ``prompt_index`` and ``failures``, counted as produced,
        dead and ``dead_prompts``, its index marked in ``prompts:dropped``. A reward that failed on
        one prompt every time was given back and handed out again for ever (issue 33 item 12).
        Returns the prompt's counted failures, negated if it is now dead; None if ``worker_id``
        no longer held the lease (nothing to settle)."""
        k = self.keys
        out = self._reward_failed(
            keys=[k.leases(worker_id), k.returned, k.attempts, k.counters, k.lease_versions, k.reward_failures,
                  k.dead, k.dropped],
            args=[index, "1" if counts else "0", limit, *(x for kv in fields.items() for x in kv)])
        return None if out is None else int(out)

    def reissue_all(self, worker_id: str, only_if_dead: bool = False) -> int:
        """Re-issue every lease of ``worker_id``: a restarted worker's from its previous
        life, or (``only_if_dead``) those of a worker whose registry entry expired."""
        return int(self._reissue(keys=self._reissue_keys(worker_id),
                                 args=["dead" if only_if_dead else "all", "reissued"]))

    def reclaim_dead(self) -> int:
        """Re-issue the leases of every worker whose heartbeat expired (SIGKILL, OOM, a
        lost node); the learner calls it while it waits for groups. Then forget lease
        versions no worker holds (see _PRUNE_LEASE_VERSIONS): the learner may be waiting on one."""
        n = 0
        prefix = self.keys.lease_pattern[:-1]
        versions = self.r.zrange(self.keys.lease_versions, 0, 99)  # the oldest, before the leases are listed
        leases = []
        for key in self.r.scan_iter(match=self.keys.lease_pattern, count=100):
            leases.append(key)
            n += self.reissue_all(key.decode()[len(prefix):], only_if_dead=True)
        if versions and self._prune_lease_versions(keys=[self.keys.lease_versions, *leases], args=versions):
            log.warning("forgot lease versions no worker holds (written by hand, or by an older rlpipe)")
        return n

    def leased(self, worker_id: str) -> set[int]:
        return {int(i) for i in self.r.hkeys(self.keys.leases(worker_id))}

    def _reissue_keys(self, worker_id: str) -> list[str]:
        k = self.keys
        return [k.leases(worker_id), k.returned, k.attempts, k.counters, k.worker(worker_id), k.lease_versions]

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
        self.fence.run(self._dead_letter, [self.keys.traj, self.keys.dead, self.keys.counters, self.keys.counted],
                       [CONSUMER_GROUP, entry_id, reason, *(x for kv in fields.items() for x in kv)])

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
            self.fence.run(self._ack, [self.keys.traj, self.keys.counters, self.keys.dropped, self.keys.counted],
                           [CONSUMER_GROUP, len(trained), len(dropped_stale), len(duplicate), len(filtered), *trained,
                            *(e.entry_id for e in dropped_stale), *duplicate, *(e.entry_id for e in filtered),
                            *(e.record.prompt_index for e in [*dropped_stale, *filtered])])

    def missing(self, entry_ids: list[str]) -> set[str]:
        """Those of ``entry_ids`` no longer in the stream (after a Redis restart: pushes it lost)."""
        pipe = self.r.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xrange(self.keys.traj, entry_id, entry_id)
        return {entry_id for entry_id, found in zip(entry_ids, pipe.execute()) if not found}

    def dropped_indices(self) -> "IndexSet":
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
        was_t, now_t, was_p, now_p = self._rederive(keys=[self.keys.counters, self.keys.traj, self.keys.counted],
                                                    args=[trained, *unacked])
        return int(was_t), int(now_t), int(was_p), int(now_p)

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


class IndexSet:
    """A set of prompt indices as a bitmap (the cursor hands them out densely from 0), bit
    order as Redis's SETBIT (most significant bit first): the learner's lineage keeps the
    indices it trained, 1 bit each, in every checkpoint; Redis keeps those dropped."""

    def __init__(self, data: bytes = b""):
        self.bits = bytearray(data)

    def add(self, index: int) -> None:
        if index < 0:
            return
        byte = index >> 3
        if byte >= len(self.bits):
            self.bits.extend(bytes(byte + 1 - len(self.bits)))
        self.bits[byte] |= 0x80 >> (index & 7)

    def __contains__(self, index: int) -> bool:
        byte = index >> 3
        return 0 <= index and byte < len(self.bits) and bool(self.bits[byte] & (0x80 >> (index & 7)))

    def __len__(self) -> int:
        return sum(bin(b).count("1") for b in self.bits)

    def __iter__(self):
        return (i for i in range(len(self.bits) * 8) if i in self)

    def to_bytes(self) -> bytes:
        return bytes(self.bits)

