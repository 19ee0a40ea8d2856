"""Fencing the learner's writes by lease epoch (rlpipe/registry.py, ``LearnerLease``).

Each acquisition of the run's learner lease takes the next epoch (``learner:epoch``, only
ever incremented). A learner that lost its lease without noticing (paused, partitioned: a
zombie) still holds its old epoch; every write that could undo its successor's work
(acknowledgements, dead letters, the learner's published state, the weight sync's
rendezvous) runs as a script that first checks the epoch, so Redis itself refuses the
zombie's write, which raises :class:`Fenced`. A check made in Python before the write could
pass and then be overtaken; the script's cannot.
"""

from __future__ import annotations

import redis


class Fenced(RuntimeError):
    """Redis refused a write: another learner took the lease since this one acquired it."""


# Prepended to every fenced script: KEYS[1] is the epoch key and ARGV[1] the writer's epoch
# ('' for none); the script reads its own keys and arguments from K and A, the rest.
FENCE_CHECK = """
local fence_key, fence_epoch = KEYS[1], ARGV[1]
local K, A = {}, {}
for i = 2, #KEYS do K[i - 1] = KEYS[i] end
for i = 2, #ARGV do A[i - 1] = ARGV[i] end
if fence_epoch ~= '' and redis.call('GET', fence_key) ~= fence_epoch then
  return redis.error_reply('FENCED: lease epoch ' .. fence_epoch .. ' is stale (now ' ..
                           tostring(redis.call('GET', fence_key)) .. '): another learner holds the lease')
end
"""
# KEYS: (fence), hash; ARGV: (fence), field, value, field, value, ...
_FENCED_HSET = FENCE_CHECK + "return redis.call('HSET', K[1], unpack(A))"


class Fence:
    """The writes of a lease holder: its epoch key and epoch, to prepend to a fenced
    script's ``KEYS`` and ``ARGV``, and a fenced HSET. ``lease`` None fences nothing (tools
    and tests that hold no lease). The epoch is read at each write: a lease re-taken after
    a Redis restart has a new one."""

    def __init__(self, r: redis.Redis, epoch_key: str, lease=None):
        self.r, self.epoch_key, self.lease = r, epoch_key, lease
        self._hset = r.register_script(_FENCED_HSET)

    @property
    def epoch(self) -> int | None:
        return self.lease.epoch if self.lease is not None else None

    def run(self, script, keys: list, args: list):
        """Run a script that begins with FENCE_CHECK; a refusal raises :class:`Fenced`."""
        epoch = "" if self.epoch is None else self.epoch
        try:
            return script(keys=[self.epoch_key, *keys], args=[epoch, *args])
        except redis.ResponseError as e:
            if "FENCED" in str(e):
                raise Fenced(str(e)) from None
            raise

    def check(self) -> None:
        """Raise :class:`Fenced` if another learner took the lease: for writes Redis cannot
        fence, such as a checkpoint put in place on disk (checked just before the rename)."""
        raw = self.r.get(self.epoch_key)
        epoch = None if raw is None else raw.decode(errors="replace")  # as text: an overwritten one need not parse
        if self.epoch is not None and epoch != str(self.epoch):
            raise Fenced(f"FENCED: lease epoch {self.epoch} is stale (now {epoch}): another learner holds the lease")

    def hset(self, key: str, mapping: dict) -> None:
        self.run(self._hset, [key], [x for kv in mapping.items() for x in kv])


