"""Where the learner's per-step numbers go: Prometheus and ``metrics.jsonl``.

Every metric of a step is one key of a flat dict (a few values are small dicts). The
dict becomes one JSON line, and every numeric key is exported as the gauge
``rlpipe_<key>`` (names from DESIGN.md). The mismatch metrics of each rollout precision
are gauges with a ``precision`` label (``rlpipe_mismatch_kl_by_precision{precision="fp8"}``),
and the LR schedule's state is exported as ``rlpipe_lr_schedule_*``.

The same rows can go to the experiment trackers users already read (``learner.trackers``):
TensorBoard event files in ``<run_dir>/tensorboard``, W&B in offline mode in
``<run_dir>/wandb`` (``wandb sync`` uploads it later), MLflow with a local file store in
``<run_dir>/mlruns``. Metric names are the JSON keys; a nested value's keys are joined with
``/`` (``mismatch_by_precision/int8/mismatch_kl``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

# Keys that are not gauges: counters exported by their own collectors, and bookkeeping.
# (rollout_idle_seconds_total is each worker's own counter rlpipe_rollout_idle_seconds_total.)
NOT_GAUGES = {"step", "time", "dropped_stale_total", "queue_dead_total", "weight_sync_seconds",
              "rollout_idle_seconds_total"}


def flatten(row: dict, prefix: str = "") -> dict[str, float]:
    """The numeric values of a metrics row, nested keys joined with ``/``."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = float(value)
    return out


class Trackers:
    """TensorBoard, W&B (offline) and MLflow (local store), each optional, fed the same rows."""

    def __init__(self, names: list[str], run_dir: Path, run_name: str, config: dict | None = None):
        self.sinks = []
        for name in names:
            try:
                self.sinks.append(getattr(self, f"_{name}")(run_dir, run_name or "rlpipe", config or {}))
            except ImportError as e:
                raise RuntimeError(f"learner.trackers: {name} is not installed ({e.name}); "
                                   f"`pip install rlpipe[{name}]`") from None

    @staticmethod
    def _tensorboard(run_dir, run_name, config):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(run_dir / "tensorboard"))

        def log(step, values):
            for name, value in values.items():
                writer.add_scalar(name, value, step)
            writer.flush()

        return log, writer.close

    @staticmethod
    def _wandb(run_dir, run_name, config):
        import wandb

        run = wandb.init(mode="offline", dir=str(run_dir), project="rlpipe", name=run_name, config=config)
        return (lambda step, values: run.log(values, step=step)), run.finish

    @staticmethod
    def _mlflow(run_dir, run_name, config):
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
        experiment = client.get_experiment_by_name("rlpipe") or client.get_experiment(client.create_experiment("rlpipe"))
        run_id = client.create_run(experiment.experiment_id, run_name=run_name).info.run_id

        def log(step, values):
            ts = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[mlflow.entities.Metric(k, v, ts, step) for k, v in values.items()])

        return log, (lambda: client.set_terminated(run_id))

    def log(self, step: int, row: dict) -> None:
        values = flatten(row)
        for log, _ in self.sinks:
            log(step, values)

    def close(self) -> None:
        for _, close in self.sinks:
            close()


class LearnerMetrics:
    def __init__(self, jsonl_path: str | Path | None, trackers: list[str] = (), run_name: str = "",
                 config: dict | None = None):
        self.path = Path(jsonl_path) if jsonl_path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trackers = Trackers(list(trackers), self.path.parent, run_name, config) if trackers and self.path \
            else None
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_start_time_seconds: restarts show as its changes
        self.done = Gauge("rlpipe_learner_done", "1 once the learner has trained its configured steps "
                          "(a stalled-learner alert must not fire then)", registry=self.registry)
        self.gauges: dict[str, Gauge] = {}
        self.by_precision: dict[str, Gauge] = {}
        self.staleness = Histogram("rlpipe_staleness_versions", "versions between sampling and training, per group",
                                   buckets=(0, 1, 2, 3, 4, 6, 8, 16), registry=self.registry)
        self.dropped_stale = Counter("rlpipe_dropped_stale", "groups dropped as too stale", registry=self.registry)
        self.queue_dead = Counter("rlpipe_queue_dead", "malformed entries moved to the dead-letter stream",
                                  registry=self.registry)
        self.sync_seconds = Histogram("rlpipe_weight_sync_seconds", "learner-side weight sync time, by phase",
                                      ["phase"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                      registry=self.registry)
        self.sync_bytes = Counter("rlpipe_weight_sync_bytes", "bytes broadcast to workers", registry=self.registry)
        self.sync_failures = Counter("rlpipe_weight_sync_failures", "syncs that failed (generation re-formed)",
                                     registry=self.registry)

    def _gauge(self, name: str, labels: tuple[str, ...] = ()) -> Gauge:
        table = self.by_precision if labels else self.gauges
        if name not in table:
            table[name] = Gauge(f"rlpipe_{name}", name.replace("_", " "), labels, registry=self.registry)
        return table[name]

    def set(self, **values: float) -> None:
        """Set gauges outside a step (at start: a restored learner shows its step at once)."""
        for name, value in values.items():
            self._gauge(name).set(value)

    def record(self, step_metrics: dict) -> None:
        for name, value in step_metrics.items():
            if isinstance(value, bool) or name in NOT_GAUGES:
                continue
            if isinstance(value, (int, float)):
                self._gauge(name).set(value)
        for precision, values in step_metrics.get("mismatch_by_precision", {}).items():
            for name, value in values.items():
                self._gauge(f"{name}_by_precision", ("precision",)).labels(precision=precision).set(value)
        for name, value in step_metrics.get("lr_schedule", {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._gauge(f"lr_schedule_{name}").set(value)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(step_metrics) + "\n")
        if self.trackers:
            self.trackers.log(int(step_metrics.get("step", 0)), step_metrics)


    def close(self) -> None:
        if self.trackers:
            self.trackers.close()


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return out
