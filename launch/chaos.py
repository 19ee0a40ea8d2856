"""One run, faults at random (seeded): SIGKILLs of the learner, of a worker and of
``redis-server``, each role its own process (launch/cluster.py), each restarted as a
supervisor would; a killed Redis also loses the last second of its AOF, as it would if its
machine died (appendfsync everysec); and poison: well-formed records that do not fit the
run (a 2,048-token one among them), raw XADDs and the deletion of the sync hash
(Cluster.inject_poison).

:func:`run_chaos` runs it and returns what happened; tests/test_chaos.py checks it and
bench/faults.py reports and plots it.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from launch.cluster import SETTINGS, SETTLE, Cluster, audited, segments, steady

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
    """One seeded run with its faults injected (tests/test_chaos.py, and bench/faults.py): the
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
