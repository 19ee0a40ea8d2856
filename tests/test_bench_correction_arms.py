"""bench/correction_arms.py: every arm's command is a run `rlpipe check` accepts (so an hour of runs does
not end in a config error), and an arm's row is computed from its summary and metrics rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.correction_arms import ARMS, arm_row, demo_command, teacher_dir

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", list(ARMS))
def test_each_arms_command_passes_the_launch_checks(name, tmp_path):
    teacher = str(tmp_path / "teacher")
    if name == "distill":  # the teacher check wants a model directory with the student's vocabulary
        teacher = teacher_dir()
    command = demo_command(name, 0, tmp_path, 420, teacher)
    command[command.index("demo")] = "check"
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "train_budget_s: 420" in done.stdout
    assert "precision: int8" in done.stdout


def test_an_arms_row_reads_its_summary_and_step_rows(tmp_path):
    run = tmp_path / "corr-sc-s1"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "steps": 2, "groups_produced": 5, "rl_seconds": 100.0, "eval_given_pass@1": "0.1", "machine": "cpu",
        "eval_exported_pass@1": "0.2", "eval_exported_paired_strict": "10/100 -> 20/100"}))
    rows = [{"learner_step_seconds": 10.0, "mismatch_k3_kl": 0.01, "mismatch_prob_diff_max": 0.3, "is_ess": 0.9,
             "response_length_mean": 40.0},
            {"learner_step_seconds": 20.0, "mismatch_k3_kl": 0.03, "mismatch_prob_diff_max": 0.5, "is_ess": 0.7,
             "response_length_mean": 60.0},
            {"kind": "eval", "pass_at_1": 0.5}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    row = arm_row("sc", 1, tmp_path)
    assert row["k3_mean"] == pytest.approx(0.02) and row["prob_gap_max"] == 0.5 and row["ess_min"] == 0.7
    assert row["step_s"] == pytest.approx(15.0) and row["paired"] == "10/100 -> 20/100"
    assert row["fleet_tokens_per_s"] == pytest.approx(5 * 8 * 50.0 / 100.0)
    assert row["topk_bytes_per_group"] == 8 * 50 * 8 * 6  # answers x tokens x k x (int32 id + fp16)
    assert arm_row("tis", 1, tmp_path) is None  # not run
