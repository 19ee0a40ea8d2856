"""The learner's rows reach the experiment trackers under the names of ``metrics.jsonl``,
grouped as ``train/``, ``rollout/`` and ``sync/``, and the user's tracker settings
(``learner.wandb``, ``learner.mlflow``) reach the trackers' construction.

TensorBoard is read back from its event files. W&B (offline) and MLflow (local store) are
optional extras, tested only where they are installed (not in CI, where they would add
hundreds of MB).
"""

from __future__ import annotations

import json

import pytest

from learner.metrics import LearnerMetrics, flatten, mlflow_tracking_uri, tracker_names, wandb_init_kwargs
from rlpipe.config import build_config

ROWS = [{"step": s, "reward_mean": 0.1 * s, "learner_lr": 1e-4, "converged": False, "queue_depth": 3,
         "weight_sync_transfer_seconds": 0.5, "mismatch_by_precision": {"int8": {"mismatch_kl": 0.01 * s}}}
        for s in (1, 2, 3)]


def test_flatten_joins_nested_keys_and_keeps_only_numbers():
    assert flatten({"a": 1, "b": {"c": 2.5, "d": "x"}, "e": True}) == {"a": 1.0, "b/c": 2.5}


def test_tracker_names_group_every_key_as_train_rollout_or_sync():
    assert tracker_names(ROWS[0]) == {"train/reward_mean": pytest.approx(0.1), "train/learner_lr": 1e-4,
                                      "rollout/queue_depth": 3.0, "sync/weight_sync_transfer_seconds": 0.5,
                                      "train/mismatch_by_precision/int8/mismatch_kl": pytest.approx(0.01)}


def test_tracker_settings_from_the_config_reach_the_trackers(tmp_path):
    cfg = build_config({"learner": {"wandb": {"project": "team-rl", "entity": "lab", "mode": "online"}}},
                       environ={"RLPIPE_LEARNER__MLFLOW__TRACKING_URI": "http://mlflow.lab:5000"})
    kwargs = wandb_init_kwargs(cfg.learner.wandb, tmp_path, "run-1", {"seed": 0})
    assert {k: kwargs[k] for k in ("project", "entity", "mode", "name")} == \
        {"project": "team-rl", "entity": "lab", "mode": "online", "name": "run-1"}
    assert mlflow_tracking_uri(cfg.learner.mlflow, tmp_path) == "http://mlflow.lab:5000"
    # the defaults send nothing anywhere: W&B offline, MLflow in the run directory
    default = build_config({}, environ={}).learner
    assert wandb_init_kwargs(default.wandb, tmp_path, "r", {})["mode"] == "offline"
    assert wandb_init_kwargs(default.wandb, tmp_path, "r", {})["entity"] is None
    assert mlflow_tracking_uri(default.mlflow, tmp_path) == (tmp_path / "mlruns").as_uri()


def test_a_bad_tracker_setting_is_refused_naming_the_key():
    from rlpipe.config import ConfigError

    with pytest.raises(ConfigError, match=r"learner\.wandb\.mode"):
        build_config({"learner": {"wandb": {"mode": "upload"}}}, environ={})


def test_tensorboard_events_hold_every_step_under_the_jsonl_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = LearnerMetrics(tmp_path / "metrics.jsonl", trackers=["tensorboard"], run_name="t")
    for row in ROWS:
        metrics.record(row)
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for group, name in (("train", "reward_mean"), ("train", "learner_lr"), ("rollout", "queue_depth"),
                        ("sync", "weight_sync_transfer_seconds"), ("train", "mismatch_by_precision/int8/mismatch_kl")):
        scalars = events.Scalars(f"{group}/{name}")
        assert [e.step for e in scalars] == [1, 2, 3]
        want = [flatten(row)[name] for row in jsonl]
        assert [e.value for e in scalars] == pytest.approx(want, rel=1e-6)
    assert not {"train/converged", "train/step"} & set(events.Tags()["scalars"])


def test_mlflow_store_of_the_configured_uri_holds_every_step(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    from rlpipe.config import MlflowConfig

    settings = MlflowConfig(tracking_uri=(tmp_path / "team-store").as_uri(), experiment="team-rl")
    metrics = LearnerMetrics(tmp_path / "metrics.jsonl", trackers=["mlflow"], run_name="t", mlflow=settings)
    for row in ROWS:
        metrics.record(row)
    metrics.close()
    client = mlflow.MlflowClient(tracking_uri=settings.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("team-rl").experiment_id])[0]
    history = client.get_metric_history(run.info.run_id, "train/mismatch_by_precision/int8/mismatch_kl")
    assert [(m.step, m.value) for m in history] == [(1, pytest.approx(0.01)), (2, pytest.approx(0.02)),
                                                     (3, pytest.approx(0.03))]


def test_wandb_offline_run_is_written(tmp_path):
    pytest.importorskip("wandb")
    from rlpipe.config import WandbConfig

    metrics = LearnerMetrics(tmp_path / "metrics.jsonl", trackers=["wandb"], run_name="t",
                             wandb=WandbConfig(project="team-rl"))
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
