"""``sync.transport: nccl`` (weight_sync/nccl.py, weight_sync/device_updates.py): every
decision rlpipe makes about it, on CPU. Which transport a run uses and where; the gloo
handshake that places each engine's processes in the NCCL group; the tensors, order,
dtypes and shapes a version travels as (the same bytes the gloo path delivers); the
sender's sequence around the broadcast, one communicator per member, and a hung member
given up on alone by the rule gloo follows; the engine arguments. Only the CUDA calls
(NCCL's init, the event and the broadcast on a pair's stream) are left out: ``CpuBroadcast``
stands in for them, and they are untested without a GPU."""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import time

import pytest
import torch

from launch.gpus import plan_gpus
from rlpipe.config import ConfigError
from rlpipe.keys import Keys
from tests.conftest import free_run_id
from tests.test_gpus import cfg_with
from weight_sync.manifest import Manifest, incompatibility, pack_bucket, unpack_bucket
from weight_sync.nccl import (
    NUM_BUFFERS,
    NcclBroadcast,
    learner_handshake,
    pair_world,
    update_info,
    wire_tensors,
    worker_handshake,
)
from weight_sync.receiver import expect_header, join_group
from weight_sync.sender import WeightSender
from weight_sync.transport import GlooGroup, SyncError
from weight_sync.transport_choice import resolve_transport

# Chunks smaller than a tensor (vLLM's pack_tensors warns), so that a version is many of them.
SMALL_CHUNKS = pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")


def test_auto_is_nccl_where_cuda_is_and_nccl_is_refused_where_it_is_not():
    assert resolve_transport("auto", 0) == "gloo" and resolve_transport("auto", 8) == "nccl"
    assert resolve_transport("gloo", 8) == "gloo" and resolve_transport("nccl", 1) == "nccl"
    with pytest.raises(ValueError, match="sync.transport: nccl .* this machine has none"):
        resolve_transport("nccl", 0)
    assert resolve_transport("ipc", 1) == "ipc"
    with pytest.raises(ValueError, match="sync.transport: ipc shares the learner's CUDA memory .* this machine has none"):
        resolve_transport("ipc", 0)


def test_a_launch_decides_the_transport_once_for_every_role_and_never_nccl_on_a_shared_gpu():
    plan = plan_gpus(cfg_with(workers=3), 4)  # learner on 0, workers on 1-3
    assert plan.transport == "nccl"
    assert plan.learner_env()["RLPIPE_SYNC__TRANSPORT"] == plan.worker_env(2)["RLPIPE_SYNC__TRANSPORT"] == "nccl"
    # A worker on the learner's first GPU: NCCL cannot place two ranks on one GPU.
    shared = {"learner.gpus": "0", "rollout.gpus": "0-1"}
    assert plan_gpus(cfg_with(workers=2, **shared), 2).transport == "gloo"
    with pytest.raises(ConfigError, match="sync.transport: nccl cannot reach worker 0, which shares GPU 0"):
        plan_gpus(cfg_with(workers=2, **{**shared, "sync.transport": "nccl"}), 2)
    assert plan_gpus(cfg_with(workers=1, **{"learner.gpus": "1", "rollout.gpus": "0", "learner.ranks": 1}),
                     2).transport == "nccl"  # the learner's other ranks may share: only rank 0 sends
    with pytest.raises(ConfigError, match="sync.transport: nccl moves weights between CUDA devices"):
        plan_gpus(cfg_with(**{"sync.transport": "nccl"}), 0)
    assert plan_gpus(cfg_with(), 0).learner_env() == {}  # no GPUs: nothing set, each role resolves gloo


def test_each_engine_process_gets_its_own_rank_in_its_members_communicator():
    assert pair_world(1) == 2 and pair_world(4) == 5  # the learner is rank 0, a TP=4 engine ranks 1-4
    with pytest.raises(SyncError):
        pair_world(0)


def _gloo_world(size: int, timeout_s: float = 5):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups, threads = {}, []

    def join(rank):
        client = store if rank == 0 else TCPStore("127.0.0.1", store.port, is_master=False)
        groups[rank] = GlooGroup(client, rank, size, "127.0.0.1", 1, timeout_s, timeout_s)

    for rank in range(size):
        threads.append(threading.Thread(target=join, args=(rank,)))
        threads[-1].start()
    for t in threads:
        t.join()
    return [groups[r] for r in range(size)]


def test_the_handshake_gives_every_member_its_own_communicator_id_and_the_buffer_geometry():
    learner, tp2, single = _gloo_world(3)
    unique_ids = {1: os.urandom(128), 2: os.urandom(128)}
    answers = {}
    threads = [threading.Thread(target=lambda g=g, k=k: answers.__setitem__(k, worker_handshake(g, k)))
               for g, k in ((tp2, 2), (single, 1))]
    for t in threads:
        t.start()
    assert learner_handshake(learner, unique_ids, 64 << 20) == {1: 3, 2: 2}  # rank -> its communicator's size
    for t in threads:
        t.join()
    for k, rank, world in ((2, 1, 3), (1, 2, 2)):
        info = answers[k]
        assert (info["rank_offset"], info["world_size"]) == (1, world)  # the learner is rank 0 of each
        assert base64.b64decode(info["nccl_unique_id_b64"]) == unique_ids[rank]  # a communicator of its own
        assert info["packed"] and info["packed_buffer_size_bytes"] == 64 << 20 and info["packed_num_buffers"] == 2
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    NCCLWeightTransferInitInfo(**answers[2])  # vLLM's own engine takes it as its init info
    for g in (learner, tp2, single):
        g.close()


def test_a_member_that_never_shakes_hands_is_given_up_on_alone_within_the_timeout():
    learner, absent, present = _gloo_world(3, timeout_s=2)
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(worker_handshake(present, 1)))
    thread.start()
    failed = {}
    t0 = time.monotonic()
    assert learner_handshake(learner, {1: os.urandom(128), 2: os.urandom(128)}, 1 << 20, failed=failed) == {2: 2}
    assert time.monotonic() - t0 < 10 and list(failed) == [1]
    thread.join(10)
    assert answer["world_size"] == 2
    for g in (learner, absent, present):
        g.close()


def weights():
    gen = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(50, 16, generator=gen), "layer.q.weight": torch.randn(16, 16, generator=gen),
            "layer.q.weight_scale": torch.rand(16, 1, generator=gen), "norm": torch.randn(16, generator=gen),
            "layer.q.qweight": torch.randint(-127, 127, (16, 16), dtype=torch.int8, generator=gen)}


@SMALL_CHUNKS
def test_a_version_travels_as_the_update_info_says_and_as_the_same_bytes_as_over_gloo():
    """vLLM's receiver cuts the packed buffers by the update info alone: it must list exactly
    the tensors sent, in order, with their wire dtype and shape; the values must be what the
    gloo path delivers (bf16 on the wire here, int8 as it is)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

    tensors = weights()
    sender = WeightSender(None, Keys("t"), "127.0.0.1", 5, bucket_bytes=2048, wire_dtype=torch.bfloat16,
                          device=NcclBroadcast(2048, 5))
    manifest = sender.plan(tensors)
    assert manifest.transport == "nccl" and len(manifest.buckets) > 2
    info = update_info(manifest)
    sent = list(wire_tensors(manifest, tensors, "cpu"))
    assert [n for n, _ in sent] == info["names"] and sorted(info["names"]) == sorted(tensors)
    # The learner's chunks are cut where vLLM's consumer cuts them: tensors until past the buffer size.
    packed, items = [], iter(sent)
    while (chunk := NcclBroadcast(64, 5)._pack(items)) is not None:
        packed.append(chunk.numel())
    cuts, size = [], 0
    for n in (t.numel() * t.element_size() for _, t in sent):  # packed_nccl_broadcast_consumer's rule
        size += n
        if size > 64:
            cuts, size = cuts + [size], 0
    assert len(packed) > 2 and packed == cuts + ([size] if size else [])
    assert [str(t.dtype).removeprefix("torch.") for _, t in sent] == info["dtype_names"]
    assert [list(t.shape) for _, t in sent] == info["shapes"]
    over_gloo = {}
    for bucket in manifest.buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        over_gloo.update(unpack_bucket(bucket, pack_bucket(bucket, tensors, buf)))
    # Packed as vLLM's producer packs, unpacked by the update info as its consumer does.
    chunk = pack_tensors(iter(sent), lambda item: item[1], 1 << 30)
    dtypes = [getattr(torch, d) for d in info["dtype_names"]]
    sizes = [t.numel() * t.element_size() for _, t in sent]
    received = unpack_tensor(chunk.packed_tensor, info["names"], info["shapes"], dtypes, sizes)
    for name, t in received:
        assert t.dtype == over_gloo[name].dtype and torch.equal(t, over_gloo[name]), name


def test_a_gloo_engine_refuses_an_nccl_generation_naming_the_setting():
    tensors = weights()
    nccl = WeightSender(None, Keys("t"), "127.0.0.1", 5, 1 << 20, None, device=NcclBroadcast(1 << 20, 5)).plan(tensors)
    gloo = WeightSender(None, Keys("t"), "127.0.0.1", 5, 1 << 20, None).plan(tensors)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    assert "transport" not in gloo.to_json()  # gloo's manifests read as they always did
    assert Manifest.from_json(nccl.to_json()) == nccl
    assert incompatibility(gloo, shapes) is None and incompatibility(nccl, shapes, transport="nccl") is None
    why = incompatibility(nccl, shapes)
    assert why.startswith("the learner sends over nccl, this worker's engine was started for gloo") and \
        "sync.transport" in why
    assert "over gloo" in incompatibility(gloo, shapes, transport="nccl")


class CpuComm:
    """A member's communicator as the learner holds it: ``destroy`` is NCCL's abort."""

    def __init__(self, world):
        self.world, self.aborted = world, threading.Event()

    def destroy(self):
        self.aborted.set()


class CpuBroadcast(NcclBroadcast):
    """The learner's NCCL data plane with the CUDA calls left out: the handshake, the pairs,
    their threads, the chunks and the rule are real; each pair's broadcast records the chunk
    it would have sent. ``hang``: members whose broadcast never ends (they stopped
    receiving), until their communicator is aborted, as an NCCL kernel spins until then."""

    def __init__(self, *args, hang=()):
        super().__init__(*args)
        self.hang = set(hang)
        self.sent: dict[int, list[torch.Tensor]] = {}  # member rank -> the chunks it was sent, in order
        self.comms: list[CpuComm] = []
        self.versions = 0

    @property
    def inits(self) -> list[int]:
        return sorted(c.world for c in self.comms)

    def _unique_id(self):
        return os.urandom(128)

    def _init(self, unique_id, world):
        self.comms.append(CpuComm(world))
        return self.comms[-1]

    def _device(self):
        return torch.device("cpu")

    def _ready(self):
        return None

    def _send(self, pair, chunk, ready):
        if pair.rank in self.hang:
            pair_comm = pair.comm
            assert pair_comm.aborted.wait(60)
            raise RuntimeError("NCCL error: the communicator was aborted")
        self.sent.setdefault(pair.rank, []).append(chunk.clone())

    def broadcast(self, *args, **kwargs):
        self.versions += 1
        return super().broadcast(*args, **kwargs)

    def packed(self, manifest, tensors) -> torch.Tensor:
        """A whole version's bytes, as they go over each member's communicator."""
        items = wire_tensors(manifest, tensors, "cpu")
        return torch.cat(list(iter(lambda: self._pack(items), None)))


class Member:
    """A rollout worker's gloo side under nccl, as weight_sync/device_updates.py runs it,
    up to where vLLM's engine would take over: it joins, shakes hands, takes headers."""

    def __init__(self, worker_id: str, engine_ranks: int):
        self.worker_id, self.engine_ranks = worker_id, engine_ranks
        self.info, self.versions, self.group, self.version = None, [], None, -1

    async def join(self, host, port, slot, generation, manifest, timeout_s):
        from weight_sync.follower import SyncOutcome

        self.group, _ = await asyncio.to_thread(join_group, host, port, slot, generation, timeout_s)
        self.info = await asyncio.to_thread(worker_handshake, self.group, self.engine_ranks)
        return SyncOutcome(True)

    async def update(self, version, manifest):
        from weight_sync.follower import SyncOutcome

        await asyncio.to_thread(expect_header, self.group, version, manifest)
        self.versions.append(version)
        self.version = version
        return SyncOutcome(True)


def release(stops, sender, threads) -> None:
    """The end of every sync test here: the followers told to stop, the sender's store and pairs
    dropped (which ends any receive still waiting), then the follower threads joined."""
    for stop in stops:
        stop.set()
    sender.drop()
    for t in threads:
        t.join(10)


def follow(redis_url, run_id, member, stopping: threading.Event, worker_id: str = ""):
    """``member`` followed as a rollout worker follows the learner (``worker_id``: its
    own, unless given), in a thread of its own until ``stopping``."""
    from rlpipe.redis_link import connect
    from weight_sync.follower import WeightFollower

    async def run():
        stop = asyncio.Event()

        async def watch():
            while not stopping.is_set():
                await asyncio.sleep(0.05)
            stop.set()

        async def published(_):
            pass

        watcher = asyncio.create_task(watch())
        follower = WeightFollower(connect(redis_url), Keys(run_id).sync, worker_id or member.worker_id, member, 5.0,
                                  lambda: None, lambda s: None, lambda e: None, published)
        await follower.run(stop, poll_s=0.02)
        await watcher

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    return thread


@SMALL_CHUNKS
def test_the_sender_opens_nccl_after_admission_and_broadcasts_each_version_after_its_headers(redis_server, r):
    """Each member over a communicator of its own; and a member lost before a version is
    given up on alone: the other gets the version in the same generation, with no forming."""
    run_id = free_run_id("nccl")
    members = [Member("w0", 2), Member("w1", 1)]
    stops = [threading.Event() for _ in members]
    threads = [follow(redis_server.url, run_id, m, stop) for m, stop in zip(members, stops)]
    plane = CpuBroadcast(256, 10)
    sender = WeightSender(r, Keys(run_id), "127.0.0.1", 5, 1 << 20, torch.bfloat16, device=plane)
    tensors = weights()
    live = {m.worker_id: "" for m in members}  # without a sync token a candidate checks in under its number
    try:
        stats = sender.sync(1, lambda: tensors.items(), live)
        assert stats.members == 2 and plane.inits == [2, 3]  # the learner + a single engine; + a TP=2 one
        assert [(m.info["rank_offset"], m.info["world_size"]) for m in members] == [(1, 3), (1, 2)]
        version = plane.packed(sender.manifest, tensors)
        assert len(plane.sent[1]) > NUM_BUFFERS and all(torch.equal(torch.cat(plane.sent[r]), version) for r in (1, 2))
        sender.sync(2, lambda: tensors.items(), live)
        assert plane.inits == [2, 3] and plane.versions == 2  # the generation (and its communicators) reused
        deadline = time.monotonic() + 10
        while any(m.versions != [1, 2] for m in members) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [m.versions for m in members] == [[1, 2], [1, 2]]  # each took both headers first
        stops[1].set()  # w1 dies
        threads[1].join(10)
        members[1].group.close()
        generation = stats.generation
        stats = sender.sync(3, lambda: tensors.items(), live)
        assert (stats.members, stats.generation, stats.form_s, sorted(stats.received)) == (1, generation, 0, ["w0"])
        assert sender.excluded == {"w1": ""} and sender.left_out_total == 1 and sender.members == ("w0",)
        w1_comm = next(c for c in plane.comms if c.world == 2)
        assert w1_comm.aborted.is_set() and list(plane.pairs) == [1]  # its communicator alone aborted
        assert torch.equal(torch.cat(plane.sent[1]), torch.cat([version] * 3))  # w0: every version
        assert torch.equal(torch.cat(plane.sent[2]), torch.cat([version] * 2))  # w1: none after it died
        stats = sender.sync(4, lambda: tensors.items(), live)  # still registered: its heartbeat lingers
        assert stats.members == 1 and stats.form_s == 0 and plane.inits == [2, 3] and plane.versions == 4
    finally:
        release(stops, sender, threads)


@SMALL_CHUNKS
def test_a_member_that_stops_receiving_over_nccl_is_given_up_on_alone_and_the_other_gets_every_version(
        redis_server, r):
    """The nccl counterpart of tests/test_weight_sync.py's hung gloo member, by the same rule
    (weight_sync/stragglers.py): w1 takes its headers but its broadcast never ends (an NCCL
    kernel waiting on a peer that stopped). Within ``straggler_s`` of w0 having each chunk it
    is given up on, its communicator alone aborted; w0 gets that version and the next ones
    on time in the same generation. (One communicator of everyone cost both the version.)"""
    run_id = free_run_id("ncclhang")
    members = [Member("w0", 1), Member("w1", 1)]
    stops = [threading.Event() for _ in members]
    threads = [follow(redis_server.url, run_id, m, stop) for m, stop in zip(members, stops)]
    plane = CpuBroadcast(256, 30, hang={2})
    sender = WeightSender(r, Keys(run_id), "127.0.0.1", 30, 1 << 20, torch.bfloat16, device=plane, straggler_s=1.0)
    tensors, live = weights(), {m.worker_id: "" for m in members}
    try:
        t0 = time.monotonic()
        stats = sender.sync(1, lambda: tensors.items(), live)
        assert time.monotonic() - t0 < 1.0 + 8  # the straggler deadline, not the 30 s sync timeout
        assert sorted(stats.received) == ["w0"] and sender.excluded == {"w1": ""} and sender.left_out_total == 1
        assert torch.equal(torch.cat(plane.sent[1]), plane.packed(sender.manifest, tensors)) and 2 not in plane.sent
        assert sum(c.aborted.is_set() for c in plane.comms) == 1  # w1's communicator alone aborted
        assert list(plane.pairs) == [1] and not plane.pairs[1].comm.aborted.is_set()
        generation = stats.generation
        for version in (2, 3):
            t0 = time.monotonic()
            stats = sender.sync(version, lambda: tensors.items(), live)  # w1 still listed, still hung
            assert time.monotonic() - t0 < 1.0, "on time: no straggler wait, no forming"
            assert (stats.members, stats.generation, stats.form_s) == (1, generation, 0)
        assert torch.equal(torch.cat(plane.sent[1]), torch.cat([plane.packed(sender.manifest, tensors)] * 3))
        assert 2 not in plane.sent and sender.left_out_total == 1
    finally:
        release(stops, sender, threads)


def test_a_launch_refuses_nccl_without_cuda_and_a_tp_engine_without_nccl():
    from launch.checks import validate_run

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    with pytest.raises(ConfigError, match="sync.transport: nccl moves weights between CUDA devices"):
        validate_run(cfg_with(**{"sync.transport": "nccl"}))
    with pytest.raises(ConfigError, match="rollout.engine.tensor_parallel_size: 2: under gloo"):
        validate_run(cfg_with(**{"rollout.engine": {"tensor_parallel_size": 2}}))


def test_an_nccl_engine_is_started_for_vllms_transfer_engine_and_its_parallel_sizes(toy_model_path):
    from quant.precision_profile import profile_for
    from rollout_service.engine import RolloutEngine

    tp = cfg_with(**{"rollout.engine": {"tensor_parallel_size": 2}}).rollout
    kwargs = RolloutEngine(toy_model_path, profile_for("bf16", cuda=False), tp, transport="nccl").engine_kwargs()
    assert kwargs["weight_transfer_config"] == {"backend": "nccl"}
    assert kwargs["distributed_executor_backend"] == "mp" and kwargs["tensor_parallel_size"] == 2
    plain = RolloutEngine(toy_model_path, profile_for("bf16", cuda=False), cfg_with().rollout).engine_kwargs()
    assert "weight_transfer_config" not in plain and plain["distributed_executor_backend"] == "uni"
    with pytest.raises(ConfigError, match="tensor_parallel_size: 2: under gloo"):
        RolloutEngine(toy_model_path, profile_for("bf16", cuda=False), tp).engine_kwargs()


class RecordingTransfer:
    """A rollout engine's transfer engine (weight_sync/device_updates.py ``TransferEngine``)
    that records each call as vLLM's would be made; ``load``: what a load does besides."""

    def __init__(self, load=None):
        self.calls, self._load = [], load

    async def init(self, info):
        self.calls.append(("init", info))

    async def start(self):
        self.calls.append("start")

    async def load(self, info):
        if self._load is not None:
            self._load(info)
        self.calls.append(("load", info))

    async def finish(self, version):
        self.calls.append(("finish", version))

    async def shutdown(self):
        self.calls.append("shutdown")


class Receiving:
    """weight_sync's receiver of a device transport followed as the rollout engine drives it
    (join; per version the header while generating, then the transfer), with no vLLM and
    nothing of rollout_service."""

    def __init__(self, device):
        self.device, self.version = device, -1

    async def join(self, host, port, slot, generation, manifest, timeout_s):
        return await self.device.join(host, port, slot, generation, manifest, timeout_s)

    async def update(self, version, manifest):
        from weight_sync.follower import SyncOutcome

        if error := await self.device.expect(version, manifest):
            return SyncOutcome.failed(error)
        await self.device.transfer(version, manifest)
        self.version = version
        return SyncOutcome(True)


def saved(tensors, model_dir) -> str:
    """``tensors`` as a checkpoint in ``model_dir`` (what a receiver checks manifests against)."""
    from safetensors.torch import save_file

    save_file(tensors, str(model_dir / "model.safetensors"))
    return str(model_dir)


def test_the_transport_door_gives_each_side_its_half_and_nothing_under_gloo(tmp_path):
    from weight_sync.device_updates import DeviceUpdates
    from weight_sync.ipc import IpcBroadcast
    from weight_sync.transport_choice import broadcast_for, receiver_for, transfer_backend

    assert type(broadcast_for("nccl", 2048, 5)) is NcclBroadcast and broadcast_for("nccl", 2048, 5).buffer_bytes == 2048
    assert type(broadcast_for("ipc", 2048, 5)) is IpcBroadcast and broadcast_for("gloo", 2048, 5) is None
    assert [transfer_backend(t) for t in ("gloo", "nccl", "ipc")] == [None, "nccl", "ipc"]
    model_dir, made = saved(weights(), tmp_path), []
    assert receiver_for("gloo", lambda: made.append(1), model_dir, "", 1) is None and made == []
    device = receiver_for("ipc", RecordingTransfer, model_dir, "int8-w8a8", 1)
    assert isinstance(device, DeviceUpdates) and device.transport == "ipc" and device.quant_compat == "int8-w8a8"
    assert device.shapes == {n: tuple(t.shape) for n, t in weights().items()}


def test_weight_syncs_nccl_receiver_joins_shakes_hands_and_loads_each_version_as_the_manifest_says(
        redis_server, r, tmp_path):
    """Both halves of nccl from weight_sync alone: the receiver the door gives an engine of
    two processes, against the learner's sender; only vLLM's transfer engine is stood in."""
    from weight_sync.transport_choice import receiver_for

    engine = RecordingTransfer()
    member = Receiving(receiver_for("nccl", lambda: engine, saved(weights(), tmp_path), "", 2))
    run_id = free_run_id("ncclrecv")
    stop = threading.Event()
    thread = follow(redis_server.url, run_id, member, stop, worker_id="w0")
    plane = CpuBroadcast(1 << 20, 10)
    sender = WeightSender(r, Keys(run_id), "127.0.0.1", 5, 1 << 20, torch.bfloat16, device=plane)
    tensors = weights()
    try:
        for version in (1, 2):
            assert sender.sync(version, lambda: tensors.items(), {"w0": ""}).members == 1
            deadline = time.monotonic() + 10
            while member.version != version and time.monotonic() < deadline:
                time.sleep(0.02)
        assert member.version == 2 and plane.inits == [3]  # 1 learner + the engine's 2 processes
        (_, info), *updates = engine.calls
        assert info["rank_offset"] == 1 and info["world_size"] == 3 and info["packed"]
        assert base64.b64decode(info["nccl_unique_id_b64"]) and info["packed_buffer_size_bytes"] == 1 << 20
        described = ("load", update_info(sender.manifest))
        assert updates == ["start", described, ("finish", 1), "start", described, ("finish", 2)]
    finally:
        release([stop], sender, [thread])
