"""bench/recipe_speed.py's arithmetic (not its speeds): steps per hour from an arm's metrics rows, the
steps after the warm-up only, and the precisions its resolved config chose."""

from __future__ import annotations

import json

import pytest

from bench import recipe_speed


def fake_arm(runs_dir, name: str, seconds_per_step: float, precision: str, dtype: str) -> None:
    run = runs_dir / f"speed-{name}"
    run.mkdir(parents=True)
    rows = [{"kind": "eval", "step": 0, "time": 0.0}]
    rows += [{"step": s, "time": 100.0 + s * seconds_per_step + (50.0 if s == 1 else 0.0), "learner_step_seconds": 1.0,
              "learner_train_seconds": 0.5 * seconds_per_step, "learner_wait_seconds": 0.25 * seconds_per_step,
              "weight_sync_seconds": 0.1, "learner_tokens_per_second": 40.0, "reward_mean": 0.5} for s in range(1, 9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(f"rollout:\n  precision: {precision}\nlearner:\n  dtype: {dtype}\n")


def test_steps_per_hour_count_the_steps_after_the_warm_up(tmp_path):
    fake_arm(tmp_path, "pinned", 40.0, "fp32", "fp32")
    fake_arm(tmp_path, "auto", 20.0, "bf16", "bf16")
    pinned, auto = recipe_speed.arm_row("pinned", tmp_path), recipe_speed.arm_row("auto", tmp_path)
    assert pinned["steps_per_hour"] == pytest.approx(90.0) and auto["steps_per_hour"] == pytest.approx(180.0)
    assert pinned["seconds_per_step"] == pytest.approx(40.0)  # step 1's slow start is left out
    assert (auto["rollout"], auto["learner"]) == ("bf16", "bf16") and auto["train_s"] == pytest.approx(10.0)
    sec = recipe_speed.section({"steps": 8, "seed": 0, "cpu": "a test CPU", "rows": {"pinned": pinned, "auto": auto}})
    (table,) = sec.tables
    assert [row[4] for row in table["rows"]] == [pytest.approx(1.0), pytest.approx(2.0)]  # vs pinned
    assert recipe_speed.arm_row("missing", tmp_path) is None
