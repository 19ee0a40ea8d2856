"""bench/seeds.py's tables and plots (not its training): ``--from-runs`` over kept runs made of
synthetic metrics.jsonl rows, no engines. Checks the per-arm-and-seed table with its mean rows,
the stale groups counted from staleness_hist, the staleness-0 KL leaving out steps without
fresh groups, failed runs left out, and the plot written next to the section's JSON."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def row(step, kl, fresh=None, hist=None, reward=0.5, skipped=0, scale=65536.0):
    r = {"step": step, "reward_mean": reward, "mismatch_kl": kl, "mismatch_k3_kl": abs(kl) + 1e-6,
         "mismatch_log_ppl_abs_diff": abs(kl) * 10, "learner_skipped_steps_total": skipped,
         "learner_loss_scale": scale, "staleness_hist": hist or {"0": 8}, "groups": sum((hist or {"0": 8}).values()),
         "time": 10.0 * step}
    if fresh is not None:
        r["mismatch_kl_fresh"] = fresh
    return r


def write_run(runs, name, rows, failed=False):
    d = runs / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if failed:
        (d / "failed.txt").write_text("RuntimeError: boom\n")


def test_from_runs_tables_and_plots_from_kept_runs(tmp_path):
    runs = tmp_path / "out" / "precision" / "runs"
    write_run(runs, "bf16-s0", [row(s, 1e-4, fresh=1e-4, reward=0.1 * s) for s in range(1, 7)])
    write_run(runs, "bf16-s1", [row(s, 3e-4, fresh=3e-4, reward=0.2) for s in range(1, 7)])
    # fp16 seed 0: step 2 has 2 stale groups among 8; step 3 only stale ones (no fresh KL); 1 skipped step
    fp16 = [row(1, 1e-5, fresh=1e-5), row(2, 5e-3, fresh=2e-5, hist={"0": 6, "1": 2}),
            row(3, 9e-3, hist={"1": 8}, skipped=1, scale=32768.0), row(4, 3e-5, fresh=3e-5, skipped=1)]
    write_run(runs, "fp16-s0", fp16)
    write_run(runs, "fp16-s1", [row(s, 1e-5, fresh=1e-5) for s in range(1, 5)])
    write_run(runs, "fp16-s2", [row(1, 1.0, fresh=1.0)], failed=True)  # a failed run: left out
    write_run(runs, "bf16-fp32-s0", [row(s, 7e-4, fresh=7e-4) for s in range(1, 4)])  # another arm, not bf16's
    (runs.parent / "settings.json").write_text(json.dumps({"command": "python bench/seeds.py --finding precision",
                                                           "settings": {"steps": 6, "queue.max_lag": 0}}))
    json_dir = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "seeds.py"), "--finding", "precision", "--from-runs",
                           "--out", str(tmp_path / "out"), "--json-dir", str(json_dir)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]

    sec = json.loads((json_dir / "precision.json").read_text())
    assert sec["name"] == "precision" and sec["command"].startswith("python bench/seeds.py --finding precision")
    (table,) = sec["tables"]
    cols = table["columns"]
    rows = {(r[0], r[1]): dict(zip(cols, r)) for r in table["rows"]}
    assert [(r[0], r[1]) for r in table["rows"]] == [("bf16", 0), ("bf16", 1), ("bf16", "mean"), ("fp16", 0),
                                                     ("fp16", 1), ("fp16", "mean"), ("bf16/fp32", 0)]
    f0 = rows[("fp16", 0)]
    assert f0["steps"] == 4 and f0["groups"] == 32
    assert f0["stale groups"] == 10 and f0["steps w/o fresh"] == 1
    assert f0["KL (k1, staleness 0)"] == pytest.approx(statistics.fmean([1e-5, 2e-5, 3e-5]))
    assert f0["KL (k1, all)"] == pytest.approx(statistics.fmean([1e-5, 5e-3, 9e-3, 3e-5]))
    assert f0["skipped steps"] == 1 and f0["min loss scale"] == 32768.0
    assert rows[("fp16", 1)]["stale groups"] == 0
    assert rows[("bf16", "mean")]["KL (k1, all)"] == pytest.approx(2e-4)
    assert rows[("bf16", 0)]["reward end"] == pytest.approx(statistics.fmean([0.2, 0.3, 0.4, 0.5, 0.6]))
    assert rows[("bf16", 0)]["reward start"] == pytest.approx(0.2)
    assert rows[("bf16/fp32", 0)]["KL (k1, all)"] == pytest.approx(7e-4)
    assert "steps=6" in table["note"]

    (plot,) = sec["plots"]
    assert plot["file"] == "precision_curves.png" and (json_dir / plot["file"]).stat().st_size > 10_000
    assert any("staleness 0" in n for n in sec["notes"])
    assert "| fp16 | mean |" in proc.stdout  # the tables are printed


def test_the_length_trigger_replayed_on_a_run_fires_where_the_smoothed_length_doubles():
    sys.path.insert(0, str(ROOT))
    from bench.seeds import replayed_surge

    def rows(lengths):
        return [{"step": i + 1, "response_length_mean": x} for i, x in enumerate(lengths)]

    growing = rows([40, 40, 40, 40, 50, 60, 70, 80, 90, 100])  # 3-step means: 40 ... 90
    assert replayed_surge(2.0)(growing) == 9  # (70+80+90)/3 = 80 = 2 x 40
    assert replayed_surge(1.5)(growing) == 7  # (50+60+70)/3 = 60 = 1.5 x 40
    assert replayed_surge(2.0)(rows([40, 60, 45, 55, 50, 58, 52, 61, 49, 57])) is None  # noise, no surge


def test_the_real_recipes_check_fails_a_run_whose_final_evaluation_is_missing_or_stale():
    """What tests/test_real_model.py asserted of a short recipe run is the `real` finding's
    check: CI's quick report fails when a run breaks it."""
    sys.path.insert(0, str(ROOT))
    from bench.seeds import FINDINGS, Rows

    check = FINDINGS["real"].check
    settings = {"steps": 2, "eval.dataset": "mawps:singleeq", "eval.size": 8}

    def run(evals, lengths=(5.0, 6.0)):
        rows = Rows({"step": s, "response_length_mean": n} for s, n in enumerate(lengths, 1))
        rows.evals = [{"requested_version": v, "version": got, "dataset": "mawps:singleeq", "rows": 8,
                       "pass_at_1": 0.25, "pass_at_1_low": 0.05, "pass_at_1_high": 0.6} for v, got in evals]
        return rows

    assert check(run([(0, 0), (2, 2)]), settings) == []
    assert check(run([(0, 0)]), settings)  # no evaluation at the end
    assert check(run([(0, 0), (2, 1)]), settings)  # the final one on an older version's weights
    assert check(run([(0, 0), (2, 2)], lengths=(5.0, 0.0)), settings)  # an empty answer
    bad = run([(0, 0), (2, 2)])
    bad.evals[1]["pass_at_1"] = 0.9  # outside its own interval
    assert check(bad, settings)


@pytest.mark.parametrize("finding,arm", [("real-rollout", "bf16"), ("real-lora", "int8/full"),
                                         ("real-lora-40", "int8/lora")])
def test_quick_real_findings_read_the_real_parts_quick_run_and_train_nothing(tmp_path, finding, arm):
    """CI's quick bench runs one SmolLM2 run (the `real` part's) and `real-rollout` and
    `real-lora` render from it."""
    cmd = [sys.executable, str(ROOT / "bench" / "seeds.py"), "--finding", finding, "--quick",
           "--out", str(tmp_path / "out"), "--json-dir", str(tmp_path / "results")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "reads real's quick run" in proc.stderr  # nothing to read: says what to run
    runs = tmp_path / "out" / "real" / "runs"
    write_run(runs, "grpo-s0", [row(s, 1e-3, fresh=1e-3) for s in (1, 2)])
    (runs.parent / "settings.json").write_text(json.dumps({"command": "seeds.py --finding real --quick",
                                                           "settings": {"steps": 2, "eval.size": 8}}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "out" / finding).exists()  # no run trained
    (table,) = json.loads((tmp_path / "results" / f"{finding}.json").read_text())["tables"]
    assert [r[:2] for r in table["rows"]] == [[arm, 0]] and "nothing trained" in table["note"]


def test_the_held_out_sign_test_counts_rows_gained_and_lost_on_the_rows_both_evaluated():
    """The paired comparison of a run's first and last evaluations (McNemar's exact test)."""
    from bench.seeds import Rows, held_out_sign_test

    rows = Rows()
    rows.evals = [{"version": 0, "rows_evaluated": list(range(10)), "rows_right": [0, 1]},
                  {"version": 4, "rows_evaluated": list(range(12)), "rows_right": [1, 2, 3, 4, 5, 6, 11]}]
    assert held_out_sign_test()(rows) == "5/1, p = 0.22"  # row 11 is not in both; 2*(1+6)/64
    rows.evals[1]["rows_right"] = [0, 1, 2, 3, 4, 5, 6]
    assert held_out_sign_test()(rows) == "5/0, p = 0.062"  # 2/32
    assert held_out_sign_test("rows_right_lenient")(rows) is None and held_out_sign_test()(Rows()) is None
