"""Weight sync without vLLM: bucket planning, bit-exact transfer over real gloo between
processes, and failures that end within the timeout instead of hanging."""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing as mp
import subprocess
import sys
import time

import pytest
import torch

from rlpipe.queue import Keys, connect
from tests.conftest import free_run_id
from weight_sync.manifest import Manifest, pack_bucket, plan_buckets, unpack_bucket
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


class ChecksumEngine:
    """A stand-in for the vLLM engine behind the real ``WeightFollower``: it joins and
    receives through ``WeightReceiver`` and reports each version's checksum instead of
    loading it; or misbehaves as ``mode`` says (``refuse`` the manifest, ``hang`` after
    joining, ``crash`` in the middle of version 3 via RLPIPE_CRASH_AT)."""

    def __init__(self, worker_id, mode, results, timeout_s=5.0):
        self.worker_id, self.mode, self.results, self.timeout_s = worker_id, mode, results, timeout_s
        self.version = -1
        self.receiver = None

    async def join(self, host, port, candidate, generation, manifest_json, timeout_s):
        from weight_sync.follower import SyncOutcome
        from weight_sync.receiver import WeightReceiver
        from weight_sync.transport import LeftOut

        if self.receiver is not None:
            self.receiver.close()
        refuse = None
        if self.mode == "refuse":  # its model lacks the learner's "embed"
            from weight_sync.manifest import incompatibility

            m = Manifest.from_json(manifest_json)
            refuse = incompatibility(m, {t.name: t.shape for b in m.buckets for t in b.tensors if t.name != "embed"})
        try:
            self.receiver = await asyncio.to_thread(WeightReceiver.join, host, port, candidate, generation,
                                                    Manifest.from_json(manifest_json), self.timeout_s, refuse)
        except (LeftOut, SyncError) as e:
            self.results.put((self.worker_id, type(e).__name__, generation))
            return SyncOutcome.failed(str(e), refused=refuse is not None)
        if self.mode == "hang":
            await asyncio.sleep(60)
        return SyncOutcome(True)

    async def update(self, version, manifest_json):
        from weight_sync.follower import SyncOutcome

        try:
            weights = await asyncio.to_thread(self.receiver.receive, version, Manifest.from_json(manifest_json))
        except SyncError as e:
            return SyncOutcome.failed(str(e))
        self.version = version
        self.results.put((self.worker_id, checksum(weights), version))
        return SyncOutcome(True)

    async def load_checkpoint(self, path, version, quant_profile):
        raise AssertionError("no checkpoints here")


def _receiver(redis_url, run_id, worker_id, mode, versions, results):
    """A stand-in rollout worker process: the production follower on a checksum engine,
    until it has received ``versions`` versions (or refused once)."""
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
        pass

    follower = WeightFollower(connect(redis_url), Keys(run_id).sync, worker_id, engine, 5.0, lambda: None, synced,
                              failed, published)
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


def make_sender(r, run_id, timeout_s, bucket_bytes=256 << 10):
    return WeightSender(r, Keys(run_id), "127.0.0.1", timeout_s=timeout_s, bucket_bytes=bucket_bytes,
                        wire_dtype=torch.float32)


def stop(procs):
    for p in procs:
        p.kill()
        p.join()


def test_broadcast_to_two_receivers_is_bit_exact(redis_server, r):
    run_id = free_run_id("ws")
    procs, results = start_receivers(redis_server, run_id, {"w0": "ok", "w1": "ok"}, versions=2)
    sender = make_sender(r, run_id, timeout_s=30)
    live = {"w0": "a", "w1": "a"}
    for version, seed in [(5, 0), (6, 1)]:
        weights = model_weights(seed)
        stats = sender.sync(version, lambda: weights.items(), live)
        got = sorted(results.get(timeout=60) for _ in procs)
        assert got == [("w0", checksum(weights.items()), version), ("w1", checksum(weights.items()), version)]
        assert stats.members == 2 and stats.bytes == sum(t.numel() * 4 for t in weights.values())
    assert stats.form_s == 0  # the second version reused the generation
    assert len(sender.manifest.buckets) >= 2  # "big" (1.2 MB) exceeds a 256 KiB bucket
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
    stats = sender.sync(4, lambda: weights.items(), live)  # a new generation, without w1
    assert time.monotonic() - t0 < 5 and stats.members == 1 and stats.generation == 2
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


def test_a_hung_member_costs_one_version_and_the_next_reaches_the_others(redis_server, r):
    """A member that stops reading in the middle of a transfer (alive, so its connection
    stays open) is not a dead one: gloo's timed-out send closes the whole group, so that
    version reaches no member. The steady state comes back at the next sync: the hung
    member misses the new generation's check-in and is left out, and the others get it."""
    run_id = free_run_id("ws")
    procs, results = start_receivers(redis_server, run_id, {"w0": "hang", "w1": "ok"})
    sender = make_sender(r, run_id, timeout_s=3, bucket_bytes=1 << 20)
    weights, live = model_weights(1), {"w0": "a", "w1": "a"}
    with pytest.raises(SyncError, match="reached no worker"):
        sender.sync(1, lambda: weights.items(), live)
    t0 = time.monotonic()
    stats = sender.sync(2, lambda: weights.items(), live)
    assert time.monotonic() - t0 < 3 + 5  # one check-in deadline, not a hang
    assert stats.members == 1 and sender.members == ("w1",) and "w0" in sender.excluded
    assert results.get(timeout=30) == ("w1", checksum(weights.items()), 2)
    stop(procs)


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
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "weight_sync.py"), "--sizes", "tiny", "--repeats", "1",
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
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "weight_sync.py"), "--sizes", "2B"],
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
    from quant.delta import DeltaMismatch
    from weight_sync.delta import apply_version, bucket_checksums, encode_version, payload_sizes

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
