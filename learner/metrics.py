"""Where the learner's per-step numbers go: Prometheus and ``metrics.jsonl``.

Every metric of a step is one key of a flat dict (a few values are small dicts). The
dict becomes one JSON line, and every numeric key is exported as ``rlpipe_<key>`` (names
from docs/design.md): a gauge, or a counter for a ``_total`` key (a count that only grows, which
the counter follows by its increments). :data:`METRICS` says what each key means (the HELP
text) and which tracker group it belongs to. The mismatch metrics of each rollout precision
are gauges with a ``precision`` label (``rlpipe_mismatch_kl_by_precision{precision="fp8"}``),
and the LR schedule's state is exported as ``rlpipe_lr_schedule_*``. Every series carries
``run_id`` (rlpipe/prom.py).

The same rows can go to the experiment trackers users already read (``learner.trackers``):
TensorBoard event files in ``<run_dir>/tensorboard``; W&B under ``learner.wandb``'s project,
entity and mode (offline by default, in ``<run_dir>/wandb``; ``wandb sync`` uploads it later);
MLflow at ``learner.mlflow.tracking_uri`` (by default a local file store in ``<run_dir>/mlruns``).
Tracker names are the JSON keys under their group, ``train/``, ``rollout/`` or ``sync/``; a
nested value's keys are joined with ``/`` (``train/mismatch_by_precision/int8/mismatch_kl``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram, ProcessCollector

from rlpipe.config import MlflowConfig, WandbConfig
from rlpipe.prom import SYNC_BUCKETS, RunRegistry, run_info

# Keys not exported from the row: those with their own collectors (counters counted where
# they happen, the sync-time histogram), each worker's own (rollout_idle_seconds_total is every
# worker's rlpipe_rollout_idle_seconds_total summed), one a counter already says
# (learner_skipped_steps is the step's increase of rlpipe_learner_skipped_steps_total, and
# would collide with that counter's name) and bookkeeping.
NOT_EXPORTED = {"step", "time", "dropped_stale_total", "queue_dead_total", "weight_sync_seconds",
                "rollout_idle_seconds_total", "learner_skipped_steps"}

_TRAIN = {
    "reward_mean": "mean reward of the step's samples",
    "response_length_mean": "mean response length of the step's samples, in model tokens (an episode's "
                            "environment tokens not counted)",
    "entropy": "mean token entropy of the training policy on the step's responses",
    "learner_loss": "loss of the step (policy loss, plus any KL term, less any entropy bonus), averaged over its "
                    "optimizer updates",
    "learner_grad_norm": "gradient norm before clipping, mean over the step's optimizer updates",
    "learner_grad_norm_max": "largest gradient norm of the step's optimizer updates",
    "learner_grad_norm_smoothed": "exponential moving average of the gradient norm (learner.grad_norm_ema)",
    "learner_lr": "learning rate of the step",
    "learner_loss_scale": "fp16 dynamic loss scale (constant for other dtypes)",
    "learner_served_visible_fraction": "bf16/fp16 rollout: fraction of weights whose value as the engines hold "
                                       "them (rounded) the step's update changed",
    "learner_skipped_steps": "optimizer updates of the step skipped for non-finite gradients",
    "learner_skipped_steps_total": "optimizer updates skipped for non-finite gradients in the run",
    "groups": "groups trained in the step",
    "groups_skipped_equal_reward": "groups of the step with equal rewards (no advantage, no gradient)",
    "groups_skipped_total": "groups with equal rewards (no gradient) in the run",
    "groups_filtered_step": "dynamic sampling: groups with equal rewards settled untrained while the step's batch "
                            "was collected",
    "groups_filtered_total": "dynamic sampling: groups with equal rewards settled untrained in the run",
    "informative_fraction": "of the groups the step read, the fraction whose rewards differ (trained / sampled)",
    "groups_sampled_per_trained": "groups the step read per group it trained (1 / informative_fraction)",
    "sample_ratio_smoothed": "groups sampled per group trained, smoothed: the factor of the fleet's allowance",
    "reward_sampled_mean": "mean reward of every sample the step read, filtered groups included (reward_mean is "
                           "of the trained groups, which dynamic sampling picks for their spread)",
    "tokens": "response tokens trained in the step (model tokens only)",
    "tokens_masked": "environment tokens of the step's multi-turn episodes: context only, masked out of the loss",
    "model_turns_mean": "the model's turns per sample of the step (1 when single-turn; in the calculator task, 1 "
                        "plus the tool calls)",
    "learner_step": "optimizer steps trained",
    "learner_version": "policy version of the learner's weights",
    "learner_step_seconds": "wall time of the last step once its groups were in: training, weight sync and "
                            "checkpointing (learner_wait_seconds is the wait before)",
    "learner_wait_seconds": "time the last step waited for groups",
    "learner_train_seconds": "time the last step spent training",
    "learner_tokens_per_second": "response tokens trained per second of training time in the last step",
    "learner_ranks": "learner processes (data-parallel ranks)",
    "learner_start_to_first_step_seconds": "time from this learner process's start to its first trained step",
    "trained_groups_total": "groups trained in the run (restored from the checkpoint on restart)",
    "checkpoint_step": "step of the last durable checkpoint",
    "checkpoint_blocking_seconds": "time the last step was blocked by checkpointing (snapshot and waiting)",
    "ppo_clip_fraction": "fraction of tokens where the PPO clip was active",
    "tool_nll": "learner.tool_imitation only: mean negative log-likelihood of the tokens the in-turn tool "
                "wrote into the trained answers",
    "ppo_ratio_mean": "mean PPO ratio of the training policy to the step's old policy",
    "cispo_clip_fraction": "loss cispo: fraction of tokens whose importance-ratio weight was clipped",
    "score_centering_drift": "learner.score_centering_k only: mean over tokens of sum |c_v| over the sampler's top-k, "
                             "the centering coefficients (0 when the sampler matches the training policy)",
    "score_centering_term": "learner.score_centering_k only: mean per-token value of the centering term A sum_H c_v "
                            "log p_v added to the loss",
    "score_centering_head_mass": "learner.score_centering_k only: mean sampler probability mass of the top-k "
                                 "candidates the records carry",
    "score_centering_rho": "learner.score_centering_k only: mean ratio of the sampler's tail mass to the training "
                           "policy's outside the top-k (rho)",
    "distill_reverse_kl": "learner.teacher only: mean per-token reverse KL of the student against the teacher on "
                          "the student's samples, log mu(y) - log teacher(y) (k1; the distillation signal), before "
                          "the update",
    "distill_k3": "learner.teacher only: the same KL's k3 estimate per token (never negative, lower variance)",
    "kl_ref": "mean per-token KL estimate of the policy against the frozen reference model (learner.kl_coef > 0)",
    "kl_loss": "KL penalty of the step: its loss term (kl_in loss) or mean reward penalty per sample (kl_in reward)",
    "mismatch_kl": "k1 estimate of KL(rollout || training policy) per token (can dip below 0)",
    "retokenized_changed_tokens": "learner.retokenize only: tokens of the step's re-tokenized answers that are not "
                                  "the sampled ids",
    "mismatch_kl_fresh": "mismatch_kl over the groups sampled by the current version only (no policy lag)",
    "mismatch_k3_after_tool": "mismatch_k3_kl on the first sampled token after a tool's tokens in an answer "
                              "(an in-turn tool only)",
    "mismatch_seq_kl": "k1 estimate of KL(rollout || training policy) per sequence",
    "mismatch_k3_kl": "k3 estimate of KL(rollout || training policy) per token (never negative)",
    "mismatch_chi2_token": "chi-squared divergence per token of the training policy against the rollout's",
    "mismatch_chi2_seq": "chi-squared divergence per sequence of the training policy against the rollout's",
    "mismatch_log_ppl_train": "log perplexity of the responses under the training policy",
    "mismatch_log_ppl_rollout": "log perplexity of the responses under the rollout policy",
    "mismatch_log_ppl_abs_diff": "mean absolute difference of the two log perplexities per sequence",
    "mismatch_ppl_ratio": "mean ratio of training to rollout perplexity per sequence",
    "mismatch_prob_diff_max": "largest token probability difference between training and rollout policy",
    "mismatch_prob_diff_mean": "mean token probability difference between training and rollout policy",
    "is_weight_mean": "mean importance weight per token after truncation or masking",
    "is_weight_max": "largest importance weight of the step",
    "is_ess": "effective sample size of the token importance weights, as a fraction",
    "is_ess_seq": "effective sample size of the sequence importance weights, as a fraction",
    "is_truncated_fraction": "fraction of tokens whose importance weight was truncated",
    "is_truncated_seq_fraction": "fraction of sequences with a truncated importance weight",
    "is_masked_fraction": "fraction of tokens masked out by the importance-weight rule",
    "is_masked_seq_fraction": "fraction of sequences masked out by the importance-weight rule",
    "routing_agreement": "rollout.routing_replay: share of (token, MoE layer) pairs where the learner's own router "
                         "chose the engine's top-k experts (rank 0's forwards of the step)",
    "routing_agreement_by_layer": "routing_agreement per MoE layer (label layer)",
    "router_load_max": "MoE: the busiest expert's share of its layer's top-k assignments, in even shares "
                       "(1 balanced, experts/top_k all on the same experts), the worst layer's, over the step's "
                       "forwards",
    "router_load_max_by_layer": "router_load_max per MoE layer (label layer)",
    "router_aux_loss": "MoE: the model's load-balancing loss as transformers computes it, over the step's forwards "
                       "(not added to the learner's loss)",
}
_ROLLOUT = {
    "staleness_mean": "mean versions between sampling and training of the step's groups",
    "staleness_max": "most versions between sampling and training of the step's groups",
    "dropped_stale_step": "groups dropped as too stale while collecting the step",
    "trained_groups_by_precision_total": "groups trained in the current weights' lineage, per rollout precision "
                                         "(a mixed fleet's share of the batches)",
    "dropped_stale_by_precision_total": "groups dropped as too stale, per rollout precision",
    "staleness_by_precision": "mean and most versions between sampling and training of the step's groups, "
                              "per rollout precision (a slow precision's groups are the staler)",
    "queue_depth": "entries in the trajectory stream",
    "queue_pending": "stream entries read by the learner and not yet acknowledged (until a checkpoint)",
    "produced_total": "groups pushed to the trajectory stream in the run",
    "rollout_workers": "rollout workers alive in the registry",
    "fleet_desired_workers": "rollout workers the autoscaling rule asks for (rlpipe/autoscale.py): what "
                             "`rlpipe up --autoscale` and the HorizontalPodAutoscaler scale to",
    "fleet_wait_fraction": "autoscaling input: fraction of the learner's time spent waiting for groups, over "
                           "the rule's window",
    "fleet_idle_fraction": "autoscaling input: fraction of the workers' time with no group in flight, over the "
                           "rule's window",
}
_SYNC = {
    "weight_sync_prepare_seconds": "sync phase prepare: time quantizing (int8, fp8) and packing the last step's "
                                   "weights on the learner",
    "weight_sync_pack_seconds": "time packing the last step's weights for the broadcast (part of prepare)",
    "weight_sync_transfer_seconds": "sync phase transfer: wall time sending the last step's weights that packing "
                                    "did not hide",
    "weight_sync_convergence_seconds": "sync phase convergence: seconds from the start of the sync of version "
                                       "weight_sync_converged_version until every worker it reached served it "
                                       "(weight_sync/convergence.py)",
    "weight_sync_pause_max_seconds": "sync phase pause: the longest activation pause (generation paused to load "
                                     "the weights) among the workers, for version weight_sync_converged_version",
    "weight_sync_converged_version": "the version the convergence and pause gauges are of (usually the previous "
                                     "step's)",
    "weight_sync_converged_workers": "workers counted in the convergence of weight_sync_converged_version",
    "weight_sync_form_seconds": "time forming sync generations in the last step",
    "weight_sync_members": "workers that received the last step's weights, all precisions",
    "weight_sync_sent_bytes": "bytes per worker the last step's sync put on the wire, all precisions (a delta's "
                         "changes, or the whole version)",
    "weight_sync_full_bytes": "bytes per worker of the last step's version whole, all precisions (what a sync "
                              "without deltas sends)",
    "weight_sync_deltas": "precisions whose last version went as a delta against the one before "
                          "(sync.delta_full_every)",
    "weight_sync_failed": "precisions whose weight sync failed in the last step",
    "weight_sync_generation": "sync generation the learner last formed",
    "weight_sync_left_out_total": "workers left out of a sync generation since this learner started",
    "quant_seconds": "time quantizing the last update's weights",
    "quant_monitor_seconds": "time the int8 monitors of update quant_monitor_step took (in the background "
                             "under quant.int8.monitor_background)",
    "quant_monitor_step": "the update the int8 monitor values of this step measured (an earlier one under "
                          "quant.int8.monitor_background)",
    "quant_monitor_skipped_total": "updates whose int8 monitors were skipped: the last ones still running",
    "quant_saturation_fraction": "fraction of int8 weights outside the profile's calibrated range",
    "quant_update_visible_fraction": "fraction of int8 weights the last update changed",
    "quant_act_clip_fraction": "fraction of int8 probe activations clipped",
    "quant_kl_vs_bf16": "next-token KL of the quantized policy against bf16 on the probe set",
    "quant_recalibrations_total": "int8 recalibrations since this learner started",
}
# metrics.jsonl key -> (tracker group, Prometheus HELP). The one place that says what a key is.
METRICS: dict[str, tuple[str, str]] = {**{k: ("train", h) for k, h in _TRAIN.items()},
                                       **{k: ("rollout", h) for k, h in _ROLLOUT.items()},
                                       **{k: ("sync", h) for k, h in _SYNC.items()}}
# Nested values, grouped by their top-level key; and the keys exported elsewhere.
GROUPS = {"groups_by_precision": "rollout", "reward_by_precision": "train", "staleness_hist": "rollout",
          "mismatch_by_precision": "train", "lr_schedule": "train", "weight_sync_by_precision": "sync",
          "quant_worst": "sync", "dropped_stale_total": "rollout", "queue_dead_total": "rollout",
          "rollout_idle_seconds_total": "rollout", "weight_sync_seconds": "sync"}
# (the *_by_precision_total and staleness_by_precision keys are nested too, described in _ROLLOUT)
LR_SCHEDULE_HELP = {"lr": "learning rate the schedule gives the next step",
                    "surge_step": "step of the last response-length surge the schedule reacted to",
                    "decay_period": "steps between the schedule's LR halvings",
                    "halvings": "LR halvings so far"}
BEFORE_RECALIBRATION = "_before_recalibration"
BY_PRECISION_TOTALS = ("trained_groups_by_precision_total", "dropped_stale_by_precision_total")


def describe(key: str) -> tuple[str, str]:
    """``(tracker group, HELP text)`` of a metrics.jsonl key."""
    if key.endswith(BEFORE_RECALIBRATION) and key.removesuffix(BEFORE_RECALIBRATION) in METRICS:
        group, text = METRICS[key.removesuffix(BEFORE_RECALIBRATION)]
        return group, f"{text}, before this step's recalibration"
    return METRICS.get(key) or (GROUPS.get(key, "train"), f"metrics.jsonl key {key} (learner/train.py)")


def flatten(row: dict, prefix: str = "") -> dict[str, float]:
    """The numeric values of a metrics row, nested keys joined with ``/``."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = float(value)
    return out


def tracker_names(row: dict) -> dict[str, float]:
    """The numeric values of a row under their trackers' names, ``<group>/<key>[/<nested key>]``."""
    return {f"{describe(name.split('/', 1)[0])[0]}/{name}": value
            for name, value in flatten({k: v for k, v in row.items() if k != "step"}).items()}


def wandb_init_kwargs(settings: WandbConfig, run_dir: Path, run_name: str, config: dict) -> dict:
    """What ``wandb.init`` is called with: the user's project, entity and mode."""
    return {"mode": settings.mode, "project": settings.project, "entity": settings.entity or None,
            "dir": str(run_dir), "name": run_name, "config": config}


def mlflow_tracking_uri(settings: MlflowConfig, run_dir: Path) -> str:
    """The user's tracking server, or a file store in the run directory."""
    return settings.tracking_uri or (run_dir / "mlruns").as_uri()


class Trackers:
    """TensorBoard, W&B and MLflow, each optional, fed the same rows."""

    def __init__(self, names: list[str], run_dir: Path, run_name: str, config: dict | None = None,
                 wandb: WandbConfig = WandbConfig(), mlflow: MlflowConfig = MlflowConfig()):
        settings = {"wandb": wandb, "mlflow": mlflow}
        self.sinks = []
        for name in names:
            try:
                self.sinks.append(getattr(self, f"_{name}")(run_dir, run_name or "rlpipe", config or {},
                                                            settings.get(name)))
            except ImportError as e:
                raise RuntimeError(f"learner.trackers: {name} is not installed ({e.name}); "
                                   f"`pip install rlpipe[{name}]`") from None

    @staticmethod
    def _tensorboard(run_dir, run_name, config, settings):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(run_dir / "tensorboard"))

        def log(step, values):
            for name, value in values.items():
                writer.add_scalar(name, value, step)
            writer.flush()

        return log, writer.close

    @staticmethod
    def _wandb(run_dir, run_name, config, settings):
        import wandb

        run = wandb.init(**wandb_init_kwargs(settings, run_dir, run_name, config))
        return (lambda step, values: run.log(values, step=step)), run.finish

    @staticmethod
    def _mlflow(run_dir, run_name, config, settings):
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=mlflow_tracking_uri(settings, run_dir))
        experiment = client.get_experiment_by_name(settings.experiment) or \
            client.get_experiment(client.create_experiment(settings.experiment))
        run_id = client.create_run(experiment.experiment_id, run_name=run_name).info.run_id

        def log(step, values):
            ts = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[mlflow.entities.Metric(k, v, ts, step) for k, v in values.items()])

        return log, (lambda: client.set_terminated(run_id))

    def log(self, step: int, row: dict) -> None:
        values = tracker_names(row)
        for log, _ in self.sinks:
            log(step, values)

    def close(self) -> None:
        for _, close in self.sinks:
            close()


class LearnerMetrics:
    def __init__(self, jsonl_path: str | Path | None, trackers: list[str] = (), run_name: str = "",
                 config: dict | None = None, wandb: WandbConfig = WandbConfig(), mlflow: MlflowConfig = MlflowConfig()):
        self.path = Path(jsonl_path) if jsonl_path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trackers = Trackers(list(trackers), self.path.parent, run_name, config, wandb, mlflow) \
            if trackers and self.path else None
        self.registry = RunRegistry(run_name)
        ProcessCollector(registry=self.registry)  # process_start_time_seconds: restarts show as its changes
        self.done = Gauge("rlpipe_learner_done", "1 once the learner has trained its configured steps "
                          "(a stalled-learner alert must not fire then)", registry=self.registry)
        self.series: dict[str, Gauge | Counter] = {}
        self.totals: dict[str, float] = {}  # each counter's last value, to increment it by the difference
        self.staleness = Histogram("rlpipe_staleness_versions", "versions between sampling and training, per group",
                                   buckets=(0, 1, 2, 3, 4, 6, 8, 16), registry=self.registry)
        self.dropped_stale = Counter("rlpipe_dropped_stale", "groups dropped as too stale", registry=self.registry)
        self.queue_dead = Counter("rlpipe_queue_dead", "malformed entries moved to the dead-letter stream",
                                  registry=self.registry)
        self.sync_seconds = Histogram("rlpipe_weight_sync_seconds", "learner-side weight sync time, by phase: "
                                      "prepare (quantize and pack), pack, transfer, convergence",
                                      ["phase"], buckets=SYNC_BUCKETS, registry=self.registry)
        # counters behind the step's rates, so a step shorter than a scrape still counts
        self.steps = Counter("rlpipe_learner_steps", "learner steps taken by this process", registry=self.registry)
        self.tokens = Counter("rlpipe_learner_tokens", "response tokens trained by this process",
                              registry=self.registry)
        self.step_duration = Histogram("rlpipe_learner_step_duration_seconds", "wall time of one learner step "
                                       "(waiting for groups, training and the weight sync)",
                                       buckets=(0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600), registry=self.registry)
        model = ((config or {}).get("model") or {}).get("path") or ""
        run_info(self.registry, role="learner", model=model)
        self.sync_bytes = Counter("rlpipe_weight_sync_bytes", "bytes broadcast to workers", registry=self.registry)
        self.sync_failures = Counter("rlpipe_weight_sync_failures", "syncs that failed (generation re-formed)",
                                     registry=self.registry)

    def _series(self, name: str, text: str, labels: tuple[str, ...] = ()) -> Gauge | Counter:
        if name not in self.series:
            kind = Counter if name.endswith("_total") else Gauge
            self.series[name] = kind(f"rlpipe_{name}", text, labels, registry=self.registry)
        return self.series[name]

    def _export(self, name: str, value: float, precision: str | None = None) -> None:
        """A gauge is set; a ``_total`` counter grows by the value's increase since the last row.
        (Its first row in this process adds the whole value: a run total restored from a
        checkpoint continues where the previous process left it, unless that process got past
        the checkpoint, which Prometheus reads as a counter reset.) ``precision``: the series
        of that rollout precision."""
        series = self._series(name, describe(name)[1], ("precision",) if precision else ())
        series, key = (series.labels(precision=precision), (name, precision)) if precision else (series, name)
        if isinstance(series, Counter):
            series.inc(max(value - self.totals.get(key, 0.0), 0.0))
            self.totals[key] = max(value, self.totals.get(key, 0.0))
        else:
            series.set(value)

    def set(self, **values: float) -> None:
        """Set gauges outside a step (at start: a restored learner shows its step at once)."""
        for name, value in values.items():
            self._export(name, value)

    def record(self, step_metrics: dict) -> None:
        self.steps.inc()
        self.tokens.inc(max(float(step_metrics.get("tokens") or 0), 0.0))
        if step_metrics.get("learner_step_seconds") is not None:
            self.step_duration.observe(float(step_metrics["learner_step_seconds"]))
        for name, value in step_metrics.items():
            if isinstance(value, bool) or name in NOT_EXPORTED:
                continue
            if isinstance(value, (int, float)):
                self._export(name, value)
        for key in ("mismatch_by_precision", "staleness_by_precision"):  # {precision: {name: value}}
            for precision, values in step_metrics.get(key, {}).items():
                for name, value in values.items():
                    gauge = self._series(f"{name}_by_precision", f"{describe(name)[1]}, per rollout precision",
                                         ("precision",))
                    gauge.labels(precision=precision).set(value)
        for name in ("routing_agreement_by_layer", "router_load_max_by_layer"):  # MoE layers, in order
            for layer, value in enumerate(step_metrics.get(name) or []):
                if value is not None:
                    self._series(name, describe(name)[1], ("layer",)).labels(layer=str(layer)).set(value)
        for name in BY_PRECISION_TOTALS:  # {precision: run total}: counters labelled by precision
            for precision, value in step_metrics.get(name, {}).items():
                self._export(name, value, precision)
        for name, value in step_metrics.get("lr_schedule", {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._series(f"lr_schedule_{name}", LR_SCHEDULE_HELP.get(name, f"LR schedule state {name}")).set(value)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(step_metrics) + "\n")
        if self.trackers:
            self.trackers.log(int(step_metrics.get("step", 0)), step_metrics)

    def record_eval(self, step: int, result: dict) -> None:
        """A held-out evaluation's result (learner/evals.py): a ``kind: eval`` row of metrics.jsonl,
        ``rlpipe_eval_accuracy{dataset,metric}`` and ``rlpipe_eval_version``, and the trackers."""
        accuracy = self._series("eval_accuracy", "held-out accuracy: pass@1 (greedy) and mean@k (sampled)",
                                ("dataset", "metric"))
        accuracy.labels(dataset=result["dataset"], metric="pass@1").set(result["pass_at_1"])
        if result.get("pass_at_1_lenient") is not None:  # any number of the answer right, not only the last
            accuracy.labels(dataset=result["dataset"], metric="pass@1_lenient").set(result["pass_at_1_lenient"])
        if result.get("mean_at_k") is not None:
            accuracy.labels(dataset=result["dataset"], metric=f"mean@{result['k']}").set(result["mean_at_k"])
        self._series("eval_version", "the policy version of the last held-out evaluation").set(result["version"])
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"kind": "eval", "logged_at_step": step, **result}) + "\n")
        if self.trackers:
            self.trackers.log(int(result["step"]), {f"eval_{k}": v for k, v in result.items()
                                                    if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def close(self) -> None:
        if self.trackers:
            self.trackers.close()


def read_jsonl(path: str | Path, kind: str = "step") -> list[dict]:
    """The rows of a metrics.jsonl of one kind: ``step`` (one per learner step, the default) or
    ``eval`` (one per held-out evaluation, learner/evals.py)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        if row.get("kind", "step") == kind:
            out.append(row)
    return out
