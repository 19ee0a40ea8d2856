"""The rollout worker's side of weight sync; runs inside the vLLM engine's worker process.

:meth:`WeightReceiver.receive` returns the complete set of new tensors or raises
:class:`SyncError`: the caller loads weights only after every bucket arrived, so a worker
never serves a half-applied update. The buckets land in buffers kept for the whole
generation, and the tensors are views into them (no copies); the caller must load them
before the next receive reuses the buffers.

In a generation whose manifest allows deltas, the buffers also hold the last version
received, and a version that arrives as a delta (weight_sync/delta.py) is applied to them
in place; a delta against anything but what they hold is refused (:class:`SyncError`:
the worker leaves the generation and rejoins, which brings it a full version).
"""

from __future__ import annotations


import torch

from rlpipe.auth import sync_token
from rlpipe.faults import crash_at
from weight_sync.delta import apply_version, bucket_checksums, payload_sizes
from weight_sync.delta_codec import DeltaMismatch
from weight_sync.gate import GateClient
from weight_sync.manifest import HEADER_LEN, Manifest, chunks, header_tensor, unpack_bucket
from weight_sync.transport import GlooGroup, SyncError, check_in

AHEAD = 4  # chunks of a whole version posted ahead of the one waited on (the sender packs into a ring of 4)


def join_group(host: str, port: int, slot: int | str, generation: int, timeout_s: float,
               refuse: str | None = None) -> tuple[GlooGroup, GateClient | None]:
    """Check in under ``slot`` (or refuse) on the learner's store and build this member's
    side of the generation's gloo group; returns it and the relay through the gate."""
    try:
        store, relay = GlooGroup.connect(host, port, timeout_s, sync_token())
    except Exception as e:
        raise SyncError(f"cannot reach the learner's store at {host}:{port}: {e}") from e
    try:
        rank, world_size = check_in(store, generation, slot, timeout_s, refuse)
        return GlooGroup(store, rank, world_size, host, generation, timeout_s, timeout_s), relay
    except BaseException:
        if relay is not None:
            relay.close()
        raise


def expect_header(group: GlooGroup, version: int, manifest: Manifest) -> None:
    """Receive a version's header and check it is ``version`` of ``manifest``."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    group.wait(group.recv(header, 0, 0))
    _check_header(header, version, manifest)


def _check_header(header: torch.Tensor, version: int, manifest: Manifest) -> None:
    if not torch.equal(header[:2], header_tensor(version, manifest.hash)[:2]):
        raise SyncError(f"expected version {version} with manifest {manifest.hash}, got header {header.tolist()}")


class WeightReceiver:
    def __init__(self, group: GlooGroup, generation: int, manifest: Manifest, relay: GateClient | None = None):
        self.group = group
        self.generation = generation
        self.manifest = manifest
        self.relay = relay  # the way through the learner's gate, with a sync token
        self.buffers = [torch.empty(b.nbytes, dtype=torch.uint8) for b in manifest.buckets]
        self.held: int | None = None  # the version the buffers hold whole (a delta's base), None when none
        self.crcs: list[int] = []  # their checksums, when the manifest allows deltas

    @classmethod
    def join(cls, host: str, port: int, slot: int | str, generation: int, manifest: Manifest, timeout_s: float,
             refuse: str | None = None) -> "WeightReceiver":
        """Check in under ``slot`` (or refuse, saying why) and join the generation's group.

        ``slot`` is what :func:`~weight_sync.transport.check_in_slot` gives the worker's
        follower: its check-in MAC when there is a sync token (this process proves the same
        token, from its environment, to the learner's gate), else its candidate number.
        Raises :class:`~weight_sync.transport.LeftOut` when the generation formed without
        this worker, :class:`SyncError` on any other failure, each within ``timeout_s``."""
        group, relay = join_group(host, port, slot, generation, timeout_s, refuse)
        return cls(group, generation, manifest, relay)

    def receive(self, version: int, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
        if manifest.hash != self.manifest.hash:
            raise SyncError(f"manifest {manifest.hash} is not generation {self.generation}'s {self.manifest.hash}")
        held, self.held = self.held, None  # until this version is whole in the buffers
        group = self.group
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header_work = group.recv(header, 0, 0)
        # Without deltas the first bucket is posted with the header (one round trip less
        # for small models); it is only loaded after the header checked out.
        spans = chunks(manifest)
        views = [self.buffers[c.bucket][c.start: c.end] for c in spans]
        works = [group.recv(views[0], 0, 1)] if views and not manifest.delta else []
        group.wait(header_work)
        _check_header(header, version, manifest)
        base, index_nbytes = int(header[2]), int(header[3])
        if base >= 0:
            self._apply_delta(version, base, held, index_nbytes)
        else:
            for j in range(len(views)):  # up to AHEAD chunks posted before waiting on chunk j
                while len(works) < min(j + AHEAD, len(views)):
                    k = len(works)
                    if spans[k].start == 0:  # a test may kill this engine here (rlpipe/faults.py)
                        crash_at(f"receiving:{version}:{spans[k].bucket}")
                    works.append(group.recv(views[k], 0, k + 1))
                group.wait(works[j])
            if manifest.delta:
                self.crcs = bucket_checksums(self.buffers)
        self.held = version
        return [w for bucket, buf in zip(manifest.buckets, self.buffers) for w in unpack_bucket(bucket, buf)]

    def _apply_delta(self, version: int, base: int, held: int | None, index_nbytes: int) -> None:
        """Receive a delta version whole (so the sender's sends all complete), then apply it
        to the buffers if they hold its base."""
        index = torch.empty(index_nbytes, dtype=torch.uint8)
        self.group.wait(self.group.recv(index, 0, 1))
        payloads = [torch.empty(n, dtype=torch.uint8) for n in payload_sizes(index)]
        works = [self.group.recv(p, 0, i + 2) for i, p in enumerate(payloads) if p.numel()]
        for work in works:
            self.group.wait(work)
        if held != base:
            raise SyncError(f"version {version} came as a delta against version {base}, but this worker holds "
                            f"{'nothing whole' if held is None else f'version {held}'}: rejoining for a full one")
        try:
            self.crcs = apply_version(self.manifest, self.buffers, self.crcs, index, payloads)
        except DeltaMismatch as e:
            raise SyncError(f"version {version}'s delta: {e}: rejoining for a full one") from e

    def close(self) -> None:
        self.group.close()
        if self.relay is not None:
            self.relay.close()
