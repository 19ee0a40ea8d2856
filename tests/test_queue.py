"""The trajectory stream on a real Redis: delivery, acknowledgement, take-over, accounting."""

from __future__ import annotations

import time

import msgpack

from rlpipe.queue import Keys, TrajectoryQueue, connect, rollout_allowance
from tests.conftest import free_run_id
from tests.test_schema import make_record


def test_push_read_ack_keeps_the_books(r):
    q = TrajectoryQueue(r, free_run_id("q"))
    q.ensure_consumer_group()
    ids = [q.push(make_record(group_id=f"g{i}")) for i in range(5)]
    got = q.read("c1", count=3, block_ms=100)
    assert [e.entry_id for e in got] == ids[:3]
    assert [e.record.group_id for e in got] == ["g0", "g1", "g2"]
    assert q.pending() == 3
    q.ack([got[0].entry_id, got[1].entry_id], dropped_stale=[got[2].entry_id])
    c = q.counters()
    assert (c["produced"], c["trained"], c["dropped_stale"]) == (5, 2, 1)
    assert q.pending() == 0 and q.length() == 2  # acknowledged entries leave the stream
    assert c["produced"] == c["trained"] + c["dropped_stale"] + q.length()
    assert [e.record.group_id for e in q.read("c1", count=10, block_ms=100)] == ["g3", "g4"]


def test_unacknowledged_entries_survive_a_dead_consumer(r):
    q = TrajectoryQueue(r, free_run_id("q"))
    q.ensure_consumer_group()
    for i in range(4):
        q.push(make_record(group_id=f"g{i}"))
    first = q.read("dead", count=4, block_ms=100)  # read, then "crash" before acknowledging
    assert len(first) == 4
    assert q.read("next", count=4, block_ms=50) == []  # not re-delivered to a new reader by itself...
    time.sleep(0.05)
    claimed = q.claim_pending("next", min_idle_ms=10)  # ...but taken over explicitly
    assert sorted(e.record.group_id for e in claimed) == ["g0", "g1", "g2", "g3"]
    q.ack([e.entry_id for e in claimed])
    assert q.pending() == 0 and q.length() == 0


def test_malformed_entries_go_to_the_dead_letter_stream(r):
    q = TrajectoryQueue(r, free_run_id("q"))
    q.ensure_consumer_group()
    q.push(make_record(group_id="good1"))
    bad_id = r.xadd(q.keys.traj, {"data": msgpack.packb([1, 2])}).decode()
    r.xadd(q.keys.traj, {"other": b"x"})
    q.push(make_record(group_id="good2"))
    got = q.read("c", count=10, block_ms=100)
    assert [e.record.group_id for e in got] == ["good1", "good2"]  # nothing crashed, nothing good lost
    dead = r.xrange(q.keys.dead)
    assert len(dead) == 2 and q.counters()["dead"] == 2
    reasons = {d[1][b"source_id"].decode(): d[1][b"reason"].decode() for d in dead}
    assert "top level" in reasons[bad_id]
    assert q.pending() == 2  # only the two good ones await acknowledgement


def test_cursor_hands_out_each_index_once(r):
    q = TrajectoryQueue(r, free_run_id("q"))
    assert [q.next_prompt_index() for _ in range(5)] == [0, 1, 2, 3, 4]
    other = TrajectoryQueue(r, q.keys.prefix.split(":")[1])
    assert other.next_prompt_index() == 5


def test_rollout_allowance_is_version_based():
    counters = {"produced": 0, "dropped_stale": 0}
    # Synchronous (max_lag 0): one step's batch per version, in flight counted.
    assert rollout_allowance(counters, inflight=0, version=0, groups_per_step=4, max_lag=0) == 4
    assert rollout_allowance(counters, inflight=3, version=0, groups_per_step=4, max_lag=0) == 1
    assert rollout_allowance({"produced": 4, "dropped_stale": 0}, 0, 0, 4, 0) == 0
    assert rollout_allowance({"produced": 4, "dropped_stale": 0}, 0, 1, 4, 0) == 4
    # One step ahead (max_lag 1), and dropped groups give their places back.
    assert rollout_allowance({"produced": 8, "dropped_stale": 0}, 0, 0, 4, 1) == 0
    assert rollout_allowance({"produced": 8, "dropped_stale": 3}, 0, 0, 4, 1) == 3


def test_keys_follow_the_design(r):
    k = Keys("abc")
    assert (k.traj, k.dead, k.learner, k.sync, k.cursor) == (
        "rlpipe:abc:traj", "rlpipe:abc:traj:dead", "rlpipe:abc:learner", "rlpipe:abc:sync", "rlpipe:abc:prompts:cursor")
    assert k.worker("w3") == "rlpipe:abc:workers:w3"


def _take_indices(url: str, run_id: str, n: int, give_back_every: int, out) -> None:
    """One contender for the cursor: takes ``n`` indices, giving back every k-th one."""
    q = TrajectoryQueue(connect(url), run_id)
    kept = []
    for i in range(n):
        index = q.next_prompt_index()
        if give_back_every and i % give_back_every == 0:
            q.give_back([index])
        else:
            kept.append(index)
    out.put(kept)


def test_cursor_hands_out_every_index_once_across_processes(redis_server):
    """Four processes race for prompts and give some back: the indices kept are exactly
    0..N-1 (no duplicates, no skips), given-back ones included, once each."""
    import multiprocessing as mp

    run_id = free_run_id("cursor")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_take_indices, args=(redis_server.url, run_id, 300, k, out)) for k in (0, 3, 5, 7)]
    for p in procs:
        p.start()
    kept = [i for _ in procs for i in out.get(timeout=60)]
    for p in procs:
        p.join(30)
    q = TrajectoryQueue(connect(redis_server.url), run_id)
    left = [int(x) for x in q.r.lrange(q.keys.returned, 0, -1)]  # given back after their last take
    handed = int(q.r.get(q.keys.cursor))
    assert sorted(kept + left) == list(range(handed))
    assert handed < 4 * 300  # given-back indices were handed out again instead of new ones
