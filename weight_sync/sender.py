"""The learner's side of weight sync: form a generation with the live workers, then
broadcast every new version as packed buckets.

Each broadcast starts with a small header (version, manifest hash) so a receiver can
refuse a transfer that is not the one it expects. Packing is pipelined with the
transfer: to workers on other hosts a whole version goes over gloo in chunks of
``CHUNK_BYTES`` (weight_sync/manifest.py ``chunks``), and chunk j+1 is cast and packed while
gloo's own thread sends chunk j, in a ring of a few chunk-sized buffers (so a model of one
bucket overlaps too, and the sender holds a few chunks, not two whole buckets). On
loopback (``host`` a loopback address: every worker on this machine) the "wire" is the
kernel's memory copies, which contend with the cast for the same memory bus, so nothing
can hide there and fewer, larger sends are faster: each bucket goes whole, bucket i+1
packed while bucket i is sent (bench/weight_sync_speed.py measures both). Under ``sync.transport: nccl``
or ``ipc`` the generation and the headers stay on gloo and the weights go over a device
data plane: an NCCL communicator of each member's own (weight_sync/nccl.py), or CUDA IPC
handles of a buffer on learner rank 0's GPU (weight_sync/ipc.py).

Membership: workers are identified by ``id -> incarnation`` (a token each worker
process draws at start and redraws to ask back in). A worker that does not check in
before the deadline is left out of the generation and stays out until its incarnation
changes, so it never costs the learner a second timeout. Each member has a gloo pair of
its own (weight_sync/transport.py :class:`GlooGroup`), and under nccl an NCCL communicator
of its own too (weight_sync/nccl.py), so a member whose transfer fails, because it died in
the middle or because it is alive but stopped reading, is given up on alone: the others
still get the version, and the generation goes on without it, with no forming at the next
sync. One that stopped reading costs the others at most ``straggler_s`` once (it is given
up on when it lags the first member to finish a step by that much). That rule is
weight_sync/stragglers.py's :class:`StragglerRule`, one for gloo, nccl and ipc, and the
bookkeeping of who is in and who was left out is weight_sync/membership.py's. A
generation's only member that fails is left out too (:meth:`WeightSender._reached_no_worker`):
its registry entry outlives it, and the next sync would otherwise wait a whole check-in
deadline for it.

A worker that *refuses* a generation (its engine cannot load the manifest: another model,
another quantization) raises :class:`~weight_sync.transport.IncompatibleWorker` naming it
and why: that is a configuration error no later generation would mend. Only a refusal of
this learner's own manifest does (the refusal names the manifest's hash): one of a manifest
rewritten in Redis is logged, and the worker asked again at the next sync.

Each generation's store sits behind a gate that admits only holders of the sync token,
and a candidate is admitted only on a check-in signed for its id and incarnation in the
registry, this generation and this manifest (weight_sync/transport.py, 'Authentication').
Without a token, ``host`` must be a loopback address (checked when the sender is made,
which is the learner's start).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable, Mapping

import redis
import torch

from rlpipe.auth import check_sync_exposure, is_loopback, sync_token
from rlpipe.fence import Fence
from rlpipe.keys import Keys
from rlpipe.transports import STAGED
from weight_sync.delta import bucket_checksums, encode_version
from weight_sync.device_plane import DeviceBroadcast
from weight_sync.gate import Gate
from weight_sync.manifest import Manifest, chunk_ring, chunks, header_tensor, pack_bucket, pack_chunk, plan_buckets
from weight_sync.membership import Membership
from weight_sync.rendezvous import (
    GenerationFloor,
    SyncState,
    generation_id,
    publish_generation,
    publish_members,
    publish_version,
    take_generation,
)
from weight_sync.stragglers import STRAGGLER_S, StragglerRule
from weight_sync.transport import GlooGroup, IncompatibleWorker, SyncError, admit, check_in_slot, publish_manifest

log = logging.getLogger(__name__)

# A whole version's gloo sends to other hosts: 16 MiB chunks, packed into a ring of 4 buffers
# (bench/weight_sync_speed.py: 0.99x a raw send of the same bytes on a link of 8 Gbit/s, against 0.93x
# for whole 256 MiB buckets at 100M parameters).
CHUNK_BYTES = 16 * 2**20
RING = 4


@dataclass
class SyncStats:
    """One version's sync: who got it, in which generation, and where the time went."""

    members: int  # workers that received the version
    generation: int
    form_s: float = 0.0  # forming a new generation (0 when the current one was reused)
    pack_s: float = 0.0  # packing buckets (overlapped with the transfer)
    prepare_s: float = 0.0  # quantizing and packing: set by the learner's channel (learner/channels.py)
    transfer_s: float = 0.0  # wall time of the transfer not hidden by packing
    sync_s: float = 0.0  # the whole broadcast, packing included
    bytes: int = 0  # per worker, on the wire
    full_bytes: int = 0  # per worker, of the version whole (what a full sync sends)
    delta: bool = False  # the version went as a delta against the previous one (weight_sync/delta.py)
    received: dict[str, str] = field(default_factory=dict)  # id -> incarnation of the workers it reached


class WeightSender:
    def __init__(self, r: redis.Redis, keys: Keys, host: str, timeout_s: float, bucket_bytes: int,
                 wire_dtype: torch.dtype | None, channel: str = "",
                 gather: Callable[[list[str]], Mapping[str, torch.Tensor]] | None = None, fence: Fence | None = None,
                 device: DeviceBroadcast | None = None, full_every: int = 0,
                 chunk_bytes: int | None = None, floor: GenerationFloor | None = None,
                 straggler_s: float = STRAGGLER_S):
        """``gather(names)``: for tensors that are shards (a learner under FSDP), those
        tensors whole, gathered with the other ranks; it is called for one bucket at a time,
        just before packing it, so the whole model is never gathered at once. ``fence``: the
        learner lease's (rlpipe/fence.py), so a learner that lost its lease publishes nothing.
        ``device``: versions travel over it (``sync.transport: nccl`` or ``ipc``, GPU only),
        the gloo group carrying only the generation, its control messages and each
        version's header; it names the manifest's transport. ``full_every``: with K > 0
        (gloo only), a generation's versions after its first travel as deltas against the
        one before (weight_sync/delta.py), and every K-th version whole. ``chunk_bytes``: the
        size of a whole version's gloo sends (a multiple of 8; 0: a bucket a send; None:
        ``CHUNK_BYTES``, or 0 on loopback, see the module docstring). ``floor``: the
        generation numbers taken, on the learner's disk (weight_sync/rendezvous.py): with
        it, a number is never used twice even when Redis lost everything and the learner
        restarted. ``straggler_s``: how long a member may still be receiving a send after
        another member took it, before it is given up on alone, on every transport
        (weight_sync/stragglers.py)."""
        self.r, self.keys, self.fence, self.floor = r, keys, fence, floor
        self.sync_key = keys.sync_channel(channel)
        check_sync_exposure(host)
        self.host, self.timeout_s, self.token = host, timeout_s, sync_token()
        self.bucket_bytes, self.wire_dtype, self.gather = bucket_bytes, wire_dtype, gather
        if chunk_bytes is None:
            chunk_bytes = 0 if is_loopback(host) else CHUNK_BYTES
        if chunk_bytes % 8:
            raise ValueError(f"chunk_bytes must be a multiple of 8, not {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.device = device
        self.group: GlooGroup | None = None
        self.gate: Gate | None = None  # the current generation's (with a token)
        self.state = SyncState()
        self.manifest: Manifest | None = None
        self.buffers: list[torch.Tensor] = []  # the ring a whole version's chunks are packed into in turn
        self.roster = Membership()  # who is in the generation, under which rank, and who was left out
        self.rule = StragglerRule(timeout_s, straggler_s)  # when a member is given up on (every transport)
        self.full_every = full_every if device is None else 0
        self.held: tuple[int, list[torch.Tensor], list[int]] | None = None  # (version, buckets, crcs) every member holds
        self.since_full = 0  # versions sent as deltas since the last whole one

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self.roster.members)

    @property
    def excluded(self) -> dict[str, str]:
        """id -> the incarnation that was left out."""
        return self.roster.excluded

    @property
    def left_out_total(self) -> int:
        return self.roster.left_out_total

    def needs_forming(self, live: Mapping[str, str]) -> bool:
        """Membership changed, or the sync hash lost this generation (see :meth:`lost`)."""
        return self.roster.candidates(live) != self.roster.members or self.lost()

    def lost(self) -> bool:
        """Whether the sync hash no longer carries the current generation (deleted, or
        Redis restored from an older snapshot): workers can no longer see its versions."""
        return self.group is not None and generation_id(self.r, self.sync_key) != self.state.generation_id

    def plan(self, tensors: Mapping[str, torch.Tensor], quant_profile: str = "", quant_compat: str = "",
             adapter: str = "") -> Manifest:
        """The manifest of ``tensors``: float tensors cast to ``wire_dtype`` (when set), the
        others (and all, without one) in their own dtype."""
        specs = [(name, self.wire_dtype if self.wire_dtype is not None and t.is_floating_point() else t.dtype,
                  tuple(t.shape)) for name, t in tensors.items()]
        return plan_buckets(specs, self.bucket_bytes, quant_profile, quant_compat,
                            self.device.transport if self.device else STAGED, delta=self.full_every > 0,
                            chunk_bytes=0 if self.device else self.chunk_bytes, adapter=adapter)

    def sync(self, version: int, named: Callable[[], Iterable[tuple[str, torch.Tensor]]],
             live: Mapping[str, str], quant_profile: str = "", quant_compat: str = "",
             adapter: str = "") -> SyncStats:
        """Bring the live workers (``id -> incarnation``) to ``version``, re-forming the
        generation when membership or the manifest changed (a recalibrated profile);
        returns timing stats and who got it."""
        deadline = time.monotonic() + self.timeout_s
        tensors = dict(named())
        manifest = self.plan(tensors, quant_profile, quant_compat, adapter)
        form_s = 0.0
        if self.group is None or self.needs_forming(live) or manifest != self.manifest:
            candidates = self.roster.candidates(live)
            if not candidates:
                self.drop()
                return SyncStats(members=0, generation=self.state.generation)
            t0 = time.perf_counter()
            self._form(candidates, version, manifest, deadline)
            form_s = time.perf_counter() - t0
        members, ranks = dict(self.roster.members), dict(self.roster.ranks)
        try:
            stats, failed = self._send(version, tensors)
        except SyncError:
            self.drop()
            raise
        self._give_up(failed)  # the others keep their pairs: the generation goes on without them
        stats.members, stats.generation, stats.form_s = len(members) - len(failed), self.state.generation, form_s
        stats.received = {w: inc for w, inc in members.items() if ranks[w] not in failed}
        return stats

    def _give_up(self, failed: dict[int, str]) -> None:
        """Members that failed or were late (rank -> why) are left out and leave the
        generation (their gloo pairs and device pairs closed); the others stay in it, under
        the ranks they have, so the next version needs no forming."""
        if not failed:
            return
        self.roster.leave_out_ranks(self.state.generation, failed)
        for rank in self.roster.forget(failed):
            self.group.abandon(rank)
            if self.device is not None:
                self.device.abandon(rank)
        publish_members(self.r, self.sync_key, self.state.generation_id, list(self.roster.members),
                        self.state.world_size, self.fence)

    def _reached_no_worker(self, version: int, failed: dict[int, str]) -> SyncError:
        """Every member failed (rank -> why): each is left out in its incarnation, as a
        failed member beside others is. One that died has a registry entry that outlives it
        (its TTL), and forming again with it would block for the whole check-in deadline,
        while its restart, or itself once its receive fails and it asks back in, comes with
        a new incarnation. (Each member has a pair of its own, so a failure names its member:
        in one shared group a hung member closed every pair, and the failures said nothing.)"""
        self.roster.leave_out_ranks(self.state.generation, failed)
        return SyncError(f"version {version} reached no worker: {next(iter(failed.values()))}")

    def _form(self, candidates: dict[str, str], version: int, manifest: Manifest, deadline: float) -> None:
        self.drop()
        if self.manifest is None or manifest.hash != self.manifest.hash:
            self.manifest, self.buffers = manifest, chunk_ring(manifest, RING)
        names = list(candidates)
        store, port, self.gate = GlooGroup.listen(self.host, self.timeout_s, self.token)
        generation = take_generation(self.r, self.keys.sync_generations, self.sync_key, self.state.generation,
                                     self.floor, self.fence)
        publish_manifest(store, generation, manifest.to_json())  # before any worker can read the generation
        self.state = SyncState(generation, self.host, port, 0, tuple(names), (), version,
                               manifest.to_json(), manifest.hash, tuple(candidates.values()), uuid.uuid4().hex[:12])
        publish_generation(self.r, self.sync_key, self.state, self.fence)
        log.info("sync generation %d: candidates %s", generation, names)
        slots = [check_in_slot(self.token, generation, c, w, candidates[w], manifest.hash)
                 for c, w in enumerate(names, 1)]
        admitted, left_out = admit(store, generation, slots, deadline)
        refused = self.roster.refusals(generation, {names[c - 1]: why for c, why in left_out.items()}, candidates,
                                       manifest.hash)
        if refused:
            self.drop()
            raise IncompatibleWorker("; ".join(f"worker {w} cannot take the learner's weights: {why}"
                                               for w, why in refused.items()))
        members = [names[c - 1] for c in admitted]
        self.state.members, self.state.world_size = tuple(members), 1 + len(members)
        # If the hash was lost meanwhile this writes nothing; the version's publication notices.
        publish_members(self.r, self.sync_key, self.state.generation_id, members, self.state.world_size,
                        self.fence)
        if not members:
            raise SyncError(f"generation {generation}: no worker checked in")
        try:
            # Each admitted worker builds its side within its sync timeout of its answer (just
            # sent), whatever part of the deadline waiting on a missing candidate took.
            self.group = GlooGroup(store, 0, self.state.world_size, self.host, generation, self.timeout_s,
                                   self.timeout_s)
            failed = self.device.open(self.group, self.rule) if self.device else {}
        except SyncError:
            self.drop()
            raise
        self.roster.admit(members, candidates)
        self._give_up(failed)  # under nccl: who did not join its communicator in time (weight_sync/nccl.py)
        if not self.roster.ranks:
            self.drop()
            raise SyncError(f"generation {generation}: no member joined the {self.device.transport} transfer: "
                            f"{next(iter(failed.values()))}")

    def _send(self, version: int, tensors: dict[str, torch.Tensor]) -> tuple[SyncStats, dict[int, str]]:
        """Send the header and every bucket to each member; a member whose transfer fails
        is given up on (the second result: rank -> why) while the others go on."""
        assert self.group is not None and self.manifest is not None
        group, failed = self.group, {}
        t0 = time.perf_counter()
        if not publish_version(self.r, self.sync_key, self.state.generation_id, version, self.fence):
            raise SyncError(f"the sync hash {self.sync_key} lost generation {self.state.generation} (deleted, or "
                            f"restored from an older snapshot) before version {version}; the next sync forms a new one")

        post = partial(group.post, ranks=list(self.roster.ranks.values()), failed=failed)  # post(tensor, tag)
        finish = partial(group.finish, failed=failed, rule=self.rule)  # finish(what post returned)
        if self.manifest.delta:
            return self._send_keeping(version, tensors, post, finish, failed, t0)
        in_flight = post(header_tensor(version, self.manifest.hash), 0)
        if self.device:
            return self._broadcast_device(version, tensors, in_flight, finish, failed, t0)
        pack_s, sending, source, packed_bucket = 0.0, [], None, -1  # sending: the chunks on the wire, oldest first
        for j, chunk in enumerate(chunks(self.manifest)):
            bucket = self.manifest.buckets[chunk.bucket]
            if len(sending) == len(self.buffers):  # chunk j - RING's send, the last use of its buffer
                finish(sending.pop(0))
            buf = self.buffers[j % len(self.buffers)][: chunk.end - chunk.start]
            tp = time.perf_counter()
            if chunk.bucket != packed_bucket:  # a sharded learner's bucket, gathered whole once
                source = None  # (the last bucket's freed first)
                source = self.gather([slot.name for slot in bucket.tensors]) if self.gather else tensors
                packed_bucket = chunk.bucket
            pack_chunk(bucket, chunk, source, buf)  # while the chunks before it are on the wire
            pack_s += time.perf_counter() - tp
            sending.append(post(buf, j + 1))
            finish(in_flight)  # the header's sends (then nothing)
            in_flight = {}
        del source
        for works in [in_flight, *sending]:
            finish(works)
        if len(failed) == len(self.roster.ranks):
            raise self._reached_no_worker(version, failed)
        total = time.perf_counter() - t0
        self.state.version = version
        # transfer_s is the wall time not spent packing (the part packing did not hide).
        return SyncStats(0, 0, pack_s=pack_s, transfer_s=total - pack_s, sync_s=total, bytes=self.manifest.nbytes,
                         full_bytes=self.manifest.nbytes), failed

    def _send_keeping(self, version: int, tensors: dict[str, torch.Tensor], post: Callable, finish: Callable,
                      failed: dict[int, str], t0: float) -> tuple[SyncStats, dict[int, str]]:
        """A generation that allows deltas: every bucket is packed and kept (the next
        version's base, as each member keeps it), and the version goes as deltas against
        the last one every member holds, or whole: the generation's first, every
        ``full_every``-th, and any whose deltas would not save a tenth. A version known to
        go whole sends each bucket's chunks as soon as it is packed; a delta needs every
        bucket encoded first (its index, which comes first, sizes them all)."""
        manifest = self.manifest
        held, self.held = self.held, None  # until every member has this version
        may_delta = held is not None and self.since_full + 1 < self.full_every
        spans = list(enumerate(chunks(manifest), 1))  # (tag, chunk)
        works = [] if may_delta else [post(header_tensor(version, manifest.hash), 0)]
        pack_s, packed = 0.0, []
        for i, bucket in enumerate(manifest.buckets):
            tp = time.perf_counter()
            source = self.gather([slot.name for slot in bucket.tensors]) if self.gather else tensors
            packed.append(pack_bucket(bucket, source))
            del source
            pack_s += time.perf_counter() - tp
            if not may_delta:  # on the wire while the next bucket is packed
                works += [post(packed[i][c.start: c.end], tag) for tag, c in spans if c.bucket == i]
        index = None
        if may_delta:
            tp = time.perf_counter()
            index, deltas, crcs = encode_version(manifest, held[1], packed, held[2])
            pack_s += time.perf_counter() - tp
            if index.numel() + sum(d.numel() for d in deltas) < 0.9 * manifest.nbytes:
                works.append(post(header_tensor(version, manifest.hash, held[0], index.numel()), 0))
                works += [post(index, 1)] + [post(d, 2 + i) for i, d in enumerate(deltas) if d.numel()]
            else:
                index = None
                works.append(post(header_tensor(version, manifest.hash), 0))
                works += [post(packed[c.bucket][c.start: c.end], tag) for tag, c in spans]
        if index is None:
            crcs = bucket_checksums(packed)  # while the buckets are on the wire
        for w in works:
            finish(w)
        if len(failed) == len(self.roster.ranks):
            raise self._reached_no_worker(version, failed)
        total = time.perf_counter() - t0
        self.state.version = version
        if not failed:
            self.held = (version, packed, crcs)
            self.since_full = self.since_full + 1 if index is not None else 0
        sent = manifest.nbytes if index is None else index.numel() + sum(d.numel() for d in deltas)
        return SyncStats(0, 0, pack_s=pack_s, transfer_s=total - pack_s, sync_s=total, bytes=sent,
                         full_bytes=manifest.nbytes, delta=index is not None), failed

    def _broadcast_device(self, version: int, tensors: dict[str, torch.Tensor], headers: dict, finish: Callable,
                          failed: dict[int, str], t0: float) -> tuple[SyncStats, dict[int, str]]:
        """The version over the device data plane to the members that took its header. Each
        member has a data plane of its own (an NCCL communicator; under ipc its gloo pair,
        for the handles and acks), so a member lost at the header, or failed or late during
        the transfer by the rule gloo's sends follow (weight_sync/stragglers.py), is given
        up on alone: the others get the version."""
        finish(headers)
        live = [rank for rank in self.roster.ranks.values() if rank not in failed]
        if live:
            for rank, why in self.device.broadcast(self.manifest, tensors, self.gather, live).items():
                failed.setdefault(rank, why)
        if len(failed) == len(self.roster.ranks):
            raise self._reached_no_worker(version, failed)
        total = time.perf_counter() - t0
        self.state.version = version
        return SyncStats(0, 0, transfer_s=total, sync_s=total, bytes=self.manifest.nbytes,
                         full_bytes=self.manifest.nbytes), failed

    def drop(self) -> None:
        if self.device is not None:
            self.device.close()
        if self.group is not None:
            self.group.close()
        if self.gate is not None:
            self.gate.close()
        self.group = self.gate = None
        self.roster.clear()
        self.held = None  # a new generation's members hold nothing: its first version goes whole
