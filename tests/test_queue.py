"""The trajectory stream on a real Redis: delivery, acknowledgement, take-over, accounting."""

from __future__ import annotations

import time

import msgpack

from rlpipe import registry
from rlpipe.admission import MAX_PROMPT_INDEX, RunCheck
from rlpipe.index_set import IndexSet
from rlpipe.keys import Keys
from rlpipe.queue import Entry, TrajectoryQueue
from rlpipe.redis_link import connect
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
    q.ack([got[0].entry_id, got[1].entry_id], dropped_stale=[got[2]])
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
    assert [q.next_prompt_index("w0")[0] for _ in range(5)] == [0, 1, 2, 3, 4]
    other = TrajectoryQueue(r, q.keys.prefix.split(":")[1])
    assert other.next_prompt_index("w1") == (5, 0)
    assert q.leased("w0") == {0, 1, 2, 3, 4} and q.leased("w1") == {5}


def test_the_hand_out_keeps_within_the_allowance(r):
    """Back-pressure is computed in the hand-out script from the learner hash and the counters."""
    q = TrajectoryQueue(r, free_run_id("allow"))
    registry.set_learner_state(r, q.keys, version=0, consumed=0)
    lease = q.lease_prompts("w0", 10, (0, 4, 0))  # synchronous: one step's batch
    got = lease.prompts
    assert lease.allowance == 4 and [i for i, _ in got] == [0, 1, 2, 3]
    assert lease.fleet_leased == 4 == q.counters()["leased"] and lease.unconsumed == 0
    assert q.lease_prompts("w0", 10, (0, 4, 0))[:2] == (0, [])  # in flight (leased) count
    for index, _ in got:
        q.push(make_record(group_id=f"g{index}", prompt_index=index), "w0")
    assert q.counters()["leased"] == 0 and q.lease_prompts("w0", 10, (0, 4, 0))[0] == 0  # produced, unconsumed
    registry.set_learner_state(r, q.keys, version=1, consumed=4)
    assert q.lease_prompts("w0", 10, (0, 4, 0))[0] == 0  # weights a version behind: a step fewer
    assert q.lease_prompts("w0", 0, (1, 4, 1))[0] == 8  # max_lag 1: two steps' places
    # A restored learner: its version runs ahead of the steps it consumed. The places do not grow.
    registry.set_learner_state(r, q.keys, version=7, consumed=4)
    assert q.lease_prompts("w0", 0, (7, 4, 1))[0] == 8


def test_a_slow_workers_group_holds_the_fleet_before_the_learner_passes_max_staleness(r):
    """Issue 33: the places assumed the learner trains groups in the order they were leased,
    but it trains them as they arrive, so a fast worker's groups overtook every group of a
    slow one (an fp16 worker beside a bf16 one: all dropped stale, none trained). Here the
    slow worker leases a group at version 0 and holds it while the fast one fills every place
    it gets and the learner trains whatever arrives: the learner gets to max_staleness and
    no further without that group, which then completes the batch trained at max_staleness."""
    q = TrajectoryQueue(r, free_run_id("slow"))
    per_step, max_lag, max_staleness = 4, 1, 3
    registry.set_learner_state(r, q.keys, version=0, consumed=0)
    (slow, attempt), = q.lease_prompts("slow", 1, (0, per_step, max_lag, max_staleness)).prompts
    version = consumed = 0
    for _ in range(20):
        for index, a in q.lease_prompts("fast", 100, (version, per_step, max_lag, max_staleness)).prompts:
            q.push(make_record(group_id=f"g{index}", prompt_index=index, attempt=a), "fast")
        if q.counters()["produced"] - consumed >= per_step:  # a batch of what arrived: one step
            version, consumed = version + 1, consumed + per_step
            registry.set_learner_state(r, q.keys, version=version, consumed=consumed)
    assert version == max_staleness  # the fast worker was held back: this batch needs the slow group
    assert q.lease_prompts("fast", 100, (version, per_step, max_lag, max_staleness)).allowance <= 0
    q.push(make_record(group_id="slow", prompt_index=slow, attempt=attempt), "slow")
    assert q.counters()["produced"] - consumed == per_step  # trained at version 3: staleness 3, not dropped
    # pushed, it holds nothing: max_lag's two steps of places again, less the batch waiting
    assert q.lease_prompts("fast", 0, (version, per_step, max_lag, max_staleness)).allowance == per_step


def test_a_lease_given_back_reissued_or_forged_holds_nothing(r):
    """A lease's version leaves ``prompts:lease_versions`` with the lease, however it ends; one
    no worker holds (written by hand) is forgotten while the learner waits, not held for good."""
    q = TrajectoryQueue(r, free_run_id("holds"))
    bp = (2, 4, 1, 2)  # the worker's version 2, 4 groups a step, max_lag 1, max_staleness 2
    registry.set_learner_state(r, q.keys, version=0, consumed=0)
    (first, _), _ = q.lease_prompts("slow", 2, (0, 4, 1, 2)).prompts
    registry.set_learner_state(r, q.keys, version=2, consumed=0)  # two versions later
    assert q.lease_prompts("fast", 0, bp).allowance == 4 - 2  # the last batch before they are too stale
    q.give_back("slow", [first])
    assert q.lease_prompts("fast", 0, bp).allowance == 4 - 1
    q.reissue_all("slow")  # the slow worker restarted
    assert q.lease_prompts("fast", 0, bp).allowance == 8 and r.zcard(q.keys.lease_versions) == 0
    (index, _), = q.lease_prompts("fast", 1, bp).prompts
    q.skip("fast", index)
    r.zadd(q.keys.lease_versions, {"999": 0})  # no worker holds prompt 999
    assert q.lease_prompts("fast", 0, bp).allowance == 4
    registry.heartbeat_worker(r, q.keys, "fast", 10.0)  # alive: its leases stay
    (held, _), = q.lease_prompts("fast", 1, bp).prompts
    q.reclaim_dead()
    assert r.zrange(q.keys.lease_versions, 0, -1) == [str(held).encode()]
    assert q.lease_prompts("fast", 0, bp).allowance == 8 - 1


def _race_for_places(url: str, run_id: str, worker: str, out) -> None:
    q = TrajectoryQueue(connect(url), run_id)
    got = []
    for _ in range(50):
        got += q.lease_prompts(worker, 3, (0, 25, 0)).prompts
    out.put(len(got))


def test_workers_racing_for_the_last_places_never_overshoot(redis_server):
    """The race the registry-based allowance had: several workers see the same free places
    and all fill them. With the allowance in the hand-out script, the places are taken once."""
    import multiprocessing as mp

    run_id = free_run_id("race")
    registry.set_learner_state(connect(redis_server.url), Keys(run_id), version=0, consumed=0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_race_for_places, args=(redis_server.url, run_id, f"w{i}", out)) for i in range(4)]
    for p in procs:
        p.start()
    taken = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert sum(taken) == 25 and TrajectoryQueue(connect(redis_server.url), run_id).counters()["leased"] == 25


def test_unconsumed_is_independent_of_the_learner_version(r):
    """The restart bug: a restored learner's version runs ahead of its steps, its consumed
    count does not. Dropped, dead and duplicate groups free their places."""
    q = TrajectoryQueue(r, free_run_id("unconsumed"))
    ids = [q.push(make_record(group_id=f"g{i}")) for i in range(10)]
    q.ensure_consumer_group()
    got = q.read("learner-0", 10)
    q.ack(ids[:4], got[4:6], ids[6:7])
    registry.set_learner_state(r, q.keys, version=7, consumed=4)
    assert q.lease_prompts("w0", 0).unconsumed == 10 - 2 - 1 - 4
    # a learner restored from an earlier checkpoint consumed fewer: those groups count again
    registry.set_learner_state(r, q.keys, version=7, consumed=2)
    assert q.lease_prompts("w0", 0).unconsumed == 10 - 2 - 1 - 2


def test_a_leased_push_clears_the_lease_and_a_zombie_push_is_refused(r, redis_server):
    run_id = free_run_id("lease")
    q = TrajectoryQueue(r, run_id)
    i0, a0 = q.next_prompt_index("w0")
    i1, _ = q.next_prompt_index("w0")
    assert q.push(make_record(group_id="a", prompt_index=i0, attempt=a0), "w0") is not None
    assert q.leased("w0") == {i1}
    # w0's heartbeat is gone (it never registered here): its lease is re-issued, once
    assert q.reclaim_dead() == 1 and q.leased("w0") == set()
    assert q.next_prompt_index("w1") == (i1, 1)  # the second hand-out of i1
    assert q.push(make_record(group_id="zombie", prompt_index=i1), "w0") is None  # w0 came back late
    assert q.push(make_record(group_id="b", prompt_index=i1, attempt=1), "w1") is not None
    c = q.counters()
    assert (c["produced"], c["rejected_push"], c["reissued"]) == (2, 1, 1)
    # a live worker's leases are not touched
    registry.heartbeat_worker(r, q.keys, "w2", 30)
    q.next_prompt_index("w2")
    assert q.reclaim_dead() == 0 and len(q.leased("w2")) == 1
    # a give-back re-issues only what the worker still holds; a skip settles without re-issuing
    assert q.give_back("w1", [i1]) == 0
    i3, _ = q.next_prompt_index("w1")
    q.skip("w1", i3)
    assert q.counters()["skipped"] == 1 and q.leased("w1") == set()


def test_index_set_round_trips():
    s = IndexSet()
    for i in (0, 7, 8, 1000):
        s.add(i)
    s.add(-1)  # not from the cursor: ignored
    t = IndexSet(s.to_bytes())
    assert list(t) == [0, 7, 8, 1000] and len(t) == 4 and 9 not in t and 5000 not in t


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
        index, _ = q.next_prompt_index(f"w{give_back_every}")
        if give_back_every and i % give_back_every == 0:
            q.give_back(f"w{give_back_every}", [index])
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


def test_acknowledging_an_entry_redis_lost_counts_nothing(r):
    """After a Redis restart lost a push, the learner may still hold that entry: acking it
    must not count it, or the books would no longer balance."""
    q = TrajectoryQueue(r, free_run_id("lostack"))
    kept = q.push(make_record(group_id="kept"))
    q.ensure_consumer_group()
    q.read("learner-0", 10)
    q.ack([kept, "1-1"], [Entry("2-2", make_record(prompt_index=5))], ["3-3"])  # never in this stream
    assert 5 not in q.dropped_indices()
    c = q.counters()
    assert (c["produced"], c["trained"], c["dropped_stale"], c["duplicate"]) == (1, 1, 0, 0)
    assert q.length() == 0 and q.pending() == 0


def test_counters_are_re_derived_from_the_lineage_and_the_stream(r):
    """After lost writes: the learner's lineage trained 5 groups; 2 await acknowledgement,
    one of which Redis lost (its push). Trained counts the lost one now, and it is not
    counted again when acknowledged; the books balance and nothing counts twice."""
    q = TrajectoryQueue(r, free_run_id("rederive"))
    ids = [q.push(make_record(group_id=f"g{i}")) for i in range(4)]
    q.ensure_consumer_group()
    q.read("learner-0", 10)
    q.ack(ids[:2])  # as the checkpoint before did; ids[2] awaits acknowledgement, ids[3] is untrained
    r.hset(q.keys.counters, mapping={"produced": 3, "trained": 1})  # what a Redis that lost writes says
    assert q.rederive_counters(5, [ids[2], "9-9"]) == (1, 4, 3, 6)  # "9-9": the lost push
    q.ack([ids[2], "9-9"])
    c = q.counters()
    assert c["trained"] == 5 and c["produced"] == c["trained"] + q.length() and c["lost_writes"] == 6


def test_missing_names_the_entries_no_longer_in_the_stream(r):
    q = TrajectoryQueue(r, free_run_id("missing"))
    ids = [q.push(make_record(group_id=f"g{i}")) for i in range(3)]
    r.xdel(q.keys.traj, ids[1])
    assert q.missing(ids + ["9-9"]) == {ids[1], "9-9"} and q.missing([]) == set()


def test_a_drop_is_recorded_for_good_in_redis(r):
    q = TrajectoryQueue(r, free_run_id("dropbits"))
    for i in (3, 17):
        q.push(make_record(group_id=f"g{i}", prompt_index=i))
    q.ensure_consumer_group()
    q.ack([], q.read("learner-0", 10))
    assert list(q.dropped_indices()) == [3, 17] and q.counters()["dropped_stale"] == 2
    assert r.getbit(q.keys.dropped, 17) == 1  # the same bit order as Redis's own bitmaps


# -- a cursor overwritten in Redis (issue 33, item 15) -----------------------------------------
def test_a_cursor_overwritten_far_or_with_text_is_set_back_below_every_index_in_use(r, caplog):
    """``prompts:cursor`` set to 2**31 had the workers hand out indices from there, and the
    learner's bitmap of trained indices grow to 2 GB; set to text, INCR failed every lease.
    Either way the cursor goes back to what the books say was handed out at most."""
    q = TrajectoryQueue(r, free_run_id("cursor"))
    first = [q.next_prompt_index("w0")[0] for _ in range(5)]
    q.push(make_record(group_id="g0", prompt_index=first[0]), worker_id="w0")
    for forged in (2**31, "abc", "-3", "007"):
        r.set(q.keys.cursor, forged)
        index = q.next_prompt_index("w1")[0]
        assert index not in first and index < MAX_PROMPT_INDEX, (forged, index)
        assert int(r.get(q.keys.cursor)) == index + 1
        assert f"prompts:cursor was {str(forged).encode()!r}" in caplog.text
    r.set(q.keys.cursor, MAX_PROMPT_INDEX - 1)  # the last index of the run's range is still handed out
    assert q.next_prompt_index("w1")[0] == MAX_PROMPT_INDEX - 1


def test_a_cursor_set_back_hands_out_no_skipped_prompt_again(r):
    """Prompts settled without a push (skipped: too long, failed twice) count as handed out: a
    forged cursor set back from the books once handed each of them out again (7,865 duplicates
    in one attack run), and every later lease after it stays new."""
    q = TrajectoryQueue(r, free_run_id("cursor"))
    handed = [q.next_prompt_index("w0")[0] for _ in range(6)]
    for index in handed[:4]:
        q.skip("w0", index)
    q.push(make_record(group_id="g0", prompt_index=handed[4]), worker_id="w0")
    r.set(q.keys.cursor, "forged")
    again = [q.next_prompt_index("w1")[0] for _ in range(20)]
    assert not set(again) & set(handed), again
    assert len(set(again)) == 20


def test_a_prompt_index_past_the_limit_is_refused_before_it_sizes_the_index_sets(r):
    """With the cursor at 2**31 the reader admitted indices up to twice that, and each trained
    one grew the learner's dense bitmap (rlpipe/index_set.py IndexSet) to its index in bits, and
    every checkpoint with it. Past MAX_PROMPT_INDEX a group is dead-lettered instead."""
    run_id = free_run_id("far")
    check = RunCheck(run_id=run_id, vocab_size=32, n=2, max_tokens=8, max_model_len=64, precisions=("fp8",),
                     sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8}, version=10)
    q = TrajectoryQueue(r, run_id, check=check)
    q.ensure_consumer_group()
    r.set(q.keys.cursor, 2**31)
    q.push(make_record(run_id=run_id, group_id="far", prompt_index=2**31))
    q.push(make_record(run_id=run_id, group_id="near", prompt_index=MAX_PROMPT_INDEX - 1))
    got = q.read("learner-0", count=10, block_ms=100)
    assert [e.record.group_id for e in got] == ["near"]
    (_, dead), = r.xrange(q.keys.dead)
    assert b"beyond the run's limit" in dead[b"reason"] and q.counters()["dead"] == 1
    trained = IndexSet()
    for e in got:
        trained.add(e.record.prompt_index)
    assert len(trained.to_bytes()) == MAX_PROMPT_INDEX // 8  # 8 MB at most, what a checkpoint holds
