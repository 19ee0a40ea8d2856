"""Weight sync without vLLM: bucket planning, bit-exact transfer over real gloo between
processes, and failures that end within the timeout instead of hanging."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time

import pytest
import torch

from rlpipe.queue import Keys, connect
from tests.conftest import free_run_id
from weight_sync.manifest import Manifest, pack_bucket, plan_buckets, unpack_bucket
from weight_sync.rendezvous import read_sync
from weight_sync.sender import WeightSender
from weight_sync.transport import SyncError


def checksum(named) -> str:
    h = hashlib.sha256()
    for name, t in sorted(named):
        h.update(name.encode())
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_buckets_group_by_dtype_and_respect_the_size():
    specs = [("big", torch.float32, (1000,)), ("a", torch.float32, (10,)), ("b", torch.bfloat16, (4, 4)),
             ("c", torch.float32, (20,)), ("d", torch.float32, (300,))]
    m = plan_buckets(specs, bucket_bytes=1024)
    dtypes = [b.dtype for b in m.buckets]
    assert dtypes == ["float32", "float32", "float32", "bfloat16"]
    assert [t.name for t in m.buckets[0].tensors] == ["big"]  # larger than a bucket: a bucket of its own
    assert m.buckets[0].nbytes == 4000
    assert [t.name for t in m.buckets[1].tensors] == ["a", "c"]  # 120 bytes, "d" would overflow
    assert [t.name for t in m.buckets[2].tensors] == ["d"]
    assert [t.offset for t in m.buckets[1].tensors] == [0, 40]
    assert all(b.nbytes <= 1024 or len(b.tensors) == 1 for b in m.buckets)
    assert Manifest.from_json(m.to_json()) == m
    assert plan_buckets(specs[:-1], 1024).hash != m.hash


def test_many_tiny_tensors_pack_and_unpack_bit_exactly():
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn((i % 5) + 1, generator=gen) for i in range(500)}
    tensors["scalar"] = torch.tensor(3.25)
    m = plan_buckets([(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], bucket_bytes=256)
    assert len(m.buckets) > 5
    out = {}
    for bucket in m.buckets:
        out.update(unpack_bucket(bucket, pack_bucket(bucket, tensors)))
    assert checksum(out.items()) == checksum(tensors.items())


def test_wire_dtype_cast_happens_in_packing():
    t = {"w": torch.tensor([1.0, 1.0 + 2**-10, -3.5])}
    m = plan_buckets([("w", torch.bfloat16, (3,))], bucket_bytes=64)
    (name, got), = unpack_bucket(m.buckets[0], pack_bucket(m.buckets[0], t))
    assert got.dtype == torch.bfloat16 and torch.equal(got, t["w"].to(torch.bfloat16))


def _receiver(redis_url, run_id, rank, mode, results):
    """A stand-in rollout worker process: join, then receive (or misbehave)."""
    from weight_sync.receiver import WeightReceiver

    r = connect(redis_url)
    keys = Keys(run_id)
    while read_sync(r, keys).generation == 0:
        time.sleep(0.02)
    st = read_sync(r, keys)
    recv = WeightReceiver.join(st.master_addr, st.master_port, rank, st.world_size, st.generation, 3.0, 30.0)
    if mode == "exit":
        import os

        os._exit(0)  # dies without receiving: the learner must notice, not hang
    if mode == "hang":
        time.sleep(30)
        return
    weights = recv.receive(st.version, Manifest.from_json(st.manifest))
    results.put((rank, checksum(weights), st.version))


def model_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 32, generator=gen), "big": torch.randn(300_000, generator=gen),
            **{f"layer{i}.bias": torch.randn(7, generator=gen) for i in range(40)}}


def start_receivers(redis_server, run_id, modes):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(redis_server.url, run_id, i + 1, mode, results), daemon=True)
             for i, mode in enumerate(modes)]
    for p in procs:
        p.start()
    return procs, results


def test_broadcast_to_two_receivers_is_bit_exact(redis_server, r):
    run_id = free_run_id("ws")
    procs, results = start_receivers(redis_server, run_id, ["ok", "ok"])
    weights = model_weights(0)
    sender = WeightSender(r, Keys(run_id), "127.0.0.1", timeout_s=10, join_timeout_s=60,
                          bucket_bytes=256 << 10, wire_dtype=torch.float32)
    stats = sender.sync(5, lambda: weights.items(), ["w0", "w1"])
    got = sorted(results.get(timeout=60) for _ in procs)
    assert got == [(1, checksum(weights.items()), 5), (2, checksum(weights.items()), 5)]
    assert stats["members"] == 2 and stats["bytes"] == sum(t.numel() * 4 for t in weights.values())
    assert len(sender.manifest.buckets) >= 2  # "big" (1.2 MB) exceeds a 256 KiB bucket
    for p in procs:
        p.join(10)
    sender.drop()


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_failed_receiver_ends_the_sync_within_the_timeout(redis_server, r, mode):
    run_id = free_run_id("ws")
    procs, _ = start_receivers(redis_server, run_id, [mode])
    sender = WeightSender(r, Keys(run_id), "127.0.0.1", timeout_s=3, join_timeout_s=60,
                          bucket_bytes=1 << 20, wire_dtype=torch.float32)
    weights = model_weights(1)
    t0 = time.monotonic()
    with pytest.raises(SyncError):
        sender.sync(1, lambda: weights.items(), ["w0"])
    assert time.monotonic() - t0 < 3 + 15  # join time + at most the op timeout, never a hang
    assert sender.group is None  # the generation is dropped; the next sync re-forms one
    for p in procs:
        p.kill()
        p.join()


def test_no_live_workers_means_no_generation(r):
    sender = WeightSender(r, Keys(free_run_id("ws")), "127.0.0.1", 3, 3, 1 << 20, torch.float32)
    assert sender.sync(0, lambda: {"w": torch.zeros(2)}.items(), [])["members"] == 0
    assert sender.group is None
