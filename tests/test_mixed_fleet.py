"""A mixed-precision fleet with a slow worker beside a fast one, roles as separate processes:
each precision's groups trained, staleness and stale drops are reported (metrics.jsonl,
Prometheus) and add up to the run's books.

Back-pressure hands a free place to whichever worker asks first, so a precision's share of
the batches is what its throughput earns, not its share of the workers (docs/quantization.md, 'Mixed
fleets'); these numbers are how a person sees that, and the staleness it costs. A group in
flight holds the fast workers back before the learner gets ``queue.max_staleness`` versions
past it, so a worker slower than the learner's steps is paced with, not starved: its groups
are trained at most that stale, none dropped (issue 33: on a machine where fp16 was slow
enough, every fp16 group was dropped stale and none trained)."""

from __future__ import annotations

import re

import httpx
import pytest

from launch.cluster import Cluster, audited
from rlpipe import registry
from rlpipe.faults import GROUP_DELAY_ENV
from tests.conftest import wait_for

pytestmark = pytest.mark.slow

# Seconds each fp16 group waits before its push, so fp16 is the slow precision whatever the CPU:
# on an idle machine, more than the learner needs for max_staleness steps on the bf16 worker's
# groups alone, so the hold is what gets fp16's groups trained (without it, a slow enough fp16
# worker: {'bf16': 96, 'fp16': 0}). The assertions hold however slow it is; only the time grows.
SLOW_GROUP_S = 8.0


def test_a_slow_precision_beside_a_fast_one_is_reported_apart_and_adds_up(tmp_path, toy_model_path):
    cluster = Cluster(tmp_path, toy_model_path, workers=2, steps=12, **{
        "rollout.fleet": ["bf16", "fp16"], "learner.groups_per_step": 8, "rollout.max_inflight_groups": 4,
        "queue.max_lag": 1, "learner.checkpoint_every": 4, "learner.on_done": "serve"})
    delay = tmp_path / "slow-verifier"
    delay.write_text(str(SLOW_GROUP_S))  # each fp16 group spends this much more before its push
    with audited(cluster) as books:
        cluster.start_worker("w0", wait=False)  # bf16, the config's precision
        cluster.start_worker("w1", wait=False, env={GROUP_DELAY_ENV: str(delay)}, args=("--precision", "fp16"))
        # both serve before the first step: a worker that started late would miss the first generation
        r = cluster.client()
        wait_for(lambda: set(registry.live_workers(r, cluster.keys)) == {"w0", "w1"}, 600, interval=0.5,
                 what="both workers")
        cluster.start_learner()
        cluster.wait_step(12, timeout=600)
        state = lambda: registry.learner_state(cluster.client(), cluster.keys)  # noqa: E731
        wait_for(lambda: state().get("status") == "done", 120, interval=0.5, what="the last checkpoint")
        text = httpx.get(f"http://{state()['address']}/metrics", timeout=10).text  # served until stopped
    rows = cluster.metrics()
    last = rows[-1]
    trained, dropped = last["trained_groups_by_precision_total"], last["dropped_stale_by_precision_total"]
    assert set(trained) == set(dropped) == {"bf16", "fp16"}
    # the totals are the steps' groups, precision by precision, and the run's books
    for p in ("bf16", "fp16"):
        assert trained[p] == sum(r["groups_by_precision"].get(p, 0) for r in rows), p
    assert sum(trained.values()) == last["trained_groups_total"] == books["trained_groups"]
    assert sum(dropped.values()) == sum(r["dropped_stale_step"] for r in rows) == books["counters"]["dropped_stale"]
    assert books["lost"] == 0 and books["trained_twice"] == 0
    # the slow precision earns the smaller share, and its groups are the staler, but none is
    # thrown away: the learner waits for a group about to pass max_staleness
    assert 0 < trained["fp16"] < trained["bf16"], trained
    assert dropped == {"bf16": 0, "fp16": 0}, (trained, dropped)

    def mean_staleness(p):
        seen = [(r["staleness_by_precision"][p]["staleness_mean"], r["groups_by_precision"][p])
                for r in rows if p in r["staleness_by_precision"]]
        return sum(s * n for s, n in seen) / sum(n for _, n in seen)

    assert mean_staleness("fp16") > mean_staleness("bf16"), (mean_staleness("fp16"), mean_staleness("bf16"))
    for r in rows:  # each step's per-precision staleness is within the step's own
        for p, s in r["staleness_by_precision"].items():
            assert s["staleness_max"] <= r["staleness_max"] and s["staleness_mean"] <= r["staleness_max"]
    # Prometheus: one counter per precision, labelled, as the dashboard's mixed-fleet panels read it
    lines = [x for x in text.splitlines() if x.startswith("rlpipe_trained_groups_by_precision_total{")]
    series = {re.search(r'precision="(\w+)"', x)[1]: float(x.rsplit(" ", 1)[1]) for x in lines}
    assert series == {p: float(n) for p, n in trained.items()}, lines
