"""The rollout worker's side of weight sync; runs inside the vLLM engine's worker process.

:meth:`WeightReceiver.receive` returns the complete set of new tensors or raises
:class:`SyncError`: the caller loads weights only after every bucket arrived, so a worker
never serves a half-applied update.
"""

from __future__ import annotations

import torch

from weight_sync.manifest import Manifest, unpack_bucket
from weight_sync.sender import header_tensor
from weight_sync.transport import GlooGroup, SyncError


class WeightReceiver:
    def __init__(self, group: GlooGroup, generation: int):
        self.group = group
        self.generation = generation

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, generation: int,
             timeout_s: float, join_timeout_s: float) -> "WeightReceiver":
        try:
            store = GlooGroup.connect(host, port, world_size, join_timeout_s)
        except Exception as e:
            raise SyncError(f"cannot reach the learner's store at {host}:{port}: {e}") from e
        return cls(GlooGroup(store, rank, world_size, host, generation, timeout_s, join_timeout_s), generation)

    def receive(self, version: int, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
        header = torch.zeros(2, dtype=torch.int64)
        self.group.broadcast(header)
        expected = header_tensor(version, manifest.hash)
        if not torch.equal(header, expected):
            raise SyncError(f"expected version {version} with manifest {manifest.hash}, got header {header.tolist()}")
        weights = []
        for bucket in manifest.buckets:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
            self.group.broadcast(buf)
            weights += unpack_bucket(bucket, buf)
        return weights

    def close(self) -> None:
        self.group.close()
