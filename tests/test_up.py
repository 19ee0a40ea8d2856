"""``rlpipe up``'s supervisor through its seams, with real processes and a real Redis (the
whole command against live roles is tests/test_ops_live.py):

- a role that keeps failing at start (here a learner whose Redis is not there) is tried
  START_TRIES times, then the supervisor gives up, showing that role's log tail; one that
  exits 2 (a config it rejects) is not restarted at all;
- ``restart rollout`` stops the next worker only once the one before is ready again;
- the progress line reports the learner's step with its last metrics, the workers
  registered and the queue.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

from launch.up import START_TRIES, USAGE_ERROR, Role, Supervisor, read_desired, write_desired
from rlpipe import registry
from rlpipe.config import build_config
from rlpipe.keys import Keys
from tests.conftest import free_run_id


def supervisor(tmp_path, redis_server, lines: list[str]) -> Supervisor:
    cfg = build_config({}, environ={}, run_id=free_run_id("up"), run_dir=str(tmp_path), redis_url=redis_server.url,
                       workers=1, steps=40)
    return Supervisor(cfg, tmp_path, log=lines.append)


def run_until_failed(sup, r) -> None:
    t0 = time.monotonic()
    try:
        while not sup.failed:
            assert time.monotonic() - t0 < 120, "gave no verdict in 120 s"
            sup.tick(r)
            time.sleep(0.2)
    finally:
        sup.stop_all()


def test_a_role_that_keeps_failing_at_start_stops_up_with_its_log_tail(tmp_path, redis_server, r, toy_model_path):
    lines: list[str] = []
    sup = supervisor(tmp_path, redis_server, lines)
    write_desired(tmp_path, {"learner": 1, "rollout": 0, "restart": {}})  # the learner alone
    # what the roles read: a Redis that is not there, so every start of the learner fails (exit 3)
    (tmp_path / "config.yaml").write_text(f"redis_url: redis://127.0.0.1:1/0\nredis_wait_s: 0.1\n"
                                          f"model:\n  path: {toy_model_path}\n")
    run_until_failed(sup, r)
    learner = sup.roles["learner"]
    assert sup.failed == "learner kept failing at start" and not sup.finished, lines
    assert learner.start_failures == START_TRIES and learner.restarts == START_TRIES - 1 and learner.last_exit == 3
    assert list(sup.roles) == ["learner"] and not learner.running
    # each failed start is reported with why (the last line of its log), then the give-up with the log's tail
    retries = [x for x in lines if x.startswith("learner exited with code") and "giving up" not in x]
    assert len(retries) == START_TRIES - 1 and all("127.0.0.1:1" in x for x in retries), lines
    giving_up = [x for x in lines if "giving up" in x]
    assert len(giving_up) == 1 and "logs/learner.log" in giving_up[0] and "127.0.0.1:1" in giving_up[0], lines


def test_a_role_that_exits_2_is_not_restarted(tmp_path, redis_server, r):
    """Exit 2 is a mistake in the config or the fleet (a key the learner refuses; a worker
    that cannot take its weights): no restart can mend it, so up stops at the first."""
    lines: list[str] = []
    sup = supervisor(tmp_path, redis_server, lines)
    write_desired(tmp_path, {"learner": 1, "rollout": 0, "restart": {}})
    (tmp_path / "config.yaml").write_text("learner:\n  no_such_key: 1\n")
    run_until_failed(sup, r)
    learner = sup.roles["learner"]
    assert learner.last_exit == USAGE_ERROR and learner.restarts == 0, lines
    giving_up = [x for x in lines if "giving up" in x]
    assert len(giving_up) == 1 and "no_such_key" in giving_up[0], lines


def test_the_progress_line_shows_step_reward_staleness_workers_and_queue(tmp_path, redis_server, r):
    lines: list[str] = []
    sup = supervisor(tmp_path, redis_server, lines)
    keys = Keys(sup.cfg.run_id)
    registry.set_learner_state(r, keys, step=7, status="running")
    registry.heartbeat_worker(r, keys, "w0", 30, address="127.0.0.1:1")
    rows = [{"step": s, "reward_mean": s / 10, "staleness_mean": 0.5, "dropped_stale_step": 0} for s in (6, 7)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows) + '{"step": 8, "rew')
    sup._progress(r)
    assert lines == []  # not yet: at most one line per PROGRESS_EVERY_S
    sup.last_progress = 0.0
    sup._progress(r)
    sup._progress(r)  # the same step again: not before PROGRESS_IDLE_S
    assert lines == ["step 7/40  reward 0.700  staleness 0.50  dropped 0  workers 1/1 registered  queue 0"], lines


def test_restart_rollout_restarts_one_worker_at_a_time(tmp_path, redis_server):
    """``rlpipe restart rollout``: the next worker is stopped only once the one before is
    running again as a new process and ready (here: real processes, readiness set by hand)."""
    sup = supervisor(tmp_path, redis_server, [])
    for name in ("w0", "w1"):
        sup.roles[name] = Role(name, [], proc=subprocess.Popen(["sleep", "60"], start_new_session=True),
                               started=time.monotonic(), ready=True)
    w0, w1 = sup.roles["w0"], sup.roles["w1"]
    try:
        sup.rolling = ["w0", "w1"]
        sup._roll()
        assert w0.proc.wait(10) == -signal.SIGTERM and w1.running  # w0 asked to stop, w1 left alone
        w0.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)  # as _reconcile restarts it
        w0.started, w0.stopping_since, w0.ready = time.monotonic(), None, False
        sup._roll()
        assert w1.running and w1.stopping_since is None  # w0 is back but not ready yet
        w0.ready = True
        sup._roll()
        assert w1.proc.wait(10) == -signal.SIGTERM and w0.running and sup.rolling == ["w1"]
    finally:
        for role in (w0, w1):
            role.proc.kill()
            role.proc.wait()


# -- a learner hash overwritten in Redis (issue 33, item 15) -----------------------------------
def test_a_step_that_is_not_a_number_is_shown_as_step_0(tmp_path, redis_server, r):
    """``step abc`` in the learner hash made the progress line raise in ``tick``: ``rlpipe up``
    stopped every role and ended with a traceback."""
    lines: list[str] = []
    sup = supervisor(tmp_path, redis_server, lines)
    write_desired(tmp_path, {"learner": 0, "rollout": 0, "restart": {}})
    registry.set_learner_state(r, Keys(sup.cfg.run_id), step="abc", status="running")
    sup.last_progress = 0.0
    sup.tick(r)
    assert lines[-1] == "step 0/40  workers 0/0 registered  queue 0", lines
    assert not sup.failed and not sup.roles


def test_autoscale_advice_that_is_not_a_count_is_no_advice(tmp_path, redis_server, r):
    """``fleet_desired_workers nan`` made ``--autoscale`` raise in ``tick``, as ``step abc`` did."""
    lines: list[str] = []
    cfg = build_config({}, environ={}, run_id=free_run_id("up"), run_dir=str(tmp_path), redis_url=redis_server.url,
                       workers=1, steps=40, **{"autoscale.enabled": True, "autoscale.max_workers": 3})
    sup = Supervisor(cfg, tmp_path, log=lines.append)
    write_desired(tmp_path, {"learner": 0, "rollout": 0, "restart": {}})
    keys = Keys(cfg.run_id)
    for junk in ("nan", "inf", "abc", "-2", "2.5"):
        registry.set_learner_state(r, keys, fleet_desired_workers=junk, fleet_wait_fraction="nan")
        sup.tick(r)
        assert read_desired(tmp_path)["rollout"] == 0 and not sup.roles, (junk, lines)
    registry.set_learner_state(r, keys, fleet_desired_workers=10**30, fleet_wait_fraction="abc")
    sup._autoscale(r, read_desired(tmp_path))  # (not tick: it would start the workers)
    assert read_desired(tmp_path)["rollout"] == 3  # within the run's bounds
    assert "autoscale: 3 workers: the learner waited ? of its time" in lines[-1], lines
