"""bench/learner_speed.py's plumbing (not its speeds): two configurations, one round, two steps,
each a real learner process over the embedded Redis; the JSON holds a positive tokens/s
for both and a ratio that is their quotient."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_the_learner_benchmark_runs_two_configurations_and_reports_their_ratio(tmp_path):
    out = tmp_path / "learner.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "learner_speed.py"), "--quick", "--only",
                           "dtype/fp32,dtype/bf16", "--rounds", "1", "--steps", "2", "--no-gpu", "--out", str(out),
                           "--json", str(tmp_path / "report" / "learner.json")],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (group,) = json.loads(out.read_text())["groups"]
    assert group["name"] == "dtype" and group["baseline"] == "fp32"
    fp32, bf16 = group["rows"]
    assert [fp32["name"], bf16["name"]] == ["fp32", "bf16"]
    for row in (fp32, bf16):
        assert row["error"] is None and row["median"] > 0 and len(row["runs"]) == 1
        assert row["gflops"] > 0  # the row's model FLOP/s, shown against the core's peak
        assert "GFLOP/s" in proc.stdout and "of core peak" in proc.stdout
        # the learner process's own peak: torch and a model are loaded, and it is no bigger than this machine
        assert 200 < row["peak_mib"] < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    assert fp32["ratio"] == 1.0
    assert bf16["ratio"] == pytest.approx(bf16["median"] / fp32["median"])
    assert "| dtype | fp32 (baseline) |" in proc.stdout and "ratio vs baseline" in proc.stdout
    assert proc.stderr.count("[round 1/1") == 2  # one progress line per run
    section = json.loads((tmp_path / "report" / "learner.json").read_text())  # the evidence report's section
    assert [row[1] for row in section["tables"][0]["rows"]] == ["fp32 (baseline)", "bf16"]
    assert (tmp_path / "report" / section["plots"][0]["file"]).stat().st_size > 0


def test_flops_per_token_counts_each_pass_the_step_takes():
    """Two epochs of a full fine-tune (with the recompute pass) are 2 x 6N + 2N; one epoch under
    single_pass is 6N; a LoRA epoch's backward takes no weight gradient of the base: 4N."""
    from bench.learner_speed import flops_per_token
    from rlpipe.config import build_config

    n = 1_000
    cfg = lambda **kw: build_config({}, environ={}, **kw)  # noqa: E731
    assert flops_per_token(cfg(**{"learner.ppo_epochs": 2}), n) == 14 * n
    assert flops_per_token(cfg(**{"learner.ppo_epochs": 1}), n) == 6 * n
    assert flops_per_token(cfg(**{"learner.ppo_epochs": 1, "learner.lora.rank": 8}), n) == 4 * n
    assert flops_per_token(cfg(**{"learner.ppo_epochs": 1, "learner.single_pass": False}), n) == 8 * n
