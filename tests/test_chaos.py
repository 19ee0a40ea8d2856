"""One run, faults at random (seeded): SIGKILLs of the learner, of a worker and of
``redis-server``, each role its own process (tests/cluster.py), each restarted as a
supervisor would; a killed Redis also loses the last second of its AOF, as it would if its
machine died (appendfsync everysec); and poison: well-formed records that do not fit the
run (a 2,048-token one among them), raw XADDs and the deletion of the sync hash
(Cluster.inject_poison). At the end:

- the run reached its final step;
- produced == trained + dropped + dead + duplicate + what is left in the stream;
- every prompt index below the cursor is accounted for (trained or dropped by the final
  lineage, in the stream, given back, or skipped and counted);
- no prompt (so no group) was trained twice in the final lineage;
- staleness and the drop rate after the last fault are back to their level before the first;
- no process logged a traceback, and no worker an unretrieved task exception.

``RLPIPE_CHAOS_SEED`` picks another schedule; the report is printed (``-s``).
"""

from __future__ import annotations

import os
import random
from typing import NamedTuple

import pytest

from tests.cluster import Cluster, audited, back_to_steady, segments, steady
from tests.test_restarts import SETTINGS, SETTLE

pytestmark = [pytest.mark.slow, pytest.mark.soak]

STEPS = 30
FAULTS = ("learner", "learner", "worker", "redis", "poison")


def schedule(seed: int, steps: int = STEPS) -> list[tuple[int, str]]:
    """The faults in a random order at random steps, at least 3 apart, the first after a
    steady stretch and the last early enough to see the run settle again."""
    rng = random.Random(seed)
    kinds = list(FAULTS)
    rng.shuffle(kinds)
    first, last = SETTLE + 4, steps - SETTLE - 5
    while True:
        steps = sorted(rng.sample(range(first, last + 1), len(kinds)))
        if all(b - a >= 3 for a, b in zip(steps, steps[1:])):
            return list(zip(steps, kinds))


class ChaosRun(NamedTuple):
    plan: list[tuple[int, str]]
    cluster: Cluster  # stopped; its faults, fault_rows and logs remain
    books: dict  # Cluster.audit()
    rows: list[dict]  # metrics.jsonl
    parts: list[list[dict]]  # rows split by learner process
    before: dict  # steady() before the first fault
    after: dict  # and after the last


def run_chaos(work, model_path: str, seed: int, steps: int = STEPS, password: str = "chaos-pw",
              log=lambda message: None) -> ChaosRun:
    """One seeded run with its faults injected (the test below, and bench/faults.py): the
    plan, the cluster (its faults and logs), the books, the metrics rows split by learner
    process, and the steady state before the first fault and after the last."""
    plan = schedule(seed, steps)
    cluster = Cluster(work, model_path, workers=2, password=password,
                      **{**SETTINGS, "steps": steps, "sync.timeout_s": 10.0})
    with audited(cluster) as books:
        for w in ("w0", "w1"):
            cluster.start_worker(w, wait=False)
        cluster.start_learner()
        cluster.inject(plan, log=log)
        cluster.wait_done()
        cluster.check_alive(learner_may_exit=True)
    rows = cluster.metrics()
    parts = segments(rows)
    return ChaosRun(plan, cluster, books, rows, parts,
                    before=steady([r for r in parts[0] if SETTLE < r["step"] <= plan[0][0]]),
                    after=steady([r for r in parts[-1] if r["step"] > plan[-1][0] + SETTLE]))


def test_chaos(tmp_path, toy_model_path):
    seed = int(os.environ.get("RLPIPE_CHAOS_SEED", "12"))
    plan, cluster, books, _, parts, before, after = run_chaos(tmp_path, toy_model_path, seed)
    report = {"seed": seed, "faults": cluster.faults, "books": books, "before": before, "after": after,
              "restart_to_first_step_s": [p[0]["learner_start_to_first_step_seconds"] for p in parts[1:]]}
    print(report)
    assert parts[-1][-1]["step"] == STEPS and len(parts) == 1 + sum(k == "learner" for _, k in plan), report
    assert books["lost"] == 0 and books["trained_twice"] == 0, report
    assert books["counters"]["dead"] == 7, report  # the 6 forged records and the raw XADD, each with its reason
    assert before["steps"] >= 3 and after["steps"] >= 3, report
    assert back_to_steady(before, after, SETTINGS["queue.max_lag"]), report
    for role in ("learner", "w0", "w1"):
        text = cluster.log(role, tail=None)
        assert "Traceback" not in text and "never retrieved" not in text, (role, text[-3000:])
        # a line when a Redis outage begins and one when it ends, not one per failed call
        # (a Redis still loading its AOF may make two outages of one)
        assert text.count("is back") <= text.count("unreachable") <= 2 * sum(k == "redis" for _, k in plan), role
