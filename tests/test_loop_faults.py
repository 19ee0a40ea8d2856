"""The rollout loop under a bad reward or a failing push (issue 33 item 12), without an engine:
the real loop (rollout_service/loop.py) on a real Redis and a real prompt cursor, with an
engine that answers at once and a Python reward (``task.reward``) that misbehaves on some
rows. The steady state after each fault is what is checked: groups keep coming, no lease is
kept, and the probes say when the loop cannot go on."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from types import SimpleNamespace

import numpy as np

from rlpipe.config import build_config
from rlpipe.queue import TrajectoryQueue
from rlpipe.redis_link import connect
from rlpipe.registry import set_learner_state
from rollout_service.engine import SampleResult
from rollout_service.loop import RolloutLoop
from rollout_service.metrics import RolloutMetrics
from rollout_service.tasks import make_task
from rollout_service.worker import Worker
from tests.conftest import free_run_id

RELEASE = threading.Event()  # the hung reward calls end when it is set (the copy of this module the task imported)
CALLS = itertools.count()
DOWN = threading.Event()  # while set, every call raises (a verifier that is down; the task's copy of this module)


def faulty(prompt, response, answer, row):
    """``task.reward`` of these tests: each row's ``fault`` says how it misbehaves."""
    fault = row["fault"]
    if fault == "int_key":
        return 1.0, {3: "three"}
    if fault == "huge":
        return 1e39
    if fault == "chatty":
        return 1.0, {f"k{i}": i for i in range(200_000)}
    if fault == "hangs" and next(CALLS) % 8 == 7:  # one call in eight, as in the attack round
        RELEASE.wait()
    if fault == "raises":
        raise ValueError(f"cannot score row {row['id']}")
    if DOWN.is_set():
        raise ConnectionError("the reward's backend is down")
    return 1.0, {"fault": fault}


class FakeEngine:
    """Answers every prompt at once with the same short responses (a real engine is minutes)."""

    errored, synced, version, weights_source, quant_profile = False, True, 0, "learner", ""
    profile = SimpleNamespace(precision="fp32", checkpoint=None)

    async def generate(self, prompt_ids, n, **kw):
        await asyncio.sleep(0.005)
        return [SampleResult(np.asarray([5, 6], np.int32), np.asarray([-0.5, -0.5], np.float32), "stop", None)
                for _ in range(n)], 0, 0


class FakeTokenizer:
    def __call__(self, text):
        return {"input_ids": [1, 2, 3]}

    def decode(self, ids, skip_special_tokens=True):
        return "56"


def make_loop(redis_server, tmp_path, faults: list[str], **settings):
    rows = [{"id": f"p{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i), "fault": f} for i, f in enumerate(faults)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = build_config({}, environ={}, run_id=free_run_id("faults"), run_dir=str(tmp_path), redis_url=redis_server.url,
                       **{"task.type": "math", "task.dataset": str(tmp_path / "d.jsonl"), "task.shuffle": False,
                          "task.reward": "tests.test_loop_faults:faulty", "task.reward_timeout_s": 10,
                          "rollout.precision": "fp32", "learner.groups_per_step": 100_000, "queue.max_lag": 0,
                          "rollout.max_inflight_groups": 4, "sampling.n": 2, "sampling.max_tokens": 4, **settings})
    queue = TrajectoryQueue(connect(redis_server.url), cfg.run_id)
    set_learner_state(queue.r, queue.keys, version=0, step=0, status="running")
    return RolloutLoop(cfg, "w0", "", FakeEngine(), queue, make_task(cfg.task), FakeTokenizer(),
                       RolloutMetrics("w0", "fp32"), on_fatal=lambda reason: None)


async def run_for(loop: RolloutLoop, seconds: float, until=lambda: False) -> None:
    """The loop's dispatcher for ``seconds`` (or until ``until()``), then its graceful stop."""
    loop.dispatcher = asyncio.create_task(loop._dispatch())
    loop.tasks = [loop.dispatcher]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        await asyncio.sleep(0.05)
    await loop.stop(deadline_s=5)


def pushed(loop: RolloutLoop) -> list:
    return [e.record for e in loop.queue._decode(loop.r.xrange(loop.keys.traj))]


def test_a_bad_reward_result_gives_its_lease_back_and_the_loop_goes_on(redis_server, tmp_path):
    """Rows whose reward returns an int key, a reward of 1e39 or 200k info entries, among good
    ones: the int key and 1e39 are refused and their prompts skipped after failing twice (no
    lease kept: 32 leaked ones once held the whole allowance); the chatty info is dropped with
    its reason; the good rows keep coming, epoch after epoch."""
    faults = ["ok", "int_key", "ok", "huge", "ok", "chatty", "ok", "ok"]
    loop = make_loop(redis_server, tmp_path, faults)
    asyncio.run(run_for(loop, 30, until=lambda: loop.r.xlen(loop.keys.traj) >= 40))
    records = pushed(loop)
    assert len(records) >= 40, loop.last_error
    kinds = {faults[rec.prompt_index % len(faults)] for rec in records}
    assert kinds == {"ok", "chatty"}, kinds
    for rec in records:
        for s in rec.samples:
            assert np.float32(s.reward) == 1.0
            if faults[rec.prompt_index % len(faults)] == "chatty":
                assert s.reward_info == {"reward_info_dropped": "reward_info has 200000 entries (at most 64)"}
    assert loop.queue.leased("w0") == set()  # none kept after the stop, and the allowance counts none in flight
    counters = {k.decode(): int(v) for k, v in loop.r.hgetall(loop.keys.counters).items()}
    assert counters["leased"] == 0 and counters["skipped"] >= 2  # each bad prompt at its second failure here
    assert "not a finite number within" in (loop.last_error or "") or "reward_info key 3" in (loop.last_error or "")


def test_a_push_that_fails_gives_its_lease_back_and_the_loop_goes_on(redis_server, tmp_path):
    """Any failure to push, even one that never reached Redis (the record refused by msgpack
    or the schema), gives the prompt back; the prompt is generated again and pushed."""
    loop = make_loop(redis_server, tmp_path, ["ok"] * 8)
    push, failed = loop.queue.push, []

    def flaky_push(record, worker_id):
        if len(failed) < 3:
            failed.append(record.prompt_index)
            raise TypeError("can not serialize 'Oops' object")
        return push(record, worker_id)

    loop.queue.push = flaky_push
    asyncio.run(run_for(loop, 30, until=lambda: loop.r.xlen(loop.keys.traj) >= 20))
    done = {rec.prompt_index for rec in pushed(loop)}
    assert len(failed) == 3 and set(failed) <= done  # given back, then generated again and pushed
    assert loop.queue.leased("w0") == set()
    assert "can not serialize" in loop.last_error


def test_hung_reward_calls_are_abandoned_and_the_loop_goes_on_then_says_it_is_stuck(redis_server, tmp_path):
    """A reward that hangs on one call in eight: its hung calls are abandoned after
    task.reward_timeout_s and groups keep coming (a pool of two stuck for good after two);
    once MAX_ABANDONED hung calls still run, calls are refused and /healthz says why, until
    they end."""
    from rollout_service.tasks import MAX_ABANDONED

    faults = ["hangs"] * 4
    loop = make_loop(redis_server, tmp_path, faults, **{"task.reward_timeout_s": 0.2})
    release = loop.task.reward.fn.__globals__["RELEASE"]
    release.clear()
    try:
        asyncio.run(run_for(loop, 60, until=lambda: loop.watch.calls_stuck() is not None))
        records = pushed(loop)
        assert len(records) >= 2 * MAX_ABANDONED  # most groups came while the hung calls piled up
        why = loop.watch.stuck()
        assert f"{MAX_ABANDONED} calls still running past task.reward_timeout_s" in why
        worker = SimpleNamespace(engine=loop.engine, id="w0", loop=loop, draining=False, started=True)
        worker.calls_stuck, worker.ready = (lambda: Worker.calls_stuck(worker)), (lambda: Worker.ready(worker))
        loop.engine.synced = True
        assert Worker.health(worker) == {"status": f"rollout loop stuck: {why}", "worker_id": "w0"}
        assert Worker.readiness(worker)["ready"] is False and Worker.readiness(worker)["calls_stuck"] == why
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while loop.watch.calls_stuck() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.watch.stuck() is None and Worker.health(worker)["status"] == "ok"
    assert Worker.readiness(worker)["ready"] is True  # ready again once the hung calls ended
    assert loop.queue.leased("w0") == set()


def test_a_loop_generating_without_pushing_past_its_limit_is_stuck(redis_server, tmp_path, monkeypatch):
    """No group pushed while groups are in flight, for longer than the stall limit: /healthz
    says so. Time without groups in flight (back-pressure, waiting for weights) is not counted."""
    import rollout_service.loop as loop_module

    loop = make_loop(redis_server, tmp_path, ["ok"])
    monkeypatch.setattr(loop_module, "STALL_FLOOR_S", 0.0)
    limit = loop.watch.stall_limit_s()  # max_tokens / MIN_TOKENS_PER_S: 0.4 s
    assert loop.watch.stuck() is None
    now = time.time()
    assert loop.watch.stuck(now + 100) is None  # idle all along: not stuck
    loop._enter(object(), SimpleNamespace())  # a group in flight from now
    assert loop.watch.stuck(now + limit / 2) is None
    assert "no group pushed or settled in" in loop.watch.stuck(now + limit + 1)
    loop.watch.progressed()
    assert loop.watch.stuck(time.time() + limit / 2) is None


def dead_letters(loop: RolloutLoop) -> list[dict]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in loop.r.xrange(loop.keys.dead)]


def test_a_reward_that_always_fails_on_one_prompt_dead_letters_it_once_and_the_others_train(redis_server, tmp_path):
    """A reward that raises on one row, every time (the attack round's follow-up to item 12: it
    was given back and handed out again for ever, each failure pausing the worker 2 s): after
    queue.max_deliveries failures the prompt is settled as dead, once, with a dead letter naming
    the reward's error, counted in the books (produced and dead, its index in prompts:dropped),
    and the other prompts keep training, epoch after epoch (row 3 is a new prompt index in each)."""
    faults = ["ok", "ok", "ok", "raises", "ok", "ok", "ok", "ok"]
    loop = make_loop(redis_server, tmp_path, faults)
    limit = loop.cfg.queue.max_deliveries
    asyncio.run(run_for(loop, 45, until=lambda: loop.r.xlen(loop.keys.dead) >= 2 and loop.r.xlen(loop.keys.traj) >= 21))
    records, dead = pushed(loop), dead_letters(loop)
    assert len(dead) >= 2, (dead, loop.last_error, len(records))  # rows 3 and 11: epochs 0 and 1
    bad = [int(d["prompt_index"]) for d in dead]
    assert len(set(bad)) == len(bad) and all(i % len(faults) == 3 for i in bad), dead  # each once
    for d in dead:
        assert d["prompt_id"] == "p3" and d["failures"] == str(limit), d
        assert d["reason"] == ("task.reward tests.test_loop_faults:faulty raised ValueError: cannot score row p3 "
                               f"({limit} failures, queue.max_deliveries)"), d
    # the others trained: every good index below the last bad one was pushed, none of row 3's
    done = {rec.prompt_index for rec in records}
    assert {i for i in range(max(bad)) if i % len(faults) != 3} <= done and not done & set(bad), (done, bad)
    c = loop.queue.counters()
    assert c["dead"] == c["dead_prompts"] == len(dead) and c["produced"] == c["dead"] + len(records), c
    assert c["leased"] == 0 and loop.queue.leased("w0") == set()
    assert all(i in loop.queue.dropped_indices() for i in bad)  # settled: a late group would be a duplicate
    attempts = {int(k): int(v) for k, v in loop.r.hgetall(loop.keys.attempts).items()}
    assert all(attempts.get(i, 0) <= limit for i in bad), attempts  # handed out at most limit + 1 times
    assert not {i for i in loop.r.lrange(loop.keys.returned, 0, -1) if int(i) in bad}  # never handed out again


def test_a_reward_that_fails_on_every_prompt_is_an_outage_and_dead_letters_none(redis_server, tmp_path):
    """A reward whose backend is down fails on every prompt: that says nothing about the
    prompts, so none is dead-lettered; they go back and are trained once it is up again. (A
    failure counts against its prompt only once the reward has worked since the last one
    that counted: an outage counts once at most.)"""
    loop = make_loop(redis_server, tmp_path, ["ok"] * 8)
    down = loop.task.reward.fn.__globals__["DOWN"]
    down.set()

    async def outage_then_up():
        loop.dispatcher = asyncio.create_task(loop._dispatch())
        loop.tasks = [loop.dispatcher]
        await asyncio.sleep(8)  # several rounds of failures, each given back
        down.clear()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and loop.r.xlen(loop.keys.traj) < 16:
            await asyncio.sleep(0.05)
        await loop.stop(deadline_s=5)

    try:
        asyncio.run(outage_then_up())
    finally:
        down.clear()
    assert loop.metrics.reward_errors._value.get() >= 8  # it was down for several rounds
    assert dead_letters(loop) == [] and len(pushed(loop)) >= 16
    assert {rec.prompt_index for rec in pushed(loop)} >= set(range(8))  # the prompts that failed were trained
    assert loop.queue.leased("w0") == set()
