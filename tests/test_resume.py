"""Exactly-once training across learner crashes: real learner processes, SIGKILLed.

The stream is filled with groups up front (no workers: the learner's weight sync has no
one to wait for), then the learner is killed at each point of a step where a crash could
lose or duplicate a group, restarted every time, and finally run to the end. The final
checkpoint's lineage must hold every group exactly once: its count and its
order-independent digest of group ids match the produced set.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

from learner import checkpoint
from learner.policy import load_policy
from learner.train import Learner
from rlpipe import registry
from rlpipe.config import build_config, dump_config
from rlpipe.queue import TrajectoryQueue
from rlpipe.redis_link import connect
from tests.conftest import free_run_id, wait_for
from tests.test_learner import for_run, params_vector, synthetic_groups

STEPS, GROUPS_PER_STEP = 8, 3


@pytest.fixture
def run(redis_server, toy_model_path, tmp_path):
    """A config, a stream holding exactly the run's groups, and a way to start the learner."""
    cfg = build_config({}, environ={}, run_id=free_run_id("resume"), run_dir=str(tmp_path), redis_url=redis_server.url,
                       steps=STEPS, workers=1, **{
                           "model.path": toy_model_path, "learner.groups_per_step": GROUPS_PER_STEP,
                           "learner.checkpoint_every": 2, "learner.ppo_epochs": 1, "learner.lr": 1e-4,
                           "learner.threads": 1, "learner.lease_ttl_s": 1.0, "queue.max_staleness": 1000, "sync.join_timeout_s": 0.1,
                           "sampling.n": 4,
                           "learner.schedule.warmup_steps": 0})
    dump_config(cfg, tmp_path / "config.yaml")
    queue = TrajectoryQueue(connect(cfg.redis_url), cfg.run_id)
    groups = for_run(synthetic_groups(load_policy(toy_model_path), STEPS * GROUPS_PER_STEP, seed=11), cfg)
    for rec in groups:
        queue.push(rec)

    def start(crash_at: str = "") -> subprocess.Popen:
        env = {**os.environ, "RLPIPE_CRASH_AT": crash_at}
        log = open(tmp_path / "learner.log", "a")
        log.write(f"\n=== start (crash at {crash_at or 'nothing'}) ===\n")
        log.flush()
        return subprocess.Popen([sys.executable, "-m", "launch.cli", "learner", "--config",
                                 str(tmp_path / "config.yaml")], env=env, stdout=log, stderr=subprocess.STDOUT)

    def no_loss():
        c = queue.counters()
        assert c["produced"] == c["trained"] + c["dropped_stale"] + queue.length(), c

    return cfg, queue, [g.group_id for g in groups], start, no_loss


def final_lineage(cfg) -> dict:
    meta = checkpoint.read_meta(checkpoint.latest(f"{cfg.run_dir}/checkpoints"))
    return {"step": meta["step"], "trained_groups": meta["trained_groups"], "digest": int(meta["trained_digest"])}


def check_exactly_once(cfg, queue, ids) -> None:
    assert final_lineage(cfg) == {"step": STEPS, "trained_groups": len(ids), "digest": checkpoint.group_digest(ids)}
    c = queue.counters()
    assert c["trained"] == len(ids) and c["dropped_stale"] == 0
    assert queue.length() == 0 and queue.pending() == 0


# Every place a crash can fall: after reading a batch, after the optimizer step, after the
# weight sync, with a checkpoint written but not yet renamed into place, and with the
# checkpoint in place but its entries not yet acknowledged (steps 2, 4, 6, 8 checkpoint).
CRASHES = ["collected:1", "trained:2", "checkpoint_written:2", "checkpointed:2", "synced:3", "collected:3",
           "checkpointed:4", "trained:5", "checkpoint_written:6", "checkpointed:8"]


def test_sigkill_at_every_point_of_a_step_trains_each_group_exactly_once(run):
    cfg, queue, ids, start, no_loss = run
    for crash_at in CRASHES:
        proc = start(crash_at)
        assert proc.wait(timeout=180) == -signal.SIGKILL, f"the learner did not crash at {crash_at}"
        no_loss()
    assert start().wait(timeout=180) == 0
    check_exactly_once(cfg, queue, ids)
    # a checkpoint is a loadable model directory, and old ones are pruned
    assert len(checkpoint.complete(f"{cfg.run_dir}/checkpoints")) == cfg.learner.checkpoint_keep
    load_policy(str(checkpoint.latest(f"{cfg.run_dir}/checkpoints")))


@pytest.mark.slow
@pytest.mark.soak
def test_sigkill_at_random_moments_trains_each_group_exactly_once(run):
    cfg, queue, ids, start, no_loss = run
    r, rng = connect(cfg.redis_url), random.Random(7)
    for _ in range(5):
        proc = start()
        seen = int(registry.learner_state(r, queue.keys).get("step", 0))
        if seen >= STEPS - 1:
            break  # the learner just started finishes the run
        # wait for the next step to finish, then kill somewhere inside the one after it
        wait_for(lambda: int(registry.learner_state(r, queue.keys).get("step", 0)) > seen or proc.poll() is not None,
                 timeout=120, what="a learner step")
        try:
            proc.wait(timeout=rng.uniform(0.0, 0.6))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        no_loss()
    else:
        proc = start()
    assert proc.wait(timeout=180) == 0
    check_exactly_once(cfg, queue, ids)


# two FSDP ranks is a soak case (minutes on CI; test_fsdp's sharded checkpoints cover the write)
@pytest.mark.parametrize(("async_checkpoint", "ranks"), [(True, 1), (False, 1),
                                                         pytest.param(True, 2, marks=pytest.mark.soak)],
                         ids=["background-write", "blocking-write", "fsdp-sharded-write"])
def test_a_learner_killed_while_its_checkpoint_is_written_resumes_from_the_previous_one(run, async_checkpoint, ranks):
    """Killed with checkpoint 4 written but not yet in place (with async checkpoints, while
    the background write runs and the steps go on): the restart resumes from checkpoint 2,
    acknowledges nothing early, and the lineage ends with every group exactly once. With 2
    FSDP ranks each writes its optimizer shard (learner.checkpoint_format auto: sharded) and
    rank 0, killed after they are durable, never renames the directory into place."""
    cfg, queue, ids, start, no_loss = run
    cfg.learner.async_checkpoint = async_checkpoint
    cfg.learner.ranks = ranks
    dump_config(cfg, Path(cfg.run_dir) / "config.yaml")
    killed = start("checkpoint_written:4").wait(timeout=180)
    assert killed == -signal.SIGKILL if ranks == 1 else killed != 0  # torchrun ends the job
    if ranks > 1:
        assert (Path(cfg.run_dir) / "checkpoints/step_00000002" / checkpoint.SHARDS / ".metadata").is_file()
    no_loss()
    assert queue.counters()["trained"] == 2 * GROUPS_PER_STEP  # only what checkpoint 2 covers
    assert [p.name for p in checkpoint.complete(f"{cfg.run_dir}/checkpoints")] == ["step_00000002"]
    assert start().wait(timeout=180) == 0
    assert "resumed from step_00000002" in (Path(cfg.run_dir) / "learner.log").read_text()
    check_exactly_once(cfg, queue, ids)


def test_a_second_learner_waits_for_the_first_to_let_go(run):
    """Two learners on one stream would train groups twice: the second waits for the lease."""
    cfg, queue, ids, start, no_loss = run
    r = connect(cfg.redis_url)
    for e in queue.r.xrange(queue.keys.traj)[2 * GROUPS_PER_STEP:]:  # 2 steps' worth, then the first waits
        queue.ack([], queue._decode([e]))
    first = start()
    wait_for(lambda: registry.learner_state(r, queue.keys).get("step") == "2", timeout=120, what="two steps")
    second = start()
    log = Path(cfg.run_dir) / "learner.log"
    wait_for(lambda: "another learner holds the lease" in log.read_text(), timeout=60, what="the second to wait")
    assert registry.learner_state(r, queue.keys)["step"] == "2"  # the waiting learner publishes nothing
    assert first.poll() is None and second.poll() is None
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0
    # the second takes over (released lease: at once), finds nothing pending and waits for data
    wait_for(lambda: registry.learner_state(r, queue.keys).get("status") == "running", timeout=60,
             what="the second learner to run")
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=60) == 0
    assert queue.counters()["trained"] == 2 * GROUPS_PER_STEP
    no_loss()


def test_a_learner_that_waited_for_the_lease_resumes_from_the_checkpoint_written_meanwhile(run, toy_model_path):
    """Issue 33, item 11. A learner restores the newest checkpoint when it starts, then waits
    for the lease while another learner trains and checkpoints. When it takes over it must go
    on from that newer checkpoint: from the one it loaded it would retrain those steps, put
    the books back (``trained`` re-derived from its lineage) and refuse fresh groups as of
    versions it never reached. Both learners run in this process, so the state taken over is
    compared with the holder's own; then the taker trains one more step from it."""
    cfg, queue, ids, _, no_loss = run
    entries = queue.r.xrange(queue.keys.traj)
    queue.ack([], queue._decode(entries[2 * GROUPS_PER_STEP:]))  # two steps' groups for the holder (the rest dropped)
    taker = Learner(cfg.model_copy(update={"steps": 3}))  # restores nothing: there is no checkpoint yet
    holder = Learner(cfg.model_copy(update={"steps": 2}))
    holding = threading.Thread(target=holder.run, daemon=True)
    taking = threading.Thread(target=taker.run, daemon=True)
    holding.start()
    try:
        wait_for(lambda: holder.status == "running", timeout=60, what="the holder to take the lease")
        taking.start()  # waits for the lease while the holder trains 2 steps, checkpoints and lets go
        holding.join(timeout=180)
        assert not holding.is_alive() and holder.status == "done" and holder.step == 2
        wait_for(lambda: taker.status == "running", timeout=60, what="the taker to take over")
        # what the holder left, not what the taker loaded at its start
        assert (taker.step, taker.version, taker.run_counters.trained_groups) == (2, holder.version, 2 * GROUPS_PER_STEP)
        assert torch.equal(params_vector(taker.model), params_vector(holder.model))
        want, got = holder.opt.state_dict()["state"], taker.opt.state_dict()["state"]
        assert want and want.keys() == got.keys()
        assert all(torch.equal(want[i]["exp_avg"], got[i]["exp_avg"]) for i in want)
        assert queue.counters()["trained"] == 2 * GROUPS_PER_STEP  # the books are not rolled back
        # after the takeover: the next step is trained from that state, on fresh groups
        fresh = for_run(synthetic_groups(load_policy(toy_model_path), GROUPS_PER_STEP, seed=12), cfg)
        for rec in fresh:
            queue.push(rec)
        taking.join(timeout=180)
        assert not taking.is_alive() and taker.status == "done"
    finally:
        if taking.is_alive():
            taker.request_stop()
            taking.join(timeout=60)
    assert (taker.step, taker.version) == (3, holder.version + 1)
    trained = ids[:2 * GROUPS_PER_STEP] + [rec.group_id for rec in fresh]
    assert final_lineage(cfg) == {"step": 3, "trained_groups": len(trained), "digest": checkpoint.group_digest(trained)}
    c = queue.counters()
    assert c["trained"] == len(trained) and c["dead"] == 0 and queue.length() == 0 and queue.pending() == 0
    no_loss()


def test_sigterm_finishes_the_step_checkpoints_and_acknowledges(run):
    """/status over HTTP while the learner waits for data; SIGTERM then saves what it trained."""
    cfg, queue, ids, start, no_loss = run
    r = connect(cfg.redis_url)
    # Leave only 2 steps' worth of groups in the stream: the learner trains them and waits.
    for e in queue.r.xrange(queue.keys.traj)[2 * GROUPS_PER_STEP:]:
        queue.ack([], queue._decode([e]))
    proc = start()
    wait_for(lambda: registry.learner_state(r, queue.keys).get("step") == "2", timeout=120, what="two steps")
    address = registry.learner_state(r, queue.keys)["address"]

    def status_when_durable():  # the step-2 checkpoint is written in the background
        status = json.load(urllib.request.urlopen(f"http://{address}/status", timeout=10))
        return status if status["checkpoint"]["last"] else None

    wait_for(status_when_durable, timeout=30, what="the step-2 checkpoint durable")
    status = status_when_durable()
    assert status["step"] == 2 and status["checkpoint"]["last"]["step"] == 2 and status["checkpoint"]["unacked_groups"] == 0
    assert status["lr_schedule"]["kind"] == "constant" and status["lr"] == pytest.approx(1e-4)
    assert status["last_metrics"]["step"] == 2 and "mismatch_log_ppl_abs_diff" in status["last_metrics"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert queue.counters()["trained"] == 2 * GROUPS_PER_STEP and queue.pending() == 0
    assert registry.learner_state(r, queue.keys)["status"] == "stopped"
    no_loss()


def test_a_checkpoint_takes_the_tokenizer_but_never_the_base_weights(toy_model_path, tmp_path):
    """A sharded base model's files must not overwrite or sit beside the trained weights."""
    import shutil

    from safetensors.torch import load_file

    base = tmp_path / "base"
    shutil.copytree(toy_model_path, base)
    (base / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    model = load_policy(str(base))
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # "trained"
    path = checkpoint.save(tmp_path / "ckpt", 1, model, {"x": 1}, {"version": 1}, base)
    names = {p.name for p in path.iterdir()}
    assert "model-00001-of-00002.safetensors" not in names and "tokenizer.json" in names
    saved = load_file(path / "model.safetensors")
    name, param = next(iter(model.named_parameters()))
    assert torch.equal(saved[name], param.detach())
    assert checkpoint.latest(tmp_path / "ckpt") == path and checkpoint.load_state(path) == {"x": 1}


def test_a_sharded_optimizer_state_round_trips_in_one_process(toy_model_path, tmp_path):
    """The sharded format's optimizer directory (DCP, learner.checkpoint_format: sharded),
    written and read by one process: the Adam moments come back exactly, keyed by name, and
    trainer_state.pt holds no optimizer. (Across ranks: tests/test_fsdp.py.)"""
    model = load_policy(toy_model_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    tmp = checkpoint.begin(tmp_path / "ckpt", 1)
    checkpoint.save_shards(tmp / checkpoint.SHARDS, checkpoint.optimizer_shards(model, opt))
    path = checkpoint.save(tmp_path / "ckpt", 1, model, {"x": 1}, {"version": 1}, tmp=tmp)
    assert checkpoint.latest(tmp_path / "ckpt") == path and not list((tmp_path / "ckpt").glob(".tmp-*"))
    assert (path / checkpoint.SHARDS / ".metadata").is_file()

    fresh = load_policy(str(path))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    checkpoint.load_optimizer(path, checkpoint.load_state(path), fresh, fresh_opt)
    want, got = checkpoint.optimizer_state(model, opt), checkpoint.optimizer_state(fresh, fresh_opt)
    assert want["state"].keys() == got["state"].keys() and want["state"]
    for name, s in want["state"].items():
        for k, v in s.items():
            assert torch.equal(v, got["state"][name][k]), (name, k)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
