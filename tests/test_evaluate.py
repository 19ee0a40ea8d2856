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
