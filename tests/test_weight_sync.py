"""Weight sync without vLLM: bucket planning, bit-exact transfer over real gloo between
processes, and failures that end within the timeout instead of hanging."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import multiprocessing as mp
import subprocess
import sys
import time

import pytest
import torch

from rlpipe import registry
from rlpipe.keys import Keys
from rlpipe.redis_link import connect
from tests.conftest import free_run_id, wait_for
from weight_sync.manifest import Manifest, chunks, pack_bucket, pack_chunk, plan_buckets, unpack_bucket
from weight_sync.rendezvous import SyncState, publish_generation, publish_members, publish_version, read_sync
from weight_sync.sender import WeightSender
from weight_sync.transport import IncompatibleWorker, SyncError


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


@pytest.mark.parametrize("chunk_bytes", [8, 24, 4096, 0])
def test_chunks_cut_through_tensors_and_pack_what_whole_buckets_pack(chunk_bytes):
    """A whole version goes in chunks that need not respect tensors: a tensor cut between
    chunks packs (and casts) each part where whole-bucket packing puts it."""
    gen = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(37, 3, generator=gen), "b": torch.randn(5, generator=gen),
               "c": torch.randint(-128, 127, (1001,), dtype=torch.int8, generator=gen),
               "d": torch.randn(2, 2, generator=gen)}
    specs = [(n, torch.bfloat16 if t.is_floating_point() else t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    m = plan_buckets(specs, bucket_bytes=200, chunk_bytes=chunk_bytes)
    spans = chunks(m)
    whole = [pack_bucket(b, tensors) for b in m.buckets]
    got = [torch.full((b.nbytes,), 0xAB, dtype=torch.uint8) for b in m.buckets]
    for c in spans:
        assert 0 < c.end - c.start <= (chunk_bytes or m.buckets[c.bucket].nbytes)
        pack_chunk(m.buckets[c.bucket], c, tensors, got[c.bucket][c.start: c.end])
    assert all(torch.equal(w, g) for w, g in zip(whole, got))
    assert sum(c.end - c.start for c in spans) == m.nbytes  # each byte in exactly one chunk
    assert Manifest.from_json(m.to_json()) == m


def test_a_sender_chunks_for_other_hosts_and_sends_whole_buckets_on_loopback(r, monkeypatch):
    """On loopback the kernel's copies and the cast share one memory bus and nothing hides,
    so whole buckets (fewer sends) are faster; to other hosts chunks hide the cast."""
    from weight_sync.sender import CHUNK_BYTES

    monkeypatch.setenv("RLPIPE_SYNC_TOKEN", "t" * 32)  # a non-loopback sync host needs one
    tensors = {"w": torch.zeros(8)}
    plans = {host: WeightSender(r, Keys(free_run_id("ws")), host, timeout_s=1, bucket_bytes=1 << 20,
                                wire_dtype=torch.bfloat16).plan(tensors) for host in ("127.0.0.1", "10.1.2.3")}
    assert plans["127.0.0.1"].chunk_bytes == 0 and plans["10.1.2.3"].chunk_bytes == CHUNK_BYTES
    assert plans["127.0.0.1"].hash != plans["10.1.2.3"].hash  # the chunking is part of what both sides agree on


def test_a_version_is_published_only_into_the_hash_of_its_generation(r):
    """The sync hash deleted (or restored from an older snapshot): a version or members
    written after that would make a hash without a manifest, which no worker can load."""
    key = Keys(free_run_id("ws")).sync
    publish_generation(r, key, SyncState(generation=3, manifest='{"buckets":[]}', generation_id="g3"))
    assert publish_version(r, key, "g3", 7) and read_sync(r, key).version == 7
    assert not publish_version(r, key, "g2", 8) and read_sync(r, key).version == 7  # another generation's
    r.delete(key)
    assert not publish_version(r, key, "g3", 8) and not publish_members(r, key, "g3", ["w0"], 2)
    assert not r.exists(key)


def model_of(manifest, mode: str) -> dict[str, tuple[int, ...]]:
    """A stand-in worker's model: the tensors the learner sends, but "embed" in ``refuse`` mode."""
    return {t.name: t.shape for b in manifest.buckets for t in b.tensors
            if not (mode == "refuse" and t.name == "embed")}


class ChecksumEngine:
    """A stand-in for the vLLM engine behind the real ``WeightFollower``: it joins and
    receives through the engine process's own ``WeightStager`` and reports each version's
    checksum instead of loading it; or misbehaves as ``mode`` says (``refuse`` the manifest,
    ``hang`` after joining, ``crash`` in the middle of version 3 via RLPIPE_CRASH_AT)."""

    def __init__(self, worker_id, mode, results, timeout_s=5.0):
        self.worker_id, self.mode, self.results, self.timeout_s = worker_id, mode, results, timeout_s
        self.version = -1
        self.stager = None

    async def join(self, host, port, slot, generation, manifest, timeout_s):
        from weight_sync.follower import SyncOutcome
        from weight_sync.stager import WeightStager

        self.stager = self.stager or WeightStager(model_of(manifest, self.mode), manifest.quant_compat)
        reply = await asyncio.to_thread(self.stager.join, host, port, slot, generation, manifest, self.timeout_s)
        if not reply["ok"]:
            self.results.put((self.worker_id, "LeftOut" if reply.get("left_out") else "SyncError", generation))
        elif self.mode == "hang":
            await asyncio.sleep(60)
        return SyncOutcome.of(reply)

    async def stage(self, version, manifest):
        """Receive ``version`` into the stager; the outcome, and the weights it staged."""
        from weight_sync.follower import SyncOutcome

        outcome = SyncOutcome.of(await asyncio.to_thread(self.stager.receive, version, manifest.hash))
        return outcome, self.stager.take()

    async def update(self, version, manifest):
        outcome, weights = await self.stage(version, manifest)
        if outcome.ok:
            self.version = version
            self.results.put((self.worker_id, checksum(weights), version))
        return outcome

    async def load_checkpoint(self, path, version, quant_profile):
        raise AssertionError("no checkpoints here")


def _receiver(redis_url, run_id, worker_id, mode, versions, results):
    """A stand-in rollout worker process: the production follower on a checksum engine,
    until it has received ``versions`` versions (or refused once); in ``register`` mode
    its incarnations are in the run's registry, where the learner reads them."""
    import os

    if mode == "crash":
        os.environ["RLPIPE_CRASH_AT"] = "receiving:3:1"  # dies in the middle of version 3
    from weight_sync.follower import WeightFollower

    engine = ChecksumEngine(worker_id, mode, results)
    stopping = asyncio.Event()
    received = []

    def synced(s):
        received.append(s.version)
        if len(received) >= versions:
            stopping.set()

    def failed(error):
        if mode == "refuse":
            stopping.set()

    async def published(incarnation):
        if mode == "register":  # the registry carries each incarnation, as a worker's heartbeat does
            registry.heartbeat_worker(connect(redis_url), Keys(run_id), worker_id, 60, incarnation=incarnation)

    follower = WeightFollower(connect(redis_url), Keys(run_id).sync, worker_id, engine, 5.0, lambda: None, synced,
                              failed, published)
    asyncio.run(published(follower.incarnation))
    results.put((worker_id, "ready"))
    asyncio.run(follower.run(stopping, poll_s=0.02))


def model_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 32, generator=gen), "big": torch.randn(300_000, generator=gen),
            **{f"layer{i}.bias": torch.randn(7, generator=gen) for i in range(40)}}


def start_receivers(redis_server, run_id, modes: dict[str, str], versions: int = 1):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(redis_server.url, run_id, wid, mode, versions, results), daemon=True)
             for wid, mode in modes.items()]
    for p in procs:
        p.start()
    # Timings below are of the sync alone, not of starting Python and torch.
    assert sorted(results.get(timeout=120) for _ in procs) == sorted((wid, "ready") for wid in modes)
    return procs, results


def make_sender(r, run_id, timeout_s, bucket_bytes=256 << 10, **kw):
    return WeightSender(r, Keys(run_id), "127.0.0.1", timeout_s=timeout_s, bucket_bytes=bucket_bytes,
                        wire_dtype=torch.float32, **kw)


def stop(procs):
    for p in procs:
        p.kill()
        p.join()


def test_broadcast_to_two_receivers_is_bit_exact(redis_server, r):
    """In chunks of 40,008 bytes: most cut through a tensor, and the sender packs them into a
    ring of a few buffers it reuses while earlier chunks are still on the wire."""
    from weight_sync.sender import RING

    run_id = free_run_id("ws")
    procs, results = start_receivers(redis_server, run_id, {"w0": "ok", "w1": "ok"}, versions=2)
    sender = make_sender(r, run_id, timeout_s=30, chunk_bytes=40_008)
    live = {"w0": "a", "w1": "a"}
    for version, seed in [(5, 0), (6, 1)]:
        weights = model_weights(seed)
        stats = sender.sync(version, lambda: weights.items(), live)
        got = sorted(results.get(timeout=60) for _ in procs)
        assert got == [("w0", checksum(weights.items()), version), ("w1", checksum(weights.items()), version)]
        assert stats.members == 2 and stats.bytes == sum(t.numel() * 4 for t in weights.values())
    assert stats.form_s == 0  # the second version reused the generation
    assert len(sender.manifest.buckets) >= 2  # "big" (1.2 MB) exceeds a 256 KiB bucket
    assert len(chunks(sender.manifest)) > 30 and len(sender.buffers) == RING  # each buffer used many times
    assert all(b.numel() == 40_008 for b in sender.buffers)
    assert read_sync(r, Keys(run_id).sync).members == ("w0", "w1")
    stop(procs)
    sender.drop()


def test_a_worker_that_never_checks_in_costs_one_timeout_then_stays_out(redis_server, r):
    run_id = free_run_id("ws")
    procs, results = start_receivers(redis_server, run_id, {"w0": "ok"}, versions=2)
    sender = make_sender(r, run_id, timeout_s=4)
    live = {"w0": "a", "ghost": "a"}  # registered, but gone: it never checks in
    weights = model_weights(0)
    t0 = time.monotonic()
    stats = sender.sync(1, lambda: weights.items(), live)
    assert 4 <= time.monotonic() - t0 < 4 + 5
    assert stats.members == 1 and sender.members == ("w0",) and sender.left_out_total == 1
    assert results.get(timeout=30) == ("w0", checksum(weights.items()), 1)
    t0 = time.monotonic()
    assert sender.sync(2, lambda: weights.items(), live).members == 1  # no second wait for the ghost
    assert time.monotonic() - t0 < 3 and results.get(timeout=30)[2] == 2
    assert sender.needs_forming({**live, "ghost": "b"})  # a new incarnation is asked back in
    stop(procs)
    sender.drop()


def test_a_worker_killed_mid_transfer_is_left_out_and_the_rest_get_the_version(redis_server, r):
    run_id = free_run_id("ws")
    procs, results = start_receivers(redis_server, run_id, {"w0": "ok", "w1": "crash"}, versions=2)
    sender = make_sender(r, run_id, timeout_s=5, bucket_bytes=64 << 10)
    weights = {**model_weights(2), "huge": torch.randn(8 << 20)}  # 32 MB: more than socket buffers hold
    t0 = time.monotonic()
    live = {"w0": "a", "w1": "a"}  # w1 is still registered: its heartbeat has not expired yet
    stats = sender.sync(3, lambda: weights.items(), live)
    assert time.monotonic() - t0 < 5  # the others did not wait for the dead one
    assert stats.members == 1 and sender.excluded == {"w1": "a"} and sender.left_out_total == 1
    assert results.get(timeout=30) == ("w0", checksum(weights.items()), 3)
    procs[1].join(10)
    assert procs[1].exitcode == -9  # it really died mid-transfer
    t0 = time.monotonic()
    stats = sender.sync(4, lambda: weights.items(), live)  # the same generation, without w1 (w0 kept its pair)
    assert time.monotonic() - t0 < 5 and stats.members == 1 and stats.generation == 1 and stats.form_s == 0
    assert results.get(timeout=30) == ("w0", checksum(weights.items()), 4)
    stop(procs)
    sender.drop()


def test_a_worker_whose_model_lacks_a_tensor_the_learner_sends_stops_the_sync_naming_both(redis_server, r):
    """Its refusal reaches the learner in the check-in, and is an error naming the worker and
    the tensor, at once: not a worker left out and a learner waiting for groups forever."""
    run_id = free_run_id("ws")
    procs, results = start_receivers(redis_server, run_id, {"w0": "ok", "w1": "refuse"})
    sender = make_sender(r, run_id, timeout_s=30)
    weights = model_weights(3)
    t0 = time.monotonic()
    with pytest.raises(IncompatibleWorker, match=r"^worker w1 cannot take the learner's weights: the learner sends "
                                                 r"'embed', which this worker's model does not have$"):
        sender.sync(1, lambda: weights.items(), {"w0": "a", "w1": "a"})
    assert time.monotonic() - t0 < 15  # not the 30 s deadline
    assert sender.group is None and sender.gate is None
    assert ("w1", "LeftOut", 1) in [results.get(timeout=30) for _ in procs]
    stop(procs)


def renamed(manifest: Manifest) -> Manifest:
    """``manifest`` with its first tensor renamed: what one HSET of the sync hash's ``manifest`` makes."""
    first, *rest = manifest.buckets[0].tensors
    bucket = dataclasses.replace(manifest.buckets[0], tensors=(dataclasses.replace(first, name=first.name + ".x"),
                                                               *rest))
    return dataclasses.replace(manifest, buckets=(bucket, *manifest.buckets[1:]))


@pytest.mark.parametrize("rewritten", ["the manifest", "the manifest and its hash"])
def test_a_manifest_rewritten_in_redis_costs_nothing(redis_server, r, monkeypatch, rewritten):
    """A generation's manifest rewritten in Redis (one tensor renamed), alone or with its hash,
    before the worker reads it. The worker once skipped it (or refused under a MAC the learner
    never reads), and the learner waited out its check-in deadline: a minute of training per
    forgery on a live run. Now the worker reads the learner's own manifest from the learner's
    store, which takes no client without the token, and checks in for it: the forged
    generation forms at once with the worker in it, and every later version reaches it on time."""
    import weight_sync.sender as sender_module

    monkeypatch.setenv("RLPIPE_SYNC_TOKEN", "s" * 32)  # as a live run: signed check-ins, through the gate
    run_id = free_run_id("ws")
    keys = Keys(run_id)
    procs, results = start_receivers(redis_server, run_id, {"w0": "register"}, versions=3)
    deadline_s = 8
    sender = make_sender(r, run_id, timeout_s=deadline_s)

    def live() -> dict[str, str]:
        return {w: f["incarnation"] for w, f in registry.live_workers(r, keys).items()}

    weights = model_weights(0)
    assert sender.sync(1, weights.items, live()).members == 1
    assert results.get(timeout=30) == ("w0", checksum(weights.items()), 1)

    publish = sender_module.publish_generation

    def and_rewritten(r_, key, state, fence=None):  # the attacker's HSET, before any worker reads the generation
        monkeypatch.setattr(sender_module, "publish_generation", publish)  # once
        forged = renamed(Manifest.from_json(state.manifest))
        publish(r_, key, dataclasses.replace(state, manifest=forged.to_json(), manifest_hash=forged.hash
                                             if rewritten == "the manifest and its hash" else state.manifest_hash),
                fence)

    monkeypatch.setattr(sender_module, "publish_generation", and_rewritten)
    r.delete(keys.sync)  # the next sync forms a new generation, which the attacker rewrites
    weights = model_weights(2)
    t0 = time.monotonic()
    assert sender.sync(2, weights.items, live()).members == 1
    assert time.monotonic() - t0 < deadline_s / 2  # not the check-in deadline
    assert results.get(timeout=30) == ("w0", checksum(weights.items()), 2)
    weights = model_weights(3)
    assert sender.sync(3, weights.items, live()).members == 1  # the steady state: the same generation
    assert results.get(timeout=30) == ("w0", checksum(weights.items()), 3)
    stop(procs)
    sender.drop()


def test_a_hung_receiver_ends_the_sync_within_the_timeout(redis_server, r):
    run_id = free_run_id("ws")
    procs, _ = start_receivers(redis_server, run_id, {"w0": "hang"})
    sender = make_sender(r, run_id, timeout_s=3, bucket_bytes=1 << 20)
    weights = model_weights(1)
    t0 = time.monotonic()
    with pytest.raises(SyncError):
        sender.sync(1, lambda: weights.items(), {"w0": "a"})
    assert time.monotonic() - t0 < 3 + 10  # the op timeout, never a hang
    assert sender.group is None  # the generation is dropped; the next sync re-forms one
    stop(procs)


def test_a_hung_member_is_given_up_on_alone_and_the_others_get_every_version_on_time(redis_server, r):
    """Issue 33, item 1: a member that stops reading in the middle of a transfer (alive, so
    its connection stays open). In one gloo group of everyone its timed-out send closed every
    pair, so that version reached no member and the next came a check-in deadline later. Now
    each member has a pair of its own: the hung one is given up on ``straggler_s`` after the
    others took the same send, they get that version, and every later one on time in the
    same generation (the steady state, measured over five more versions)."""
    run_id = free_run_id("ws")
    procs, results = start_receivers(redis_server, run_id, {"w0": "hang", "w1": "ok", "w2": "ok"}, versions=6)
    sender = make_sender(r, run_id, timeout_s=30, bucket_bytes=1 << 20, straggler_s=2.0)
    weights, live = model_weights(1), {"w0": "a", "w1": "a", "w2": "a"}
    try:
        t0 = time.monotonic()
        stats = sender.sync(1, lambda: weights.items(), live)
        assert time.monotonic() - t0 < 2.0 + 8  # the straggler deadline, not the 30 s sync timeout
        assert sorted(stats.received) == ["w1", "w2"] and sender.excluded == {"w0": "a"}
        assert sorted(results.get(timeout=30) for _ in range(2)) == \
            [(w, checksum(weights.items()), 1) for w in ("w1", "w2")]
        generation, took = stats.generation, []
        for version in range(2, 7):
            weights = model_weights(version)
            t0 = time.monotonic()
            stats = sender.sync(version, lambda: weights.items(), live)  # w0 still listed, still hung
            took.append(time.monotonic() - t0)
            assert (stats.members, stats.generation, stats.form_s) == (2, generation, 0.0), stats
            assert sorted(results.get(timeout=30) for _ in range(2)) == \
                [(w, checksum(weights.items()), version) for w in ("w1", "w2")]
        assert max(took) < 2.0, took  # on time: below the straggler deadline, with no forming
        assert sender.left_out_total == 1 and sender.members == ("w1", "w2")
    finally:
        stop(procs)
        sender.drop()


def gloo_pairs(size: int, timeout_s: float) -> list:
    """A learner (rank 0) and ``size - 1`` members, each member in a thread of this process,
    joined by real gloo pairs over loopback TCP, as a generation joins them."""
    import threading

    from torch.distributed import TCPStore

    from weight_sync.transport import GlooGroup

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = {}

    def join(rank):
        client = store if rank == 0 else TCPStore("127.0.0.1", store.port, is_master=False)
        groups[rank] = GlooGroup(client, rank, size, "127.0.0.1", 1, timeout_s, timeout_s)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [groups[rank] for rank in range(size)]


def test_the_straggler_rule_gives_up_on_a_member_that_stops_reading_alone_over_gloo_pairs():
    """weight_sync/stragglers.py, the one rule gloo, nccl and ipc give up on a member by, on
    real gloo pairs: member 2 takes the first send, then stops reading (alive: its connection
    stays open). It is given up on ``straggler_s`` after member 1 took the second send, not at
    the 30 s timeout, and its pair alone is abandoned; member 1 gets that send and the next
    one on time, bit for bit."""
    import threading

    from weight_sync.stragglers import StragglerRule

    learner, reader, stopped = gloo_pairs(3, timeout_s=30)
    rule = StragglerRule(timeout_s=30, straggler_s=1.0)
    sends = [torch.randn(1 << 20) + i for i in range(3)]  # 4 MiB each
    got = []

    def read(group, n):
        for tag in range(n):
            buf = torch.empty(1 << 20)
            group.wait(group.recv(buf, 0, tag))
            got.append((group.rank, buf))

    threads = [threading.Thread(target=read, args=(reader, 3), daemon=True),
               threading.Thread(target=read, args=(stopped, 1), daemon=True)]
    for t in threads:
        t.start()
    failed, took = {}, []
    for tag, tensor in enumerate(sends):
        t0 = time.monotonic()
        learner.finish(learner.post(tensor, tag, [1, 2], failed), failed, rule)
        took.append(time.monotonic() - t0)
        if tag == 0:
            assert failed == {} and sorted(learner.pairs) == [1, 2]
    assert list(failed) == [2] and failed[2] == rule.late(another_finished=True) and "stopped reading" in failed[2]
    assert sorted(learner.pairs) == [1]  # member 2's pair alone abandoned
    assert 1.0 <= took[1] < 1.0 + 4, took  # the straggler deadline, not the 30 s timeout
    assert took[2] < 1.0, took  # on time: member 2 is no longer sent to, nor waited for
    threads[0].join(10)
    assert sorted(rank for rank, _ in got) == [1, 1, 1, 2]  # member 2 read the first send alone
    assert all(torch.equal(buf, sends[i]) for i, buf in enumerate(b for r, b in got if r == 1))
    for group in (learner, reader, stopped):
        group.close()


def test_the_straggler_rule_fails_who_failed_abandons_who_is_late_and_waits_out_the_timeout_for_none_done():
    """The rule on its own, with calls standing for each member's wait: a member whose call
    raises is failed, not abandoned (its transport already closed it); one still waiting
    ``straggler_s`` after another finished is failed and abandoned; with no member done,
    each is late only at the timeout; one member alone is its call's own."""
    import threading

    from weight_sync.stragglers import StragglerRule

    never = threading.Event()  # a member that stopped reading: its wait would end only at its own timeout

    def refused():
        raise SyncError("bucket 0: the engine failed to load it")

    rule = StragglerRule(timeout_s=2.0, straggler_s=0.5)
    try:
        failed, abandoned = {}, []
        t0 = time.monotonic()
        rule.wait({1: lambda: time.sleep(0.2), 2: never.wait, 3: refused}, failed, abandoned.append)
        assert 0.2 + 0.5 <= time.monotonic() - t0 < 2.0
        assert failed == {2: rule.late(True), 3: "bucket 0: the engine failed to load it"} and abandoned == [2]
        failed, abandoned = {}, []
        t0 = time.monotonic()
        rule.wait({1: never.wait, 2: never.wait}, failed, abandoned.append)
        assert 2.0 <= time.monotonic() - t0 < 2.0 + 3
        assert failed == {1: rule.late(False), 2: rule.late(False)} and sorted(abandoned) == [1, 2]
        failed, abandoned = {}, []
        rule.wait({4: refused}, failed, abandoned.append)
        assert failed == {4: "bucket 0: the engine failed to load it"} and abandoned == []
        assert StragglerRule(timeout_s=5, straggler_s=10).straggler_s == 5  # capped by the timeout
    finally:
        never.set()


def test_a_store_that_is_gone_is_refused_at_once():
    """A worker that read a generation the learner has since dropped spent TCPStore's whole
    retry on the closed port (seen: 10.7 s, past the next generation's check-in deadline,
    which failed CI). The refusal now reaches it at once, as the SyncError that makes it
    read the current generation."""
    from weight_sync.gate import listening_socket
    from weight_sync.receiver import join_group
    sock = listening_socket("127.0.0.1")
    port = sock.getsockname()[1]
    sock.close()  # the learner's store, gone
    t0 = time.monotonic()
    with pytest.raises(SyncError, match="cannot reach the learner's store"):
        join_group("127.0.0.1", port, 1, 7, timeout_s=5.0)
    assert time.monotonic() - t0 < 1.0


def test_a_generations_only_member_that_died_is_left_out_at_once_and_its_restart_joins(redis_server, r):
    """Its registry entry outlives it (its TTL): the learner formed the next generation with
    it and blocked for the whole check-in deadline (60 s by default), while its restart, with
    a new incarnation, could not check in for the incarnation listed (seen in the ops test: a
    killed worker, alone on its precision's channel, stopped the learner for a minute). Now
    it is left out in its incarnation at once, and its restart gets every version on time."""
    run_id = free_run_id("ws")
    # the check-in deadline a stale listing would cost; above the restart's own 5 s store timeout, which
    # it may first spend on the generation it read at its start (its store gone) on a loaded machine
    timeout_s = 12.0
    procs, results = start_receivers(redis_server, run_id, {"w0": "crash"}, versions=10)  # dies in version 3
    sender = make_sender(r, run_id, timeout_s=timeout_s, bucket_bytes=64 << 10)
    weights, live = model_weights(5), {"w0": "a"}
    try:
        for version in (1, 2):
            assert sender.sync(version, lambda: weights.items(), live).members == 1
            assert results.get(timeout=30) == ("w0", checksum(weights.items()), version)
        with pytest.raises(SyncError, match="reached no worker"):
            sender.sync(3, lambda: weights.items(), live)
        procs[0].join(10)
        assert procs[0].exitcode == -9  # it really died mid-transfer
        t0 = time.monotonic()
        stats = sender.sync(4, lambda: weights.items(), live)  # its entry still listed
        assert time.monotonic() - t0 < 1.0 and stats.members == 0 and sender.group is None
        assert sender.excluded == {"w0": "a"} and sender.left_out_total == 1
        # its restart (a new incarnation) joins the next generation and gets every version on time
        restarted, results = start_receivers(redis_server, run_id, {"w0": "ok"}, versions=3)
        procs += restarted
        live = {"w0": "b"}
        for version in (5, 6, 7):
            t0 = time.monotonic()
            stats = sender.sync(version, lambda: weights.items(), live)
            assert stats.members == 1 and (stats.form_s > 0) == (version == 5), stats
            got = results.get(timeout=30)
            while got[1] == "SyncError" and version == 5:  # the restart may first try the generation it
                got = results.get(timeout=30)  # read at its start, gone with its store (a loaded machine)
            assert got == ("w0", checksum(weights.items()), version)
            # Version 5 forms the generation the restart joins: on a loaded machine the restart may
            # first spend its store client's connect timeout on the generation it read at its start
            # (seen: 5.8 s). A stale listing shows as members == 0 above, not as time.
            assert time.monotonic() - t0 < (2 * timeout_s if version == 5 else timeout_s / 2)
        assert sender.members == ("w0",) and sender.left_out_total == 1
    finally:
        stop(procs)
        sender.drop()


def test_generation_numbers_never_repeat_whatever_redis_loses(redis_server, r, tmp_path):
    """The sync hash lost, then its counter too, then the learner restarted after Redis lost
    everything: each new generation's number is above every one used before, and the worker
    joins it and gets its versions (steady state: the next version reuses the generation).
    Before, a learner restarted while the hash was gone counted from 1 again."""
    from types import SimpleNamespace

    from rlpipe.fence import Fence, Fenced
    from weight_sync.rendezvous import GenerationFloor, next_generation

    run_id = free_run_id("ws")
    keys, floor = Keys(run_id), GenerationFloor(tmp_path / "sync-generations.json")
    procs, results = start_receivers(redis_server, run_id, {"w0": "ok"}, versions=6)
    sender, weights, live, used = make_sender(r, run_id, timeout_s=10, floor=floor), model_weights(4), {"w0": "a"}, []

    def sync(version: int, forms: bool) -> None:
        stats = sender.sync(version, lambda: weights.items(), live)
        assert stats.members == 1 and (stats.form_s > 0) == forms
        assert results.get(timeout=30) == ("w0", checksum(weights.items()), version)
        if forms:
            assert all(stats.generation > g for g in used), (stats.generation, used)
            used.append(stats.generation)

    try:
        sync(1, forms=True)
        r.delete(keys.sync)  # the hash lost
        sync(2, forms=True)
        r.delete(keys.sync, keys.sync_generations)  # and its counter
        sync(3, forms=True)
        sender.drop()  # the learner restarts while the hash is gone
        r.delete(keys.sync)
        sender = make_sender(r, run_id, timeout_s=10, floor=floor)
        sync(4, forms=True)
        sender.drop()  # Redis lost everything and the learner restarted: its disk remembers
        r.delete(keys.sync, keys.sync_generations)
        sender = make_sender(r, run_id, timeout_s=10, floor=floor)
        sync(5, forms=True)
        sync(6, forms=False)
        assert floor.get(keys.sync) == used[-1] == int(r.hget(keys.sync_generations, keys.sync))
    finally:
        stop(procs)
        sender.drop()
    # a learner that lost its lease takes no number
    r.set(keys.epoch, 9)
    with pytest.raises(Fenced):
        next_generation(r, keys.sync_generations, keys.sync, 0, Fence(r, keys.epoch, SimpleNamespace(epoch=8)))
    # the counter alone (no hash, no floor: a restarted learner whose disk is new) remembers
    r.delete(keys.sync)
    assert next_generation(r, keys.sync_generations, keys.sync, 0) == used[-1] + 1


def test_no_live_workers_means_no_generation(r):
    sender = make_sender(r, free_run_id("ws"), timeout_s=3)
    assert sender.sync(0, lambda: {"w": torch.zeros(2)}.items(), {}).members == 0
    assert sender.group is None


def test_a_manifest_that_does_not_fit_the_workers_model_is_refused(toy_model_path):
    from learner.policy import load_policy
    from weight_sync.manifest import incompatibility
    from weight_sync.names import checkpoint_shapes

    expected = checkpoint_shapes(toy_model_path)
    named = [(n, p.dtype, tuple(p.shape)) for n, p in load_policy(toy_model_path).named_parameters()]
    assert incompatibility(plan_buckets(named, 1 << 20), expected) is None  # the learner's own model fits
    name, dtype, shape = named[3]
    wrong = named[:3] + [(name, dtype, (shape[0] + 1, *shape[1:]))] + named[4:]
    assert f"{name}: the learner sends shape" in incompatibility(plan_buckets(wrong, 1 << 20), expected)
    alien = named + [("model.extra.weight", torch.float32, (2, 2))]
    assert "'model.extra.weight'" in incompatibility(plan_buckets(alien, 1 << 20), expected)


def test_the_benchmark_runs_and_reports_side_by_side_ratios(tmp_path):
    from tests.conftest import ROOT

    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "weight_sync_speed.py"), "--sizes", "tiny", "--repeats", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    section = json.loads(out.read_text())
    (row,) = section["data"]
    assert section["name"] == "weight_sync" and section["tables"][0]["rows"][0][0] == "tiny"
    assert (out.parent / section["plots"][0]["file"]).stat().st_size > 0
    assert row["size"] == "tiny" and row["params"] > 100_000 and row["bytes"] == 2 * row["params"]
    for key in ("raw_s", "raw_p2p_s", "rlpipe_s", "per_tensor_s"):
        assert row[key] > 0
    assert row["rlpipe_vs_raw"] == pytest.approx(row["raw_s"] / row["rlpipe_s"])
    assert "rlpipe/raw" in proc.stdout
    # rlpipe's syncs by phase: each measured, and within the time until every receiver activated
    assert section["tables"][1]["columns"] == ["size", "prepare s", "transfer s", "pause s", "convergence s"]
    assert all(row[f"{phase}_s"] > 0 for phase in ("prepare", "transfer", "pause", "convergence"))
    assert row["prepare_s"] + row["transfer_s"] <= row["rlpipe_s"] < row["convergence_s"]
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "weight_sync_speed.py"), "--sizes", "2B"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--sizes: unknown ['2B']" in bad.stderr


def int8_versions(n: int, changed: float = 0.02) -> list[dict[str, torch.Tensor]]:
    """``n`` versions of an int8 wire: weights whose values mostly keep from one version to
    the next (a few move one step, fewer further), and fp32 scales that all change."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (400_000,), generator=gen, dtype=torch.int32).to(torch.int8)
    out = []
    for _ in range(n):
        w = w.clone()
        pos = torch.randperm(w.numel(), generator=gen)[: int(changed * w.numel())]
        step = torch.randint(0, 2, (pos.numel(),), generator=gen) * 2 - 1
        step[: pos.numel() // 20] *= 5  # a twentieth move further than one step
        w[pos] = (w[pos].to(torch.int32) + step).clamp(-127, 127).to(torch.int8)
        out.append({"layer.weight": w.view(400, 1000), "layer.weight_scale": torch.rand(400, 1, generator=gen),
                    "norm.weight": torch.ones(1000, dtype=torch.bfloat16)})
    return out


def test_a_quantized_generation_sends_deltas_bit_exactly_and_a_full_version_every_kth(redis_server, r):
    """After a generation's first version, versions go as what changed (weight_sync/delta.py)
    and arrive bit for bit; every ``full_every``-th goes whole, and a re-formed generation
    (a member that joined) starts whole again."""
    run_id = free_run_id("ws")
    versions = int8_versions(7)
    procs, results = start_receivers(redis_server, run_id, {"w0": "ok", "w1": "ok"}, versions=len(versions))
    sender = WeightSender(r, Keys(run_id), "127.0.0.1", timeout_s=30, bucket_bytes=256 << 10, wire_dtype=None,
                          full_every=4)
    live = {"w0": "a", "w1": "a"}
    kinds = []
    for version, weights in enumerate(versions, 1):
        stats = sender.sync(version, lambda: weights.items(), live)
        got = sorted(results.get(timeout=60) for _ in procs)
        assert got == [("w0", checksum(weights.items()), version), ("w1", checksum(weights.items()), version)]
        kinds.append("delta" if stats.delta else "full")
        assert stats.full_bytes == sum(t.numel() * t.element_size() for t in weights.values())
        if stats.delta:  # 2% of the int8 values moved: the delta is a small part of the version
            assert stats.bytes < 0.25 * stats.full_bytes, (stats.bytes, stats.full_bytes)
        else:
            assert stats.bytes == stats.full_bytes
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta", "delta"]
    assert stats.form_s == 0 and sender.manifest.delta  # one generation throughout
    stop(procs)
    sender.drop()
    assert sender.held is None  # the next generation's members hold nothing: it starts whole


def test_a_delta_against_another_base_is_refused_before_anything_is_written():
    from weight_sync.delta import apply_version, bucket_checksums, encode_version, payload_sizes
    from weight_sync.delta_codec import DeltaMismatch

    v1, v2, v3 = int8_versions(3)
    m = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in v1.items()], 256 << 10, delta=True)
    packed = [[pack_bucket(b, v) for b in m.buckets] for v in (v1, v2, v3)]
    index, payloads, crcs = encode_version(m, packed[0], packed[1], bucket_checksums(packed[0]))
    assert [p.numel() for p in payloads] == payload_sizes(index)
    held = [b.clone() for b in packed[0]]
    assert apply_version(m, held, bucket_checksums(held), index, payloads) == crcs
    assert all(torch.equal(a, b) for a, b in zip(held, packed[1]))  # bit for bit the new version
    # a member holding version 3 (not the delta's base): refused, its buffers untouched
    other = [b.clone() for b in packed[2]]
    with pytest.raises(DeltaMismatch, match="another base"):
        apply_version(m, other, bucket_checksums(other), index, payloads)
    assert all(torch.equal(a, b) for a, b in zip(other, packed[2]))

# -- sync phases: prepare, transfer, the workers' activation pause, fleet convergence -------------

PAUSE_S = 0.05  # the stand-in's activation pause


class ServingEngine(ChecksumEngine):
    """The checksum engine as a worker that serves what it receives: each version is staged
    (received; reported as ``(id, "staged", version)``) and then activated with a pause of
    ``pause_s``, as the vLLM engine pauses generation to load staged weights, and it says
    when it began serving it."""

    pause_s = PAUSE_S

    async def update(self, version, manifest):
        from weight_sync.follower import SyncOutcome

        t0 = time.perf_counter()
        outcome, _ = await self.stage(version, manifest)
        if not outcome.ok:
            return outcome
        staged = time.perf_counter()
        self.results.put((self.worker_id, "staged", version))
        await asyncio.sleep(self.pause_s)
        self.version = version
        return SyncOutcome(True, timings={"transfer_s": staged - t0, "pause_s": time.perf_counter() - staged},
                           activated_at=time.time())


def _serving(redis_url, run_id, worker_id, ttl_s, pause_s, results, precision=""):
    """A stand-in rollout worker that registers as one does (rollout_service/loop.py): the
    production follower on a :class:`ServingEngine`, its registry entry (TTL ``ttl_s``)
    heart-beaten every 0.1 s and rewritten after every update with ``last_sync``. With a
    ``precision`` it is a mixed fleet's worker: registered with it, on its channel."""
    from rlpipe import registry
    from weight_sync.follower import WeightFollower

    r, keys = connect(redis_url), Keys(run_id)
    engine = ServingEngine(worker_id, "ok", results)
    engine.pause_s = pause_s
    last_sync = {}

    def publish():
        registry.heartbeat_worker(r, keys, worker_id, ttl_s, version=engine.version, incarnation="a",
                                  last_sync=json.dumps(last_sync), **({"precision": precision} if precision else {}))

    def synced(s):
        last_sync.update(version=s.version, **s.timings, activated_at=s.activated_at)
        publish()

    async def published(incarnation):
        pass

    async def main():
        follower = WeightFollower(r, keys.sync_channel(precision), worker_id, engine, 5.0, lambda: None, synced,
                                  lambda e: None, published)
        publish()
        results.put((worker_id, "ready"))

        async def heartbeat():
            while True:
                publish()
                await asyncio.sleep(0.1)

        await asyncio.gather(follower.run(asyncio.Event(), poll_s=0.02), heartbeat())

    asyncio.run(main())


def start_serving(redis_server, run_id, pauses: dict[str, float], ttl_s=4.0, precisions: dict[str, str] | None = None):
    """Stand-in workers (id -> activation pause; ``precisions``: id -> its precision in a
    mixed fleet); returns the processes and their reports."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_serving, args=(redis_server.url, run_id, w, ttl_s, pause, results,
                                                (precisions or {}).get(w, "")), daemon=True)
             for w, pause in pauses.items()]
    for p in procs:
        p.start()
    assert sorted(results.get(timeout=120) for _ in procs) == sorted((w, "ready") for w in pauses)
    return procs, results


def test_convergence_counts_the_members_that_switched_from_their_registry_entries():
    """The rules of weight_sync/convergence.py on registry entries as workers write them: only
    the members the transfer reached count; one still on the old version holds the version
    open; a restarted one (another incarnation) or a gone one is not counted; one already on a
    later version counts with that later switch; a re-sent version keeps its first start."""
    from weight_sync.convergence import Convergence

    def entry(version, activated_at, pause_s=0.01, incarnation="a"):
        return {"version": str(version), "incarnation": incarnation,
                "last_sync": json.dumps({"version": version, "pause_s": pause_s, "activated_at": activated_at})}

    conv = Convergence(max_open=2)
    conv.started(5, 100.0, {"w0": "a", "w1": "a"})  # w2 was left out: not a member
    conv.started(5, 200.0, {"w0": "a", "w1": "a", "w2": "a"})  # sent again to a new generation: ignored
    workers = {"w0": entry(5, 100.5, 0.2), "w1": entry(4, 90.0), "w2": entry(4, 90.0)}
    assert conv.observe(workers) == []  # w1 has not switched
    (c,) = conv.observe({**workers, "w1": entry(5, 101.0, 0.1)})
    assert (c.version, c.seconds, c.pause_max_s, c.workers) == (5, 1.0, 0.2, 2)

    conv.started(6, 110.0, {"w0": "a", "w1": "a"})
    assert conv.observe({"w0": entry(6, 110.5), "w1": entry(5, 101.0, incarnation="b")})[0].workers == 1
    conv.started(7, 120.0, {"w0": "a", "w1": "a"})
    (c,) = conv.observe({"w0": entry(8, 123.0), "w1": entry(7, 121.0, 0.3)})  # w0 switched twice since
    assert (c.version, c.seconds, c.pause_max_s) == (7, 3.0, 0.3)
    conv.started(9, 130.0, {"w0": "a"})
    assert conv.observe({}) == [] and conv.open == []  # its only member is gone: nothing to report
    for v in (10, 11, 12):  # never served: the oldest is given up past max_open
        conv.started(v, 140.0 + v, {"w0": "a"})
    assert [o.version for o in conv.open] == [11, 12]


def test_convergence_waits_for_a_stopped_member_and_leaves_it_out_once_its_entry_expires(redis_server, r):
    """Convergence counts the workers that really switched: a member stopped (SIGSTOP) after its
    transfer, before it activated the version, holds the version open as long as it is
    registered, and counts once it resumes and switches; stopped until its registry entry
    expires, it is left out and not counted. (Stopped before its transfer, a member is not
    one: gloo's send waits for its receive, times out, and the member is left out of the
    version, weight_sync/sender.py.)"""
    import os
    import signal

    from rlpipe import registry
    from weight_sync.convergence import Convergence

    run_id = free_run_id("ws")
    keys = Keys(run_id)
    # w1 activates slowly (1 s), long enough to be stopped between its transfer and its switch
    procs, results = start_serving(redis_server, run_id, {"w0": PAUSE_S, "w1": 1.0}, ttl_s=4.0)
    sender = make_sender(r, run_id, timeout_s=10)
    weights = model_weights(0)
    live, conv = {"w0": "a", "w1": "a"}, Convergence()

    def sync(version):
        t0 = time.time()
        stats = sender.sync(version, weights.items, live)
        conv.started(version, t0, stats.received)
        assert stats.received == live
        return t0

    def stop_once_staged(version):
        while results.get(timeout=30) != ("w1", "staged", version):
            pass
        os.kill(procs[1].pid, signal.SIGSTOP)

    def converged():
        return conv.observe(registry.live_workers(r, keys))

    def serves(worker, version):
        return lambda: registry.live_workers(r, keys).get(worker, {}).get("version") == str(version)

    try:
        t0 = sync(1)
        (c,) = wait_for(converged, 30, what="version 1 served by both")
        assert c.version == 1 and c.workers == 2
        assert 1.0 <= c.pause_max_s < c.seconds < time.time() - t0  # w1's pause, the longest

        sync(2)
        stop_once_staged(2)
        wait_for(serves("w0", 2), 30, what="w0 on version 2")
        time.sleep(2.0)
        assert converged() == []  # w1 is registered and has not switched: version 2 is open
        os.kill(procs[1].pid, signal.SIGCONT)
        (c,) = wait_for(converged, 30, what="w1 on version 2 once resumed")
        assert c.version == 2 and c.workers == 2 and c.seconds > 2.0  # it waited for w1

        sync(3)
        stop_once_staged(3)
        wait_for(serves("w0", 3), 30, what="w0 on version 3")
        assert converged() == []
        (c,) = wait_for(converged, 30, what="w1's registry entry to expire")
        assert "w1" not in registry.live_workers(r, keys)
        assert c.version == 3 and c.workers == 1 and c.seconds < 3.0  # w0's switch, not w1's expiry
        assert c.pause_max_s < 1.0  # w0's pause alone
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        stop(procs)
        sender.drop()


def test_the_learners_row_has_each_phase_of_a_real_sync(redis_server, r, toy_model_path):
    """One real sync through the learner's FleetSync (fp8 quantized on the learner, two
    workers): prepare (quantize + pack) and transfer are each > 0 and with forming sum to no
    more than the sync's wall time; the next step's row has the version's convergence, which
    covers them and the slowest worker's activation, and the workers' longest pause."""
    import re

    from prometheus_client import generate_latest

    from learner.channels import FleetSync
    from learner.metrics import LearnerMetrics
    from learner.policy import load_policy
    from rlpipe import registry
    from rlpipe.config import build_config

    run_id = free_run_id("ws")
    cfg = build_config({}, environ={}, run_id=run_id, redis_url=redis_server.url, workers=2, **{
        "model.path": toy_model_path, "rollout.precision": "fp8", "quant.fp8.quantize_on": "learner",
        "sync.bucket_mib": 0.25, "sync.timeout_s": 10.0})
    procs, _ = start_serving(redis_server, run_id, {"w0": PAUSE_S, "w1": PAUSE_S})
    metrics = LearnerMetrics(None, run_name=run_id)
    fleet = FleetSync(cfg, r, Keys(run_id), metrics)
    model = load_policy(toy_model_path)
    try:
        t0 = time.perf_counter()
        first = fleet.sync(model, 1, 1)
        wall = time.perf_counter() - t0
        assert first["weight_sync_members"] == 2 and "weight_sync_failed" not in first
        phases = [first[f"weight_sync_{p}_seconds"] for p in ("prepare", "transfer")]
        assert all(p > 0 for p in phases), first
        assert first["weight_sync_prepare_seconds"] == pytest.approx(first["quant_seconds"]
                                                                     + first["weight_sync_pack_seconds"])
        assert sum(phases) + first["weight_sync_form_seconds"] <= first["weight_sync_seconds"] <= wall
        assert "weight_sync_convergence_seconds" not in first  # measured later, never waited for

        wait_for(lambda: all(f.get("version") == "1" for f in registry.live_workers(r, Keys(run_id)).values()), 30,
                 what="both workers on version 1")
        second = fleet.sync(model, 2, 2)
        assert second["weight_sync_converged_version"] == 1 and second["weight_sync_converged_workers"] == 2
        assert sum(phases) + first["weight_sync_form_seconds"] < second["weight_sync_convergence_seconds"] < 30
        assert PAUSE_S <= second["weight_sync_pause_max_seconds"] < second["weight_sync_convergence_seconds"]
        metrics.record(second)
        page = generate_latest(metrics.registry).decode()
        for name in ("prepare", "convergence", "pause_max"):
            assert re.search(rf"^rlpipe_weight_sync_{name}_seconds\{{[^}}]*\}} \S+$", page, re.M), name
        for phase in ("prepare", "transfer", "convergence"):
            assert f'rlpipe_weight_sync_seconds_count{{phase="{phase}",run_id="{run_id}"}} ' in page, phase
    finally:
        fleet.drop()
        stop(procs)


def test_a_worker_lost_from_one_precision_costs_the_other_precisions_channel_nothing(redis_server, r,
                                                                                     toy_model_path):
    """A mixed fleet's learner re-forms only the channel whose worker went. It used to send the
    version again on every channel, to members that already held it and never take a version
    twice: the learner blocked for sync.timeout_s and the other channel's generation was
    dropped (seen live: a killed bf16 worker stalled an int8 channel 60 s)."""
    from learner.channels import FleetSync
    from learner.metrics import LearnerMetrics
    from learner.policy import load_policy
    from rlpipe import registry
    from rlpipe.config import build_config

    run_id = free_run_id("ws")
    cfg = build_config({}, environ={}, run_id=run_id, redis_url=redis_server.url, workers=2, **{
        "model.path": toy_model_path, "rollout.fleet": ["fp32", "bf16"], "sync.timeout_s": 6.0})
    procs, _ = start_serving(redis_server, run_id, {"w0": 0.0, "w1": 0.0}, ttl_s=1.0,
                             precisions={"w0": "fp32", "w1": "bf16"})
    fleet = FleetSync(cfg, r, Keys(run_id), LearnerMetrics(None, run_name=run_id))
    model = load_policy(toy_model_path)
    kept = fleet.channels["fp32"].sender
    try:
        first = fleet.sync(model, 1, 1)
        assert first["weight_sync_members"] == 2 and "weight_sync_failed" not in first, first
        wait_for(lambda: all(f.get("version") == "1" for f in registry.live_workers(r, Keys(run_id)).values()), 30,
                 what="both workers on version 1")
        generation = kept.state.generation
        procs[1].kill()
        wait_for(lambda: "w1" not in registry.live_workers(r, Keys(run_id)), 30, what="w1's entry to expire")
        t0 = time.perf_counter()
        fleet.maybe_resync(model, 1, 1)  # as the learner does while it waits for groups
        assert time.perf_counter() - t0 < cfg.sync.timeout_s / 2
        assert kept.state.generation == generation and kept.group is not None and kept.left_out_total == 0
        second = fleet.sync(model, 2, 2)
        assert second["weight_sync_members"] == 1 and "weight_sync_failed" not in second, second
        assert second["weight_sync_by_precision"]["fp32"]["generation"] == generation
    finally:
        fleet.drop()
        stop(procs)
