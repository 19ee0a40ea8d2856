"""bench/queue_cost.py's plumbing (not its speeds): a --quick run writes a results section whose
per-group and per-step numbers are positive, whose 8k group is more bytes than its 1k
group, and whose plot is on disk beside the JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_the_queue_benchmark_writes_a_section_with_per_group_and_per_step_costs(tmp_path):
    out = tmp_path / "results" / "queue.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "queue_cost.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sec = json.loads(out.read_text())
    assert sec["name"] == "queue" and "--quick" in sec["command"] and sec["notes"]
    tables = {t["title"]: t for t in sec["tables"]}
    per_group, per_step = tables["Per group (median)"], tables["Per learner step"]
    rows = {r[0]: dict(zip(per_group["columns"], r)) for r in per_group["rows"]}
    assert set(rows) == {"1k", "8k"}
    for r in rows.values():
        for col in per_group["columns"][2:]:
            assert r[col] > 0, (r["group"], col)
        assert r["queue ms"] > r["encode ms"] + r["push ms"]
    assert rows["8k"]["tokens"] == 8 * rows["1k"]["tokens"]
    assert rows["8k"]["bytes"] > 4 * rows["1k"]["bytes"]  # int32 ids + float32 log-probs + versions per token
    for r in per_step["rows"]:
        step = dict(zip(per_step["columns"], r))
        assert step["learner step s"] > 0 and 0 < step["queue / step"] < 1
        assert step["queue / step"] == step["queue ms/step"] / 1e3 / step["learner step s"]
    (plot,) = sec["plots"]
    assert (out.parent / plot["file"]).stat().st_size > 0
    assert "| 8k |" in proc.stdout
