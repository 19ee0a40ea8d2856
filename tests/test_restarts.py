"""Restarts as a deployment has them, each role its own process (launch/cluster.py): the
pipeline must come back to its steady state (staleness, drop rate), not only keep its books.

- the learner SIGKILLed twice and restarted by hand: within a few steps of each restart,
  staleness and the drop rate are back to their levels before the first one (the bug
  this guards: a restored learner's version runs ahead of its steps, and back-pressure
  derived from the version left every later step at max_staleness, a quarter dropped);
  the restarted learner takes over the dead one's lease at once;
- a worker SIGKILLed with groups in flight: its leased prompts are re-issued once its
  heartbeat expires, every prompt is accounted for and none is trained twice.

Both run against a password-protected Redis (password from a file, and in the URL).
"""

from __future__ import annotations

import os
import signal

import pytest

from launch.cluster import SETTINGS, SETTLE, Cluster, audited, back_to_steady, segments, steady
from rlpipe.queue import TrajectoryQueue
from tests.conftest import wait_for

pytestmark = pytest.mark.slow


def run_killing_the_learner(cluster: Cluster, kill_at: tuple[int, ...]) -> None:
    """Two workers and the learner, the learner SIGKILLed at each of ``kill_at``'s steps and
    started again at once, until the run is done."""
    for w in ("w0", "w1"):
        cluster.start_worker(w, wait=False)
    cluster.start_learner()
    for step in kill_at:
        cluster.wait_step(step)
        cluster.kill_learner()
        cluster.start_learner()
    cluster.wait_done()


@pytest.mark.soak
def test_learner_restarts_return_the_pipeline_to_its_steady_state(tmp_path, toy_model_path):
    cluster = Cluster(tmp_path, toy_model_path, workers=2, password="s3cret-file", **SETTINGS)
    with audited(cluster) as books:
        run_killing_the_learner(cluster, (9, 17))
        cluster.check_alive(learner_may_exit=True)  # the workers served throughout
    parts = segments(cluster.metrics())
    assert len(parts) == 3, [len(p) for p in parts]
    before = steady([r for r in parts[0] if r["step"] > SETTLE])
    after = [steady(p[SETTLE:]) for p in parts[1:]]
    report = {"before": before, "after": after, "books": books,
              "first_step_s": [p[0]["learner_start_to_first_step_seconds"] for p in parts[1:]]}
    print(report)
    assert before["steps"] >= 4 and all(a["steps"] >= 3 for a in after), report
    assert before["staleness_max"] <= SETTINGS["queue.max_lag"], report
    assert all(back_to_steady(before, a, SETTINGS["queue.max_lag"]) for a in after), report
    assert parts[-1][-1]["step"] == SETTINGS["steps"]
    # each restart found the dead learner's lease and took it without waiting out its 30 s TTL
    assert cluster.log("learner", tail=None).count("took its lease without waiting") == 2
    assert books["lost"] == 0 and books["trained_twice"] == 0


@pytest.mark.soak
@pytest.mark.parametrize("max_lag", [0, 1])
def test_the_hard_staleness_bound_holds_across_learner_restarts_under_dynamic_sampling(tmp_path, toy_model_path,
                                                                                      max_lag):
    """queue.max_lag as the hard bound (no max_staleness), dynamic sampling filtering groups,
    the learner killed twice: over the whole run, every step of every learner process, no
    trained group is older than max_lag versions; the groups dropped stale are counted, and
    nothing is lost or trained twice."""
    settings = {**SETTINGS, "steps": 21, "queue.max_lag": max_lag, "queue.max_staleness": None,
                "learner.dynamic_sampling": True, "sampling.n": 2}
    cluster = Cluster(tmp_path, toy_model_path, workers=2, **settings)
    with audited(cluster) as books:
        run_killing_the_learner(cluster, (7, 14))
    rows = cluster.metrics()
    report = {"max_lag": max_lag, "steps": len(rows), "staleness_max": max(r["staleness_max"] for r in rows),
              "dropped_stale": sum(r["dropped_stale_step"] for r in rows),
              "trained": sum(r["groups"] for r in rows), "books": books}
    print(report)
    assert len(segments(rows)) == 3, report
    assert report["staleness_max"] <= max_lag, report
    assert books["lost"] == 0 and books["trained_twice"] == 0, report


# soak: a fault run of minutes; test_rollout_loop and test_queue cover leases given back in the suite
@pytest.mark.soak
def test_a_dead_or_paused_worker_loses_no_prompt_and_none_is_trained_twice(tmp_path, toy_model_path):
    """w1 is paused (SIGSTOP) with groups in flight past its heartbeat TTL: its prompts are
    re-issued, and when it resumes, its late pushes of them are refused (a zombie). Later
    it is SIGKILLed with groups in flight and restarted under the same id. The groups are
    multi-turn episodes (configs/toy-retry.yaml's environment, driven through sessions):
    an episode in flight is a group in flight like any other. (The environment's step limit
    is raised: the pause counts against a step's wall clock, so a step in flight at SIGSTOP
    would time out at SIGCONT and its group be given back, a no-op since its lease was
    re-issued, instead of pushed late.)"""
    from tests.conftest import ROOT

    cluster = Cluster(tmp_path, toy_model_path, workers=2, password="s3cret-url", password_in_url=True,
                      **{**SETTINGS, "steps": 18, "sync.timeout_s": 10.0, "task.environment": "retry",
                         "task.environment_timeout_s": 600.0,
                         "rollout.chat_template": str(ROOT / "configs" / "toy-chat.jinja")})
    with audited(cluster) as books:
        for w in ("w0", "w1"):
            cluster.start_worker(w, wait=False)
        cluster.start_learner()
        r = cluster.client()
        q = TrajectoryQueue(r, cluster.cfg.run_id)
        cluster.wait_step(3)
        wait_for(lambda: len(q.leased("w1")) >= 2, 60, interval=0.01, what="w1 with groups in flight")
        os.killpg(cluster.workers["w1"].pid, signal.SIGSTOP)
        paused_with = q.leased("w1")
        wait_for(lambda: q.counters()["reissued"] >= len(paused_with), 60, what="w1's prompts re-issued")
        os.killpg(cluster.workers["w1"].pid, signal.SIGCONT)
        wait_for(lambda: q.counters()["rejected_push"] >= 1, 60, what="the zombie's late push refused")
        cluster.wait_step(9)
        wait_for(lambda: len(q.leased("w1")) >= 2, 60, interval=0.01, what="w1 with groups in flight")
        cluster.kill_worker("w1")
        cluster.start_worker("w1")  # the same id: re-issues what its previous life leased
        cluster.wait_done()
    print(books)
    c = books["counters"]
    assert c["reissued"] >= len(paused_with) + 2 and c["rejected_push"] >= 1
    assert books["lost"] == 0 and books["trained_twice"] == 0
    assert "re-issued" in cluster.log("w1", tail=None) and "not pushed" in cluster.log("w1", tail=None)
    assert all(r["tokens_masked"] > 0 for r in cluster.metrics())  # every step trained on episodes

