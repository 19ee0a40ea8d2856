"""Records that kill the learner, and a learner that lost its lease: real learner processes
on a real Redis, restarted as a supervisor would restart them (no workers: the stream is
filled up front, as in tests/test_resume.py).

- A group that SIGKILLs the learner whenever it is forwarded (``RLPIPE_CRASH_ON_PROMPT``,
  standing for any record that crashes the process) ends in the dead letters after
  ``queue.max_deliveries`` restarts, as "poison"; every other group of the batches it
  crashed is trained exactly once, and the run finishes.
- A learner paused (SIGSTOP) past its lease while a second one takes over, then resumed
  (SIGCONT), is refused by Redis at its first write and exits 3; the second one finishes the
  run with every group trained exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from learner import checkpoint
from learner.policy import load_policy
from rlpipe import registry
from rlpipe.config import build_config, dump_config
from rlpipe.queue import TrajectoryQueue
from rlpipe.redis_link import connect
from tests.conftest import free_run_id, wait_for
from tests.test_learner import for_run, synthetic_groups

pytestmark = pytest.mark.slow

STEPS, GROUPS_PER_STEP = 4, 3


@pytest.fixture
def run(redis_server, toy_model_path, tmp_path):
    cfg = build_config({}, environ={}, run_id=free_run_id("poison"), run_dir=str(tmp_path),
                       redis_url=redis_server.url, steps=STEPS, workers=1, **{
                           "model.path": toy_model_path, "learner.groups_per_step": GROUPS_PER_STEP,
                           "learner.checkpoint_every": 2, "learner.ppo_epochs": 1, "learner.threads": 1,
                           "learner.lease_ttl_s": 2.0, "queue.max_staleness": 1000, "sync.join_timeout_s": 0.1,
                           "sampling.n": 4, "learner.schedule.warmup_steps": 0})
    dump_config(cfg, tmp_path / "config.yaml")
    queue = TrajectoryQueue(connect(cfg.redis_url), cfg.run_id)
    groups = for_run(synthetic_groups(load_policy(toy_model_path), STEPS * GROUPS_PER_STEP + 1, seed=13), cfg)

    def start(env: dict | None = None) -> subprocess.Popen:
        log = open(tmp_path / "learner.log", "a")
        return subprocess.Popen([sys.executable, "-m", "launch.cli", "learner", "--config",
                                 str(tmp_path / "config.yaml")], env={**os.environ, **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT)

    return cfg, queue, groups, start


def lineage(cfg) -> dict:
    meta = checkpoint.read_meta(checkpoint.latest(f"{cfg.run_dir}/checkpoints"))
    return {"step": meta["step"], "trained_groups": meta["trained_groups"], "digest": int(meta["trained_digest"])}


def test_a_record_that_kills_the_learner_ends_in_the_dead_letters_after_max_deliveries(run):
    cfg, queue, groups, start = run
    groups[1].prompt_id = "poison"  # in the first batch, beside two innocent groups
    for rec in groups:
        queue.push(rec)
    crashes = 0
    while True:
        proc = start({"RLPIPE_CRASH_ON_PROMPT": "poison"})
        code = proc.wait(timeout=180)
        if code == 0:
            break
        assert code == -signal.SIGKILL and crashes < 10, f"exit {code} after {crashes} crashes"
        crashes += 1
    assert crashes == cfg.queue.max_deliveries
    (_, dead), = queue.r.xrange(queue.keys.dead)
    assert dead[b"reason"].decode() == f"poison: delivered {cfg.queue.max_deliveries} times without an acknowledgement"
    innocent = [g.group_id for g in groups if g.prompt_id != "poison"]
    assert lineage(cfg) == {"step": STEPS, "trained_groups": len(innocent), "digest": checkpoint.group_digest(innocent)}
    c = queue.counters()
    assert (c["trained"], c["dead"]) == (len(innocent), 1)
    assert c["produced"] == c["trained"] + c["dropped_stale"] + c["dead"] + queue.length()


def test_a_paused_learner_that_lost_its_lease_is_fenced_off(run):
    cfg, queue, groups, start = run
    for rec in groups[: STEPS * GROUPS_PER_STEP]:
        queue.push(rec)
    r = connect(cfg.redis_url)
    zombie = start()
    wait_for(lambda: int(registry.learner_state(r, queue.keys).get("step", 0)) >= 1, timeout=120,
             what="the first learner's first step")
    zombie.send_signal(signal.SIGSTOP)
    try:
        successor = start()  # waits out the paused one's lease (its process is alive), then takes over
        assert successor.wait(timeout=180) == 0
    finally:
        zombie.send_signal(signal.SIGCONT)
    assert zombie.wait(timeout=60) == 3
    # Redis refuses its first write, or its lease renewal finds the lease taken: either way it stops
    log = open(f"{cfg.run_dir}/learner.log").read()
    assert "refused a write of this learner" in log or "lost the learner lease" in log
    ids = [g.group_id for g in groups[: STEPS * GROUPS_PER_STEP]]
    assert lineage(cfg) == {"step": STEPS, "trained_groups": len(ids), "digest": checkpoint.group_digest(ids)}
    c = queue.counters()
    assert c["trained"] == len(ids) and queue.length() == 0 and queue.pending() == 0
    assert int(registry.learner_state(r, queue.keys)["step"]) == STEPS  # the zombie published nothing after
