"""The trajectory queue's server-side Lua scripts, and the calls that fill in their keys and arguments.

Every step that must not half-happen (a hand-out and its lease, a push and its count, an
acknowledgement and its counters, a dead letter) is one script, so Redis runs it whole and a
retried call after a lost reply cannot apply it twice (rlpipe/queue.py says what each step means
for the books). The scripts live apart from :class:`rlpipe.queue.TrajectoryQueue` so that each
one's KEYS and ARGV, written in the comment above it, sit beside the one method that passes
them (:class:`QueueScripts`), and the queue reads as what it does rather than how Redis does it.
"""

from __future__ import annotations

import time

import redis

from rlpipe.admission import MAX_PROMPT_INDEX
from rlpipe.fence import FENCE_CHECK, Fence
from rlpipe.keys import CONSUMER_GROUP, Keys

# The most groups sampled per group trained that the allowance scales by (dynamic sampling): a run
# whose groups almost never carry a signal must not flood the stream with ones to throw away.
MAX_SAMPLE_RATIO = 16

# KEYS: returned, cursor, leases:{worker}, attempts, counters, learner, lease_versions
# ARGV: lease time, how many wanted, then either nothing (no back-pressure) or
#       the worker's weights version, groups_per_step, max_lag[, max_staleness] (see rlpipe/queue.py lease_prompts)
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
-- the groups to start before the learner is more than `lag` versions past weights `from`: the
-- places its next steps have left once the unconsumed groups take theirs, each to be filled by
-- `ratio` samples (dynamic sampling), less those in flight. Scaling the unconsumed groups too
-- (places x ratio - unconsumed) let the fleet start ratio x a step's groups for its last place,
-- and the surplus arrived after the learner moved on: sampled further ahead, dropped stale.
local function places(lag, from)
  local behind = version - math.min(from, version)
  return math.floor(((1 + lag - behind) * tonumber(ARGV[4]) - unconsumed) * ratio + 0.5) - c[5]
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


class QueueScripts:
    """The scripts above registered on one client, for one run's keys. Each method passes its
    script's KEYS and ARGV in the order the script's comment gives; what the results mean, and
    when each is called, is :class:`rlpipe.queue.TrajectoryQueue`'s. The two fenced ones
    (``ack``, ``dead_letter``) run through the writer's :class:`Fence`, given at each call (a
    queue's fence may be replaced)."""

    def __init__(self, r: redis.Redis, keys: Keys):
        self.keys = keys
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

    def hand_out(self, worker_id: str, wanted: int, backpressure: tuple[int, ...] | None) -> list:
        """_HAND_OUT's raw reply: allowance, unconsumed, fleet leased, then (index, attempt) pairs."""
        k = self.keys
        return self._hand_out(keys=[k.returned, k.cursor, k.leases(worker_id), k.attempts, k.counters, k.learner,
                                    k.lease_versions],
                              args=[time.time(), wanted, *(backpressure or ())])

    def reset_cursor(self) -> int | None:
        """The cursor _RESET_CURSOR set back to, or None if it found nothing to set back."""
        k = self.keys
        return self._reset_cursor(keys=[k.cursor, k.counters, k.returned], args=[MAX_PROMPT_INDEX])

    def push(self, data: bytes) -> str:
        k = self.keys
        return self._push(keys=[k.traj, k.counted, k.counters], args=[data]).decode()

    def leased_push(self, worker_id: str, index: int, data: bytes) -> str | None:
        """The new entry's id, or None if ``worker_id`` no longer held the lease on ``index``."""
        k = self.keys
        entry_id = self._leased_push(keys=[k.leases(worker_id), k.traj, k.counters, k.lease_versions, k.counted,
                                           k.reward_failures],
                                     args=[index, data])
        return entry_id.decode() if entry_id else None

    def reissue(self, worker_id: str, mode: str, count_as: str, indices=()) -> int:
        """_REISSUE with ``mode`` 'dead', 'all' or 'skip'; ``indices`` none: all the worker's."""
        k = self.keys
        return int(self._reissue(keys=[k.leases(worker_id), k.returned, k.attempts, k.counters, k.worker(worker_id),
                                       k.lease_versions],
                                 args=[mode, count_as, *indices]))

    def reward_failed(self, worker_id: str, index: int, counts: bool, limit: int, fields: dict) -> int | None:
        k = self.keys
        out = self._reward_failed(
            keys=[k.leases(worker_id), k.returned, k.attempts, k.counters, k.lease_versions, k.reward_failures,
                  k.dead, k.dropped],
            args=[index, "1" if counts else "0", limit, *(x for kv in fields.items() for x in kv)])
        return None if out is None else int(out)

    def prune_lease_versions(self, leases: list, versions: list) -> int:
        """How many of ``versions`` (oldest first) _PRUNE_LEASE_VERSIONS forgot."""
        return self._prune_lease_versions(keys=[self.keys.lease_versions, *leases], args=versions)

    def rederive(self, trained: int, unacked) -> tuple[int, int, int, int]:
        k = self.keys
        was_t, now_t, was_p, now_p = self._rederive(keys=[k.counters, k.traj, k.counted], args=[trained, *unacked])
        return int(was_t), int(now_t), int(was_p), int(now_p)

    def ack(self, fence: Fence, trained: list[str], dropped_stale: list[str], duplicate: list[str],
            filtered: list[str], marked: list[int]) -> None:
        """Entry ids by how they were settled; ``marked``: the prompt indices of ``dropped_stale``
        then of ``filtered``, in order."""
        k = self.keys
        fence.run(self._ack, [k.traj, k.counters, k.dropped, k.counted],
                  [CONSUMER_GROUP, len(trained), len(dropped_stale), len(duplicate), len(filtered), *trained,
                   *dropped_stale, *duplicate, *filtered, *marked])

    def dead_letter(self, fence: Fence, entry_id: str, fields: dict, reason: str) -> None:
        k = self.keys
        fence.run(self._dead_letter, [k.traj, k.dead, k.counters, k.counted],
                  [CONSUMER_GROUP, entry_id, reason, *(x for kv in fields.items() for x in kv)])
