"""One run, faults at random (seeded): SIGKILLs of the learner, of a worker and of
``redis-server``, each role its own process (launch/cluster.py), each restarted as a
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

The run itself is launch/chaos.py's (bench/faults.py reports and plots the same run).
``RLPIPE_CHAOS_SEED`` picks another schedule; the report is printed (``-s``).
"""

from __future__ import annotations

import os

import pytest

from launch.chaos import STEPS, run_chaos
from launch.cluster import SETTINGS, back_to_steady

pytestmark = [pytest.mark.slow, pytest.mark.soak]


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
