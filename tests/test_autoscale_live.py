"""``rlpipe up --autoscale`` with its roles as separate processes (the rule itself on rows is
tests/test_autoscale.py): the fleet grows while the learner starves and shrinks while the
workers idle, and no scale event loses, repeats or drops a group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from launch.cluster import audit
from launch.up import STATE_FILE
from learner.metrics import read_jsonl
from rlpipe.config import build_config, dump_config
from rlpipe.faults import GROUP_DELAY_ENV, STEP_DELAY_ENV
from rlpipe.redis_link import connect
from tests.conftest import ROOT, free_run_id, wait_for

pytestmark = pytest.mark.slow


# soak: a live fleet run of minutes; tests/test_autoscale.py holds the policy's rules in the suite
@pytest.mark.soak
def test_the_fleet_grows_while_the_learner_starves_and_shrinks_while_rollout_idles(tmp_path, toy_model_path,
                                                                                    redis_server):
    run_id = free_run_id("autoscale")
    base = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg = build_config(base, environ={}, run_id=run_id, steps=100000, workers=1, **{
        # one group at a time per worker, each 0.3 s longer (a slow verifier), against a learner step
        # 0.5 s longer: one worker starves the learner, two nearly keep up
        "model.path": toy_model_path, "learner.groups_per_step": 8, "rollout.max_inflight_groups": 1,
        "learner.checkpoint_every": 5, "queue.max_lag": 1, "rollout.shutdown_deadline_s": 5.0,
        "autoscale.enabled": True, "autoscale.min_workers": 1, "autoscale.max_workers": 2,
        "autoscale.window_s": 8.0, "autoscale.cooldown_s": 5.0, "autoscale.converge_timeout_s": 120.0,
        "learner.dynamic_sampling": False})  # the exact bound staleness <= max_lag is pinned: see test_ops_live
    cfg_path = tmp_path / "run.yaml"
    dump_config(cfg, cfg_path)
    group_delay, step_delay = tmp_path / "group-delay", tmp_path / "step-delay"  # rlpipe/faults.py
    group_delay.write_text("0.3")
    step_delay.write_text("0.5")
    env = {**os.environ, "REDIS_URL": redis_server.url, GROUP_DELAY_ENV: str(group_delay),
           STEP_DELAY_ENV: str(step_delay)}
    run_dir = tmp_path / "runs" / run_id
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "launch.cli", "up", "--config", str(cfg_path),
                               "--runs-dir", str(tmp_path / "runs")], stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=ROOT, start_new_session=True)

    def rows():
        return read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []

    def roles():
        return json.loads((run_dir / STATE_FILE).read_text())["roles"] if (run_dir / STATE_FILE).exists() else {}

    def windows(workers: int):
        return [r for r in rows() if "fleet_wait_fraction" in r and r["rollout_workers"] == workers]

    try:
        wait_for(lambda: roles().get("w1", {}).get("state") == "running", 600, interval=1, what="w1 started")
        wait_for(lambda: len(windows(2)) >= 3, 300, interval=1, what="windows measured with two workers")
        starved, fed = windows(1), windows(2)
        # Rollout turns cheap and the learner slow (a straggler node): the workers idle under back-pressure.
        group_delay.write_text("0")
        step_delay.write_text("1.5")
        wait_for(lambda: roles()["w1"]["state"] == "stopped", 300, interval=1, what="w1 scaled away")
        step = rows()[-1]["step"]
        wait_for(lambda: rows()[-1]["step"] >= step + 3, 120, interval=1, what="3 steps with one worker")
        os.killpg(up.pid, signal.SIGTERM)
        assert up.wait(180) in (0, 130)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    log = (tmp_path / "up.log").read_text()
    print(log[-4000:])
    grew = [x for x in log.splitlines() if "autoscale: 2 workers" in x]
    shrank = [x for x in log.splitlines() if "autoscale: 1 workers" in x]
    assert grew and shrank and log.index(grew[0]) < log.index(shrank[0]), log[-3000:]
    # Feeding the learner from two workers cut its wait (the same run, one size beside the other).
    # (the window that decided to grow, against the last ones at two workers, after w1's engine start)
    starved_wait, fed_wait = starved[0]["fleet_wait_fraction"], sum(r["fleet_wait_fraction"] for r in fed[-3:]) / 3
    print(f"learner wait: {starved_wait:.0%} of its time with one worker, {fed_wait:.0%} with two")
    assert starved_wait > cfg.autoscale.scale_up_wait_fraction and fed_wait < starved_wait - 0.1
    books = audit(connect(redis_server.url), build_config(base, environ={}, run_id=run_id, run_dir=str(run_dir)),
                  ["w0", "w1"])
    assert books["lost"] == 0 and books["trained_twice"] == 0, books
    all_rows = rows()
    assert sum(r["dropped_stale_step"] for r in all_rows) == 0
    assert max(r["staleness_max"] for r in all_rows) <= cfg.queue.max_lag, [r["staleness_max"] for r in all_rows]
