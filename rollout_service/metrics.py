"""Prometheus metrics of a rollout worker (names from docs/design.md, prefix ``rlpipe_``); every
series carries ``run_id`` (rlpipe/prom.py)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, ProcessCollector

from rlpipe.prom import SYNC_BUCKETS, RunRegistry, run_info


class VllmSeries:
    """vLLM's own series (``vllm:*``, in prometheus_client's default registry, where its stat logger
    registers them), served through the worker's registry so they carry run_id (``rollout.vllm_metrics``)."""

    def collect(self):
        from prometheus_client import REGISTRY

        return [m for m in REGISTRY.collect() if m.name.startswith("vllm:")]

    def describe(self):
        return []  # unknown until the engine runs: no name is reserved at registration


class RolloutMetrics:
    def __init__(self, worker_id: str, precision: str, run_id: str = "", model: str = "", vllm: bool = False):
        self.registry = RunRegistry(run_id)
        if vllm:
            self.registry.register(VllmSeries())
        labels = {"worker": worker_id, "precision": precision}
        r = self.registry
        run_info(r, role="rollout", model=model, **labels)

        def counter(name, doc):
            return Counter(f"rlpipe_{name}", doc, list(labels), registry=r).labels(**labels)

        def gauge(name, doc):
            return Gauge(f"rlpipe_{name}", doc, list(labels), registry=r).labels(**labels)

        self.tokens = counter("rollout_tokens", "response tokens generated")
        self.groups = counter("rollout_groups", "groups pushed to the stream")
        self.generate_seconds = Histogram(
            "rlpipe_rollout_generate_seconds", "wall time to generate one group", list(labels),
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r).labels(**labels)
        ProcessCollector(registry=r)  # process_start_time_seconds: restarts show as its changes
        self.ready = gauge("rollout_ready", "1 while /readyz answers 200 (alerts: no workers ready)")
        self.version = gauge("rollout_policy_version", "weights version in the engine")
        self.paused_seconds = counter("rollout_paused_seconds", "time generation was paused for weight updates")
        self.inflight = gauge("rollout_inflight_groups", "groups being generated now")
        self.backpressure_waits = counter("rollout_backpressure_waits", "times a free slot waited for the learner")
        self.idle_seconds = counter("rollout_idle_seconds", "time with no group in flight while serving "
                                    "(held by back-pressure or waiting for weights)")
        self.sync_seconds = Histogram(
            "rlpipe_weight_sync_seconds", "weight update time on the worker, by phase", list(labels) + ["phase"],
            buckets=SYNC_BUCKETS, registry=r)
        self.sync_pause_seconds = Histogram(
            "rlpipe_weight_sync_pause_seconds", "generation pause per weight update", list(labels),
            buckets=SYNC_BUCKETS, registry=r).labels(**labels)
        self.prompts_given_back = counter("rollout_prompts_given_back", "prompts returned to the cursor unfinished")
        self.prompts_skipped = counter("rollout_prompts_skipped", "prompts skipped: too long, or failed twice here")
        self.prompts_dead = counter("rollout_prompts_dead", "prompts dead-lettered: their reward or environment "
                                    "failed on them queue.max_deliveries times")
        self.reward_errors = counter("rollout_reward_errors", "groups whose rewards could not be computed")
        self.requests_rejected = Counter("rlpipe_http_rejected", "API requests refused, by status code",
                                         list(labels) + ["code"], registry=r)
        self.generation = gauge("weight_sync_generation", "sync generation this worker last joined")
        self.sync_failures = counter("weight_sync_failures", "weight updates that failed (previous weights kept)")
        # Sessions (rollout_service/sessions.py): multi-turn episodes driven through the API.
        self.sessions_open = gauge("sessions_open", "sessions open on this worker")
        self.sessions_finished = counter("sessions_finished", "sessions closed with their episode handed back")
        self.sessions_expired = counter("sessions_expired", "sessions given back after rollout.session_idle_timeout_s")
        self.sessions_refused = Counter("rlpipe_sessions_refused", "session requests refused by a limit, by its "
                                        "config key", list(labels) + ["limit"], registry=r)
        self.session_turns = Histogram(
            "rlpipe_session_turns", "model turns per finished episode", list(labels),
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r).labels(**labels)
        self.session_context_tokens = counter("session_context_tokens", "tokens appended to sessions as context "
                                              "(messages, template markers): masked out of the loss")
        self.environment_seconds = Histogram(
            "rlpipe_rollout_environment_seconds", "time in one environment step (reset or step) of an episode",
            list(labels), buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10), registry=r).labels(**labels)
        self.session_stores: list = []  # the open gauge counts them all (the API's, the rollout loop's)
        self.labels = labels
