"""``rlpipe eval``: a run's held-out evaluation of model directories outside a run, on a real vLLM
engine, paired row by row, kept in the evaluation cache."""

from __future__ import annotations

import json

import pytest

from launch.cli import main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from rollout_service import eval_cache

    monkeypatch.setattr(eval_cache, "cache_root", lambda: tmp_path / "cache")  # the toy model stays where it is
    return tmp_path / "cache"


def test_a_model_scored_twice_is_paired_with_itself_and_the_second_score_is_kept(toy_model_path, tmp_path, cache,
                                                                                capsys):
    out = tmp_path / "report.json"
    assert main(["eval", toy_model_path, toy_model_path, "--precision", "fp32", "--set", "eval.size=12",
                 "--set", "sampling.max_tokens=8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    judged, other = report["models"]
    assert report["precision"] == "fp32" and judged["result"]["rows"] == 12
    assert not judged["result"]["reused"] and other["result"]["reused"]  # same weights, rows, settings: cached
    assert judged["result"]["rows_right"] == other["result"]["rows_right"]
    right = len(judged["result"]["rows_right"])
    assert other["paired"]["strict"].startswith(f"{right}/12 -> {right}/12 (+0.0 points): 0 rows gained, 0 lost")
    assert "pass@1" in capsys.readouterr().out


def test_a_model_that_is_not_there_is_one_line_naming_it(tmp_path, cache, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["eval", str(missing), "--set", "eval.dataset=mawps:singleeq", "--set", "task.type=math",
                 "--set", "task.dataset=mawps:singleop"]) == 2
    err = capsys.readouterr().err
    assert f"{missing}: no such directory" in err and "Traceback" not in err


def test_a_runs_last_checkpoint_is_exported_and_scored_against_the_model_given(redis_server, toy_model_path, tmp_path,
                                                                               cache):
    from launch.evaluate import score_exported
    from tests.test_learner import for_run, make_learner, synthetic_groups
    from learner.policy import load_policy

    learner = make_learner(redis_server, toy_model_path, tmp_path, steps=1, workers=1, **{
        "learner.groups_per_step": 2, "learner.ppo_epochs": 1, "sync.join_timeout_s": 0.1, "sampling.n": 4,
        "learner.lr": 3e-3, "eval.size": 12, "sampling.max_tokens": 8, "rollout.precision": "fp32"})
    for rec in for_run(synthetic_groups(load_policy(toy_model_path), 2, seed=3, precisions=("fp32",)), learner.cfg):
        learner.queue.push(rec)
    learner.run()
    lines = score_exported(learner.cfg, tmp_path, print)
    assert "eval_exported_error" not in lines, lines
    assert (tmp_path / "exported" / "rlpipe_export.json").is_file()
    assert lines["eval_exported_of"].endswith("both at fp32") and "over 12 rows" in lines["eval_exported_pass@1"]
    assert lines["eval_exported_paired_strict"].count("/12") == 2
    assert "eval_exported_error" in score_exported(learner.cfg, tmp_path / "no-run", print)  # a line, not a raise
