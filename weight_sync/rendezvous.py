"""The sync rendezvous in Redis: the ``rlpipe:{run}:sync`` hash (docs/design.md, 'Weight sync');
in a fleet of mixed precisions, one hash per precision (``sync:int8``, ``sync:bf16``, see
``Keys.sync_channel``), since each precision gets other tensors.

The learner publishes a *generation* (who takes part, where rank 0 listens, the bucket
manifest) and then each *version* it broadcasts. Workers poll the hash: a new generation
that lists them as ``candidates`` means "check in" (the i-th candidate checks in as
candidate i+1; with a sync token, under a MAC of its id and incarnation, see
weight_sync/transport.py), a higher version means "receive". Besides docs/design.md's fields the hash
carries ``candidates``, ``incarnations`` (the incarnation the learner expects of each
candidate, which a worker's check-in must be signed for), ``members`` (JSON lists: the
workers asked, and those admitted, published once the generation formed) and
``manifest_hash``; ``world_size`` is the admitted world.

A generation is known by its number *and* a random ``generation_id`` drawn when it is
formed. Numbers never repeat, whatever is lost: the hash can be (an operator deleting keys,
Redis restored from an older snapshot), and so can Redis's every key, while a learner may
restart at any time. So a number (:func:`next_generation`) is above each of: a counter per
hash that only grows (``sync_generations``, written with the lease fence), the number the
hash carries, this learner process's last, and the last one this learner recorded on its
disk (:class:`GenerationFloor`, beside its checkpoints: what survives Redis losing
everything and a restart together). A worker still joins every generation whose identity it
has not seen, whatever its number. A version and the admitted members are written only
into the hash of the generation they belong to (one atomic script, :func:`publish_version`),
so the hash never carries a version without its manifest: when it is gone, the write says
so and the learner forms a new generation.

This module is the one place that writes the hash, and every write is fenced by the
learner's lease epoch (rlpipe/fence.py): a learner that lost its lease cannot publish a
generation or a version over its successor's.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import redis

from rlpipe.fence import FENCE_CHECK, Fence

log = logging.getLogger(__name__)


@dataclass
class SyncState:
    generation: int = 0
    master_addr: str = ""
    master_port: int = 0
    world_size: int = 0
    candidates: tuple[str, ...] = ()
    members: tuple[str, ...] = ()
    version: int = -1
    manifest: str = ""
    manifest_hash: str = ""
    incarnations: tuple[str, ...] = ()  # of each candidate
    generation_id: str = ""  # drawn at random for each generation: its identity with the number

    @property
    def identity(self) -> tuple[int, str]:
        return self.generation, self.generation_id

    def candidate_of(self, worker_id: str) -> int | None:
        return self.candidates.index(worker_id) + 1 if worker_id in self.candidates else None

    def incarnation_of(self, worker_id: str) -> str:
        c = self.candidate_of(worker_id)
        return self.incarnations[c - 1] if c is not None and c <= len(self.incarnations) else ""


def read_sync(r: redis.Redis, key: str) -> SyncState:
    raw = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
    if not raw:
        return SyncState()
    return SyncState(
        generation=int(raw.get("generation", 0)),
        master_addr=raw.get("master_addr", ""),
        master_port=int(raw.get("master_port", 0)),
        world_size=int(raw.get("world_size", 0)),
        candidates=tuple(json.loads(raw.get("candidates", "[]"))),
        members=tuple(json.loads(raw.get("members", "[]"))),
        version=int(raw.get("version", -1)),
        manifest=raw.get("manifest", ""),
        manifest_hash=raw.get("manifest_hash", ""),
        incarnations=tuple(json.loads(raw.get("incarnations", "[]"))),
        generation_id=raw.get("generation_id", ""),
    )


def generation_id(r: redis.Redis, key: str) -> str:
    """The id of the generation the hash carries ("" when it is gone)."""
    value = r.hget(key, "generation_id")
    return value.decode() if value is not None else ""


# KEYS: (fence), hash; ARGV: (fence), field, value, ...: the hash replaced whole.
_PUBLISH_GENERATION = FENCE_CHECK + """
redis.call('DEL', K[1])
redis.call('HSET', K[1], unpack(A))
return 1
"""
# KEYS: (fence), hash; ARGV: (fence), generation id, field, value, ...: HSET only if the hash
# still carries that generation; 1 if it did.
_SET_IF_GENERATION = FENCE_CHECK + """
if redis.call('HGET', K[1], 'generation_id') ~= A[1] then return 0 end
redis.call('HSET', K[1], unpack(A, 2))
return 1
"""


def _write(r: redis.Redis, fence: Fence | None, script: str, key: str, args: list) -> bool:
    fence = fence or Fence(r, "")  # no lease: nothing to fence (tools, tests)
    return bool(fence.run(r.register_script(script), [key], args))


def publish_generation(r: redis.Redis, key: str, state: SyncState, fence: Fence | None = None) -> None:
    """Replace the hash with a new generation (nothing of the previous one is left in it)."""
    fields = {
        "generation": state.generation,
        "generation_id": state.generation_id,
        "master_addr": state.master_addr,
        "master_port": state.master_port,
        "world_size": state.world_size,
        "candidates": json.dumps(list(state.candidates)),
        "members": json.dumps(list(state.members)),
        "version": state.version,
        "manifest": state.manifest,
        "manifest_hash": state.manifest_hash,
        "incarnations": json.dumps(list(state.incarnations)),
    }
    _write(r, fence, _PUBLISH_GENERATION, key, [x for kv in fields.items() for x in kv])


def publish_members(r: redis.Redis, key: str, generation_id: str, members: list[str], world_size: int,
                    fence: Fence | None = None) -> bool:
    """Publish generation ``generation_id``'s admitted members; False if the hash no longer carries it."""
    return _write(r, fence, _SET_IF_GENERATION, key, [generation_id, "members", json.dumps(members),
                                                      "world_size", world_size])


def publish_version(r: redis.Redis, key: str, generation_id: str, version: int, fence: Fence | None = None) -> bool:
    """Announce ``version`` in generation ``generation_id``; False (nothing written) if
    the hash no longer carries that generation, and so not its manifest either."""
    return _write(r, fence, _SET_IF_GENERATION, key, [generation_id, "version", version])


# KEYS: (fence), counters hash, sync hash; ARGV: (fence), the sync hash's name, a floor. The
# next generation number of that hash, above its counter, the number the hash carries and the
# floor, recorded as its counter. A value that is not a plain number (rewritten) counts as 0.
_NEXT_GENERATION = FENCE_CHECK + """
local function counted(v)
  if v and string.match(v, '^%d+$') and #v <= 15 then return tonumber(v) end
  return 0
end
local n = math.max(counted(redis.call('HGET', K[1], A[1])), counted(redis.call('HGET', K[2], 'generation')),
                   counted(A[2])) + 1
redis.call('HSET', K[1], A[1], string.format('%d', n))
return n
"""


def next_generation(r: redis.Redis, counters: str, key: str, floor: int, fence: Fence | None = None) -> int:
    """A number for the next generation of sync hash ``key``, never one used before: above
    its counter in hash ``counters`` (which it advances, fenced: a learner that lost its
    lease takes no number), the number ``key`` carries, and ``floor`` (what the learner
    itself remembers: its process's last and its disk's, :class:`GenerationFloor`)."""
    fence = fence or Fence(r, "")  # no lease: nothing to fence (tools, tests)
    return int(fence.run(r.register_script(_NEXT_GENERATION), [counters, key], [key, int(floor)]))


def take_generation(r: redis.Redis, counters: str, key: str, last: int, floor: GenerationFloor | None,
                    fence: Fence | None = None) -> int:
    """The learner's next generation of sync hash ``key`` (:func:`next_generation`): a
    number no generation of it had, even if the hash, its counter or all of Redis was lost,
    or the learner restarted (its ``last``, and its ``floor`` on disk, if any), recorded on
    disk before it is published."""
    generation = next_generation(r, counters, key, max(last, floor.get(key) if floor else 0), fence)
    if floor:
        floor.record(key, generation)
    return generation


class GenerationFloor:
    """The highest generation number the learner took for each sync hash, in a small JSON
    file on its disk (beside its checkpoints). Redis can lose the counter and the hash
    together (a restart without persistence, a restore from an older snapshot), and the
    learner can restart at the same time: then only its disk remembers which numbers
    workers have seen. Written before the generation is published, so no number a worker
    saw is missing from it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def read(self) -> dict[str, int]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:  # counted from Redis and this process alone; said so
            log.warning("cannot read the generation floor %s (%r): numbers come from Redis alone", self.path, e)
            return {}
        if not isinstance(raw, dict):
            return {}
        return {k: v for k, v in raw.items() if isinstance(v, int) and not isinstance(v, bool)}

    def get(self, key: str) -> int:
        return self.read().get(key, 0)

    def record(self, key: str, generation: int) -> None:
        """Record ``generation`` for ``key`` (atomically: a crash leaves the old file or the new)."""
        floors = self.read()
        floors[key] = max(generation, floors.get(key, 0))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(floors, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
