"""The Prometheus registry every role serves on ``/metrics``: each series carries ``run_id``.

Two runs scraped by one Prometheus (or one run's series next to an older run's) stay apart,
and the dashboard's ``run`` variable selects one. The label is added when the registry is
collected, so it reaches every collector registered on it, the process collector's
``process_*`` series included, without each metric declaring it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

RUN_LABEL = "run_id"


class RunRegistry(CollectorRegistry):
    """A :class:`CollectorRegistry` that adds ``run_id="<run>"`` to every sample it yields."""

    def __init__(self, run_id: str):
        super().__init__()
        self.run_id = run_id

    def collect(self):
        for metric in super().collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [s._replace(labels={RUN_LABEL: self.run_id, **s.labels}) for s in metric.samples]
            yield labelled
