"""``sync.transport: ipc`` (weight_sync/ipc.py, weight_sync/device_updates.py): every
decision rlpipe makes about it, on CPU. Which transport a run uses and what a launch
refuses; the update info of each bucket (vLLM's own dataclass takes it, and it cuts the
shared buffer into the bytes the gloo path delivers); the handle on the wire; the sender's
sequence of headers, handles and acks with real Redis and real gloo followers; a member
that fails is left out, and one that is late acking is given up on alone by the rule gloo
follows (weight_sync/stragglers.py) while the generation goes on. Only the CUDA calls
(allocating the GPU buffer, torch's export of it, the stream sync) are stood in by
``CpuIpc``, and they are untested without a GPU; vLLM's ipc engine never runs."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time

import pytest
import torch

from launch.gpus import plan_gpus
from rlpipe.config import ConfigError
from rlpipe.keys import Keys
from tests.conftest import free_run_id
from tests.test_gpus import cfg_with
from tests.test_nccl_sync import Member, follow, release, weights
from weight_sync.ipc import INIT_INFO, IpcBroadcast, bucket_update_info, decode_handle, encode_handle, receive_version
from weight_sync.manifest import incompatibility, pack_bucket, unpack_bucket
from weight_sync.nccl import NcclBroadcast, wire_tensors
from weight_sync.receiver import expect_header, join_group
from weight_sync.sender import WeightSender
from weight_sync.transport import SyncError

SHARED = {"learner.gpus": "0", "rollout.gpus": "0"}  # a worker beside learner rank 0


def test_auto_is_ipc_when_every_worker_shares_learner_rank_0s_gpu_and_gloo_for_a_mixed_fleet():
    plan = plan_gpus(cfg_with(workers=1, **SHARED), 1)
    assert plan.transport == "ipc" and plan.worker_env(0)["RLPIPE_SYNC__TRANSPORT"] == "ipc"
    assert plan.learner_env()["RLPIPE_SYNC__TRANSPORT"] == "ipc"
    assert plan_gpus(cfg_with(workers=1, **{**SHARED, "sync.transport": "ipc"}), 1).transport == "ipc"
    mixed = {"learner.gpus": "0", "rollout.gpus": "0-1"}  # worker 0 beside rank 0, worker 1 apart
    assert plan_gpus(cfg_with(workers=2, **mixed), 2).transport == "gloo"
    assert plan_gpus(cfg_with(workers=1, **{"learner.gpus": "0", "rollout.gpus": "1"}), 2).transport == "nccl"
    # Only rank 0 sends: a worker beside another learner rank is apart.
    assert plan_gpus(cfg_with(workers=1, **{"learner.gpus": "0-1", "learner.ranks": 2, "rollout.gpus": "1"}),
                     2).transport == "nccl"


@pytest.mark.parametrize(("settings", "devices", "message"), [
    ({"workers": 2, "learner.gpus": "0", "rollout.gpus": "0-1", "sync.transport": "ipc"}, 2,
     "sync.transport: ipc cannot reach worker 1, which is not on GPU 0 with learner rank 0"),
    ({"workers": 1, "learner.gpus": "0", "rollout.gpus": "1", "sync.transport": "ipc"}, 2,
     "sync.transport: ipc cannot reach worker 0"),
    ({"sync.transport": "ipc"}, 0, "sync.transport: ipc shares the learner's CUDA memory .* this machine has none"),
    ({"workers": 1, **SHARED, "sync.transport": "nccl"}, 1, "sync.transport: nccl cannot reach worker 0.* use ipc"),
])
def test_a_launch_refuses_ipc_where_it_cannot_reach_a_worker_naming_the_key(settings, devices, message):
    with pytest.raises(ConfigError, match=message):
        plan_gpus(cfg_with(**settings), devices)


def test_a_launch_refuses_ipc_without_cuda_and_a_tp_engine_under_ipc():
    from launch.checks import validate_run
    from rollout_service.engine_args import engine_args_problems

    (tp,) = engine_args_problems({"tensor_parallel_size": 2}, "ipc")  # vLLM's handle is for one GPU's uuid
    assert tp.startswith("rollout.engine.tensor_parallel_size: 2: under ipc") and "sync.transport nccl" in tp
    assert engine_args_problems({"pipeline_parallel_size": 2}, "ipc")[0].startswith(
        "rollout.engine.pipeline_parallel_size: 2: under ipc")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    with pytest.raises(ConfigError, match="sync.transport: ipc shares the learner's CUDA memory"):
        validate_run(cfg_with(**{"sync.transport": "ipc"}))


def test_an_ipc_engine_is_started_for_vllms_ipc_transfer_engine(toy_model_path):
    from quant.precision_profile import profile_for
    from rollout_service.engine import RolloutEngine

    kwargs = RolloutEngine(toy_model_path, profile_for("bf16", cuda=False), cfg_with().rollout,
                           transport="ipc").engine_kwargs()
    assert kwargs["weight_transfer_config"] == {"backend": "ipc"} and kwargs["distributed_executor_backend"] == "uni"
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

    assert IPCWeightTransferInitInfo(**INIT_INFO).packed  # each bucket arrives packed


def fake_args(storage_handle: bytes, nbytes: int, export: int) -> tuple:
    """What torch's ``reduce_tensor`` gives for a CUDA uint8 buffer (``rebuild_cuda_tensor``'s
    arguments), with made-up handles."""
    return (torch.Tensor, torch.Size([nbytes]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0, storage_handle,
            nbytes, 0, False, b"/torch_4242_1234567", export, bytes(range(64)), True)


def test_the_handle_travels_as_json_and_comes_back_as_torch_gave_it():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = fake_args(bytes(range(64, 128)), 4096, 7)
    assert len(args) == len(inspect.signature(rebuild_cuda_tensor).parameters)
    handle = {"GPU-0f6c": args}
    back = decode_handle(encode_handle(handle))
    assert back == handle and type(back["GPU-0f6c"][1]) is torch.Size and back["GPU-0f6c"][4] is torch.storage.TypedStorage
    with pytest.raises(ValueError, match="names class"):
        encode_handle({"GPU-0f6c": (dict, *args[1:])})
    bad = encode_handle(handle)
    text = bad[8:8 + int(bad[:8].view(torch.int64).item())].numpy().tobytes().replace(b'"Tensor"', b'"Popen!"')
    bad[8:8 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    with pytest.raises(SyncError, match="names class 'Popen!'"):
        decode_handle(bad)  # a class the allowlist lacks is never looked up


def test_each_buckets_update_info_is_what_vllm_takes_and_cuts_the_gloo_paths_bytes():
    """vLLM's consumer cuts the shared buffer by the update info alone: per bucket, exactly
    its tensors in the manifest's order, with wire dtype, shape and bytes; together, the
    version as the nccl path sends it, and the values the gloo path delivers."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    tensors = weights()
    manifest = WeightSender(None, Keys("t"), "127.0.0.1", 5, 2048, torch.bfloat16, device=IpcBroadcast(5)).plan(tensors)
    assert manifest.transport == "ipc" and len(manifest.buckets) > 2
    sent = list(wire_tensors(manifest, tensors, "cpu"))
    names = []
    for i, bucket in enumerate(manifest.buckets):
        handle = {"GPU-0f6c": fake_args(b"h" * 64, bucket.nbytes, i)}
        info = IPCWeightTransferUpdateInfo(**bucket_update_info(bucket, handle))  # vLLM's own checks
        assert info.ipc_handles == handle and sum(info.tensor_sizes) == bucket.nbytes
        assert set(info.dtype_names) == {bucket.dtype}
        buf = pack_bucket(bucket, tensors, torch.empty(bucket.nbytes, dtype=torch.uint8))
        gloo = dict(unpack_bucket(bucket, buf))
        cut = unpack_tensor(buf, info.names, info.shapes, [getattr(torch, d) for d in info.dtype_names],
                            info.tensor_sizes)
        assert [n for n, _ in cut] == [slot.name for slot in bucket.tensors]
        for name, t in cut:
            assert t.dtype == gloo[name].dtype and torch.equal(t, gloo[name]), name
        names += info.names
    assert names == [n for n, _ in sent] and sorted(names) == sorted(tensors)


def test_engines_of_the_other_transports_refuse_an_ipc_generation_naming_the_setting():
    tensors = weights()
    ipc = WeightSender(None, Keys("t"), "127.0.0.1", 5, 1 << 20, None, device=IpcBroadcast(5)).plan(tensors)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    assert incompatibility(ipc, shapes, transport="ipc") is None
    for other in ("gloo", "nccl"):
        why = incompatibility(ipc, shapes, transport=other)
        assert why.startswith(f"the learner sends over ipc, this worker's engine was started for {other}")
        assert "sync.transport" in why
    nccl = WeightSender(None, Keys("t"), "127.0.0.1", 5, 1 << 20, None, device=NcclBroadcast(1 << 20, 5)).plan(tensors)
    assert "sends over nccl" in incompatibility(nccl, shapes, transport="ipc")


EXPORTED: dict[bytes, torch.Tensor] = {}  # storage handle -> the buffer, as CUDA IPC would map it


class CpuIpc(IpcBroadcast):
    """The learner's IPC data plane with the CUDA calls stood in: the buffer is in host
    memory, and an export names it in :data:`EXPORTED` (one fresh export per call)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.exports, self.syncs, self.allocs = 0, 0, []

    def _alloc(self, nbytes):
        self.allocs.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def _export(self, buffer):
        self.exports += 1
        storage = f"buffer-{id(self)}-{len(self.allocs)}".encode()
        EXPORTED[storage] = buffer
        return {"GPU-cpu": fake_args(storage, buffer.numel(), self.exports)}

    def _synchronize(self):
        self.syncs += 1


HANG_S = 6.0  # a "hang" member's load


class IpcMember(Member):
    """A rollout worker's gloo side under ipc, as weight_sync/device_updates.py runs it,
    with vLLM's ``update_weights`` stood in by ``load``: it parses the update info with
    vLLM's dataclass and cuts the mapped buffer as vLLM's consumer does. ``fail``: ``"raise"``
    (the engine fails to load) or ``"hang"`` (it takes :data:`HANG_S`, acking late)."""

    def __init__(self, worker_id: str, fail: str = ""):
        super().__init__(worker_id, 1)
        self.fail, self.received, self.handles = fail, {}, []

    async def join(self, host, port, slot, generation, manifest, timeout_s):
        from weight_sync.follower import SyncOutcome

        self.group, _ = await asyncio.to_thread(join_group, host, port, slot, generation, timeout_s)
        self.info = dict(INIT_INFO)
        return SyncOutcome(True)

    async def update(self, version, manifest):
        from weight_sync.follower import SyncOutcome

        try:
            await asyncio.to_thread(expect_header, self.group, version, manifest)
            await receive_version(self.group, manifest, self.load)
        except (SyncError, RuntimeError) as e:
            return SyncOutcome.failed(str(e))
        self.versions.append(version)
        self.version = version  # what the follower compares the next version with, as Member's
        return SyncOutcome(True)

    async def load(self, info: dict) -> None:
        if self.fail == "raise":
            raise RuntimeError("the engine could not load it")
        if self.fail == "hang":
            await asyncio.sleep(HANG_S)
        self.handles.append(consume(info, self.received))


def consume(info: dict, received: dict[str, torch.Tensor]) -> tuple:
    """What vLLM's ipc engine does with a packed update info, the mapping stood in by
    :data:`EXPORTED`: parse it with vLLM's dataclass, cut the buffer with vLLM's
    ``unpack_tensor``, and keep clones; returns the handle's args."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    parsed = IPCWeightTransferUpdateInfo(**info)
    ((_, args),) = parsed.ipc_handles.items()
    buffer = EXPORTED[args[7]][: sum(parsed.tensor_sizes)]
    dtypes = [getattr(torch, d) for d in parsed.dtype_names]
    for name, t in unpack_tensor(buffer, parsed.names, parsed.shapes, dtypes, parsed.tensor_sizes):
        received[name] = t.clone()  # vLLM's consumer clones too: the buffer is packed again next
    return args


def over_gloo(manifest, tensors) -> dict[str, torch.Tensor]:
    out = {}
    for bucket in manifest.buckets:
        out.update(unpack_bucket(bucket, pack_bucket(bucket, tensors, torch.empty(bucket.nbytes, dtype=torch.uint8))))
    return out


def settle(members, versions: list[int]) -> None:
    """Until each of ``members`` recorded ``versions``: a member records a version just after
    its last ack, which is what the sender's sync returns on."""
    deadline = time.monotonic() + 10
    while any(m.versions != versions for m in members) and time.monotonic() < deadline:
        time.sleep(0.02)


def run_members(redis_url, run_id, members):
    stops = [threading.Event() for _ in members]
    return stops, [follow(redis_url, run_id, m, stop) for m, stop in zip(members, stops)]


def test_the_sender_hands_each_member_each_bucket_after_its_header_and_waits_for_its_ack(redis_server, r):
    import vllm.distributed.weight_transfer.ipc_engine  # noqa: F401  (what consume imports: not within a timeout)

    run_id = free_run_id("ipc")
    members = [IpcMember("w0"), IpcMember("w1")]
    stops, threads = run_members(redis_server.url, run_id, members)
    plane = CpuIpc(5)
    sender = WeightSender(r, Keys(run_id), "127.0.0.1", 5, 1024, torch.bfloat16, device=plane)
    tensors = weights()
    live = {m.worker_id: "" for m in members}
    try:
        stats = sender.sync(1, lambda: tensors.items(), live)
        buckets = len(sender.manifest.buckets)
        assert stats.members == 2 and buckets > 2 and plane.syncs == buckets
        assert plane.allocs == [max(b.nbytes for b in sender.manifest.buckets)]  # one buffer, packed in turn
        expected = over_gloo(sender.manifest, tensors)
        settle(members, [1])
        for m in members:
            assert m.versions == [1] and sorted(m.received) == sorted(expected)
            for name, t in m.received.items():
                assert torch.equal(t, expected[name]), name
        tensors = {n: t + 1 if t.is_floating_point() else t for n, t in tensors.items()}
        sender.sync(2, lambda: tensors.items(), live)
        assert plane.allocs == [plane.allocs[0]] and plane.exports == 4  # each member, each version: its own export
        handles = {m.handles[-1][12] for m in members} | {m.handles[0][12] for m in members}
        assert len(handles) == 4  # and every bucket of a version under that member's one export
        assert all(len({a[12] for a in m.handles[:buckets]}) == 1 for m in members)
        expected = over_gloo(sender.manifest, tensors)
        settle(members, [1, 2])
        for m in members:
            assert m.versions == [1, 2] and all(torch.equal(t, expected[n]) for n, t in m.received.items())
    finally:
        release(stops, sender, threads)


def test_a_member_that_fails_a_bucket_or_acks_late_is_given_up_on_alone_and_the_others_get_the_version(
        redis_server, r):
    """w1's engine fails to load the first bucket (it acks the failure: left out at once);
    w2's takes HANG_S (alive, acking late). w2 is given up on ``straggler_s`` after w0 acked,
    not when it acks nor at the 30 s sync timeout, by the rule gloo's sends follow; the buffer it may still be
    reading is retired, so the next bucket goes into a fresh one; w0 gets the version, and
    the next one on time in the same generation."""
    import vllm.distributed.weight_transfer.ipc_engine  # noqa: F401  (what consume imports: not within a timeout)

    run_id = free_run_id("ipcfail")
    members = [IpcMember("w0"), IpcMember("w1", fail="raise"), IpcMember("w2", fail="hang")]
    stops, threads = run_members(redis_server.url, run_id, members)
    plane = CpuIpc(30)
    sender = WeightSender(r, Keys(run_id), "127.0.0.1", 30, 1024, torch.bfloat16, device=plane, straggler_s=1.0)
    tensors = weights()
    live = {m.worker_id: "" for m in members}
    try:
        t0 = time.monotonic()
        stats = sender.sync(1, lambda: tensors.items(), live)
        assert time.monotonic() - t0 < HANG_S - 1  # the straggler deadline: w2's ack was not waited for
        assert stats.members == 1 and sender.excluded == {"w1": "", "w2": ""} and sender.left_out_total == 2
        assert sender.group is not None and sender.members == ("w0",)  # the generation goes on without them
        assert len(plane.allocs) == 2  # the buffer w2 was reading retired after the first bucket
        settle(members[:1], [1])
        assert members[0].versions == [1] and members[1].versions == members[2].versions == []
        expected = over_gloo(sender.manifest, tensors)
        assert all(torch.equal(t, expected[n]) for n, t in members[0].received.items())
        assert sorted(members[0].received) == sorted(expected)
        generation, t0 = stats.generation, time.monotonic()
        stats = sender.sync(2, lambda: tensors.items(), live)
        assert time.monotonic() - t0 < 1.0, "on time: no straggler wait, no forming"
        assert (stats.members, stats.generation, stats.form_s, sender.members) == (1, generation, 0, ("w0",))
    finally:
        release(stops, sender, threads)


class FakeLLM:
    """vLLM's ``AsyncLLM`` as rollout_service/transfer_engine.py and ``RolloutEngine._apply``
    drive it: the calls are recorded, and ``update_weights`` consumes the update info as
    vLLM's ipc engine would."""

    def __init__(self):
        self.calls, self.received = [], {}

    async def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request.init_info))

    async def shutdown_weight_transfer_engine(self):
        self.calls.append("shutdown")

    async def pause_generation(self, **kwargs):
        self.calls.append("pause")

    async def resume_generation(self):
        self.calls.append("resume")

    async def reset_prefix_cache(self):
        return True

    async def start_weight_update(self):
        self.calls.append("start")

    async def update_weights(self, request):
        consume(request.update_info, self.received)
        self.calls.append("update")

    async def finish_weight_update(self, weight_version):
        self.calls.append(("finish", weight_version))


def test_a_rollout_engine_under_ipc_drives_vllms_transfer_lifecycle_bucket_by_bucket(redis_server, r, toy_model_path):
    """The worker's own receiver (weight_sync/device_updates.py, bound to vLLM by
    rollout_service/transfer_engine.py, through RolloutEngine's join and update) against the
    learner's sender; only AsyncLLM is stood in."""
    from quant.precision_profile import profile_for
    from rollout_service.engine import RolloutEngine
    from weight_sync.names import checkpoint_shapes

    engine = RolloutEngine(toy_model_path, profile_for("bf16", cuda=False), cfg_with().rollout, transport="ipc")
    engine.llm = FakeLLM()
    engine.device_updates = engine.receiver()  # as RolloutEngine.start makes it
    gen = torch.Generator().manual_seed(1)
    tensors = {n: torch.randn(shape, generator=gen) for n, shape in checkpoint_shapes(toy_model_path).items()}
    run_id = free_run_id("ipcengine")
    stop = threading.Event()
    thread = follow(redis_server.url, run_id, engine, stop, worker_id="w0")
    sender = WeightSender(r, Keys(run_id), "127.0.0.1", 5, 64 << 10, torch.bfloat16, device=CpuIpc(5))
    try:
        assert sender.sync(1, lambda: tensors.items(), {"w0": ""}).members == 1
        buckets = len(sender.manifest.buckets)
        assert buckets > 2
        deadline = time.monotonic() + 10
        while engine.version != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.version == 1 and engine.weights_source == "learner"
        assert engine.llm.calls == [("init", {"packed": True}), "pause", "start", *["update"] * buckets,
                                    ("finish", "1"), "resume"]
        expected = over_gloo(sender.manifest, tensors)
        assert sorted(engine.llm.received) == sorted(expected)
        assert all(torch.equal(t, expected[n]) for n, t in engine.llm.received.items())
    finally:
        release([stop], sender, [thread])


def test_weight_syncs_ipc_receiver_loads_each_bucket_from_its_handle_and_acks_it(redis_server, r, tmp_path):
    """Both halves of ipc from weight_sync alone: the receiver the door gives an engine,
    against the learner's sender; only vLLM's transfer engine (and the CUDA calls) stood in."""
    from tests.test_nccl_sync import Receiving, RecordingTransfer, saved
    from weight_sync.transport_choice import receiver_for

    received = {}
    engine = RecordingTransfer(load=lambda info: consume(info, received))
    member = Receiving(receiver_for("ipc", lambda: engine, saved(weights(), tmp_path), "", 1))
    run_id = free_run_id("ipcrecv")
    stop = threading.Event()
    thread = follow(redis_server.url, run_id, member, stop, worker_id="w0")
    sender = WeightSender(r, Keys(run_id), "127.0.0.1", 5, 1024, torch.bfloat16, device=CpuIpc(5))
    tensors = weights()
    try:
        assert sender.sync(1, lambda: tensors.items(), {"w0": ""}).members == 1
        deadline = time.monotonic() + 10
        while member.version != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        buckets = sender.manifest.buckets
        assert member.version == 1 and len(buckets) > 2
        assert [c if isinstance(c, str) else c[0] for c in engine.calls] == \
            ["init", "start", *["load"] * len(buckets), "finish"]
        assert engine.calls[0] == ("init", INIT_INFO) and engine.calls[-1] == ("finish", 1)
        assert [c[1]["names"] for c in engine.calls[2:-1]] == [[s.name for s in b.tensors] for b in buckets]
        expected = over_gloo(sender.manifest, tensors)
        assert sorted(received) == sorted(expected) and all(torch.equal(t, expected[n]) for n, t in received.items())
    finally:
        release([stop], sender, [thread])
