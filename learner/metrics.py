"""Where the learner's per-step numbers go: Prometheus gauges and ``metrics.jsonl``.

Every metric of a step is one key of a flat dict; the dict becomes one JSON line and
every key whose name DESIGN.md lists is also exported as ``rlpipe_<name>``.
"""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

EXPORTED = (
    "learner_step", "learner_version", "learner_step_seconds", "learner_tokens_per_second", "learner_loss",
    "learner_grad_norm", "learner_lr", "reward_mean", "response_length_mean", "entropy",
    "mismatch_kl", "mismatch_k3_kl", "is_weight_mean", "is_weight_max", "is_truncated_fraction",
    "queue_depth", "queue_pending",
)


class LearnerMetrics:
    def __init__(self, jsonl_path: str | Path | None):
        self.path = Path(jsonl_path) if jsonl_path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.registry = CollectorRegistry()
        self.gauges = {name: Gauge(f"rlpipe_{name}", name.replace("_", " "), registry=self.registry) for name in EXPORTED}
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

    def record(self, step_metrics: dict) -> None:
        for name, gauge in self.gauges.items():
            if name in step_metrics:
                gauge.set(step_metrics[name])
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(step_metrics) + "\n")


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
