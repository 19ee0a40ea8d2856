"""The learner's side of weight sync: form a generation with the live workers, then
broadcast every new version as packed buckets.

Each broadcast starts with a small header (version, manifest hash) so a receiver can
refuse a transfer that is not the one it expects. Any failure (a worker died, a timeout)
raises :class:`SyncError` after at most the configured timeout and drops the generation;
the next call to :meth:`WeightSender.sync` forms a new one from the workers alive then.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import redis
import torch

from rlpipe.queue import Keys
from weight_sync.manifest import Manifest, pack_bucket, plan_buckets
from weight_sync.rendezvous import SyncState, publish_generation, publish_version, read_sync
from weight_sync.transport import GlooGroup, SyncError

log = logging.getLogger(__name__)


def header_tensor(version: int, manifest_hash: str) -> torch.Tensor:
    return torch.tensor([version, int(manifest_hash[:15], 16)], dtype=torch.int64)


class WeightSender:
    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        host: str,
        timeout_s: float,
        join_timeout_s: float,
        bucket_bytes: int,
        wire_dtype: torch.dtype,
    ):
        self.r, self.keys = r, keys
        self.host, self.timeout_s, self.join_timeout_s = host, timeout_s, join_timeout_s
        self.bucket_bytes, self.wire_dtype = bucket_bytes, wire_dtype
        self.group: GlooGroup | None = None
        self.state = SyncState()
        self.manifest: Manifest | None = None
        self.buffers: list[torch.Tensor] = []

    @property
    def members(self) -> tuple[str, ...]:
        return self.state.members if self.group else ()

    def sync(self, version: int, named: Callable[[], Iterable[tuple[str, torch.Tensor]]], live_workers: list[str]) -> dict:
        """Bring every live worker to ``version``; re-forms the generation when membership changed.

        Returns timing stats. Raises SyncError if a transfer fails (the generation is then
        dropped and re-formed on the next call).
        """
        tensors = dict(named())
        stats = {"formed": 0.0}
        if self.group is None or set(live_workers) != set(self.state.members):
            if not live_workers:
                self.drop()
                return {"members": 0}
            t0 = time.perf_counter()
            self._form(sorted(live_workers), version, tensors)
            stats["formed"] = time.perf_counter() - t0
        try:
            stats.update(self._broadcast(version, tensors))
        except SyncError:
            self.drop()
            raise
        stats["members"] = len(self.state.members)
        stats["generation"] = self.state.generation
        return stats

    def _form(self, members: list[str], version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.drop()
        specs = [(name, self.wire_dtype if t.is_floating_point() else t.dtype, tuple(t.shape)) for name, t in tensors.items()]
        self.manifest = plan_buckets(specs, self.bucket_bytes)
        self.buffers = [torch.empty(b.nbytes, dtype=torch.uint8) for b in self.manifest.buckets]
        world = 1 + len(members)
        store = GlooGroup.listen(self.host, world, self.join_timeout_s)
        generation = read_sync(self.r, self.keys).generation + 1
        self.state = SyncState(generation, self.host, store.port, world, tuple(members), version,
                               self.manifest.to_json(), self.manifest.hash)
        publish_generation(self.r, self.keys, self.state)
        log.info("sync generation %d: waiting for %s", generation, members)
        try:
            self.group = GlooGroup(store, 0, world, self.host, generation, self.timeout_s, self.join_timeout_s)
        except SyncError:
            self.drop()
            raise

    def _broadcast(self, version: int, tensors: dict[str, torch.Tensor]) -> dict:
        assert self.group is not None and self.manifest is not None
        t0 = time.perf_counter()
        for bucket, buf in zip(self.manifest.buckets, self.buffers):
            pack_bucket(bucket, tensors, buf)
        t1 = time.perf_counter()
        publish_version(self.r, self.keys, version)
        self.group.broadcast(header_tensor(version, self.manifest.hash))
        for buf in self.buffers:
            self.group.broadcast(buf)
        t2 = time.perf_counter()
        self.state.version = version
        return {"pack_s": t1 - t0, "transfer_s": t2 - t1, "bytes": self.manifest.nbytes}

    def drop(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None
