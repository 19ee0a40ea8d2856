"""The learner's rows reach the experiment trackers under the names of ``metrics.jsonl``.

TensorBoard is read back from its event files. W&B (offline) and MLflow (local store) are
optional extras, tested only where they are installed (not in CI, where they would add
hundreds of MB).
"""

from __future__ import annotations

import json

import pytest

from learner.metrics import LearnerMetrics, flatten

ROWS = [{"step": s, "reward_mean": 0.1 * s, "learner_lr": 1e-4, "converged": False,
         "mismatch_by_precision": {"int8": {"mismatch_kl": 0.01 * s}}} for s in (1, 2, 3)]


def test_flatten_joins_nested_keys_and_keeps_only_numbers():
    assert flatten({"a": 1, "b": {"c": 2.5, "d": "x"}, "e": True}) == {"a": 1.0, "b/c": 2.5}


def test_tensorboard_events_hold_every_step_under_the_jsonl_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = LearnerMetrics(tmp_path / "metrics.jsonl", trackers=["tensorboard"], run_name="t")
    for row in ROWS:
        metrics.record(row)
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for name in ("reward_mean", "learner_lr", "mismatch_by_precision/int8/mismatch_kl"):
        scalars = events.Scalars(name)
        assert [e.step for e in scalars] == [1, 2, 3]
        want = [flatten(row)[name] for row in jsonl]
        assert [e.value for e in scalars] == pytest.approx(want, rel=1e-6)
    assert "converged" not in events.Tags()["scalars"]


def test_mlflow_local_store_holds_every_step(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    metrics = LearnerMetrics(tmp_path / "metrics.jsonl", trackers=["mlflow"], run_name="t")
    for row in ROWS:
        metrics.record(row)
    metrics.close()
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.search_runs([client.get_experiment_by_name("rlpipe").experiment_id])[0]
    history = client.get_metric_history(run.info.run_id, "mismatch_by_precision/int8/mismatch_kl")
    assert [(m.step, m.value) for m in history] == [(1, pytest.approx(0.01)), (2, pytest.approx(0.02)),
                                                     (3, pytest.approx(0.03))]


def test_wandb_offline_run_is_written(tmp_path):
    pytest.importorskip("wandb")
    metrics = LearnerMetrics(tmp_path / "metrics.jsonl", trackers=["wandb"], run_name="t")
    for row in ROWS:
        metrics.record(row)
    metrics.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_a_tracker_that_is_not_installed_is_named_in_the_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mlflow(name, *args, **kwargs):
        if name == "mlflow":
            raise ImportError("no mlflow", name="mlflow")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    with pytest.raises(RuntimeError, match=r"learner.trackers: mlflow is not installed.*rlpipe\[mlflow\]"):
        LearnerMetrics(tmp_path / "metrics.jsonl", trackers=["mlflow"])
