"""The sync rendezvous in Redis: the ``rlpipe:{run}:sync`` hash (DESIGN.md, 'Weight sync');
in a fleet of mixed precisions, one hash per precision (``sync:int8``, ``sync:bf16``, see
``Keys.sync_channel``), since each precision gets other tensors.

The learner publishes a *generation* (who takes part, where rank 0 listens, the bucket
manifest) and then each *version* it broadcasts. Workers poll the hash: a new generation
that lists them as ``candidates`` means "check in" (the i-th candidate checks in as
candidate i+1; with a sync token, under a MAC of its id and incarnation, see
weight_sync/transport.py), a higher version means "receive". Besides DESIGN.md's fields the hash
carries ``candidates``, ``incarnations`` (the incarnation the learner expects of each
candidate, which a worker's check-in must be signed for), ``members`` (JSON lists: the
workers asked, and those admitted, published once the generation formed) and
``manifest_hash``; ``world_size`` is the admitted world.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis


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
    )


def publish_generation(r: redis.Redis, key: str, state: SyncState) -> None:
    r.hset(key, mapping={
        "generation": state.generation,
        "master_addr": state.master_addr,
        "master_port": state.master_port,
        "world_size": state.world_size,
        "candidates": json.dumps(list(state.candidates)),
        "members": json.dumps(list(state.members)),
        "version": state.version,
        "manifest": state.manifest,
        "manifest_hash": state.manifest_hash,
        "incarnations": json.dumps(list(state.incarnations)),
    })


def publish_members(r: redis.Redis, key: str, members: list[str], world_size: int) -> None:
    r.hset(key, mapping={"members": json.dumps(members), "world_size": world_size})


def publish_version(r: redis.Redis, key: str, version: int) -> None:
    r.hset(key, "version", version)
