"""The learner: consume groups, take a PPO step with mismatch correction, sync weights.

Read top to bottom, one learner step is:

    collect   XREADGROUP until ``groups_per_step`` fresh groups (too-stale ones are dropped and counted)
    score     GRPO advantages per group; groups with all-equal rewards carry no signal and are skipped
    recompute pi_old with the training policy (no grad); mismatch metrics and IS weights vs mu
    update    ppo_epochs x minibatches AdamW steps on the PPO-clip loss, token-mean
    publish   version += 1, broadcast the weights to every live worker
    ack       XACK + XDEL the consumed entries, counted as trained

Run it with ``rlpipe learner --config run.yaml``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from learner.batch import Batch, collate
from learner.loss import group_advantages, importance_weights, masked_mean, mismatch_metrics, ppo_clip_loss
from learner.metrics import LearnerMetrics
from learner.policy import load_policy, token_logprobs
from quant.profiles import profile_for
from rlpipe import registry
from rlpipe.config import RunConfig
from rlpipe.queue import Entry, TrajectoryQueue, connect
from weight_sync.manifest import DTYPES
from weight_sync.sender import WeightSender
from weight_sync.transport import SyncError

log = logging.getLogger(__name__)


class Learner:
    consumer = "learner-0"

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        lc = cfg.learner
        if lc.threads:
            torch.set_num_threads(lc.threads)
        torch.manual_seed(cfg.seed)
        self.r = connect(cfg.redis_url)
        self.queue = TrajectoryQueue(self.r, cfg.run_id)
        self.keys = self.queue.keys
        self.model = load_policy(cfg.model.path, lc.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay)
        self.sender = WeightSender(
            self.r, self.keys, cfg.sync.host, cfg.sync.timeout_s, cfg.sync.join_timeout_s,
            cfg.sync.bucket_mib << 20, DTYPES[profile_for(cfg.rollout.precision).wire_dtype])
        run_dir = Path(cfg.run_dir) if cfg.run_dir else None
        self.metrics = LearnerMetrics(run_dir / "metrics.jsonl" if run_dir else None)
        self.step = 0
        self.version = 0
        self.dropped_stale_total = 0
        self.dead_seen = 0
        self.last_metrics: dict = {}
        self.status = "starting"
        self.started_at = time.time()
        self._monotonic_start = time.monotonic()
        self._backlog: list[Entry] = []
        self._last_membership_check = 0.0

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        self.queue.ensure_consumer_group()
        # Entries a previous learner read but never acknowledged are trained again
        # (at-least-once); the stream never loses them.
        self._backlog = self.queue.claim_pending(self.consumer, min_idle_ms=0)
        self._set_status("running")
        while self.step < self.cfg.steps:
            t_wait = time.perf_counter()
            entries = self.collect()
            t0 = time.perf_counter()
            step_metrics = self.train_step([e.record for e in entries])
            train_s = time.perf_counter() - t0
            self.step += 1
            self.version += 1
            step_metrics.update(self.sync_weights())
            self.queue.ack([e.entry_id for e in entries])
            step_metrics["learner_wait_seconds"] = t0 - t_wait
            step_metrics["learner_train_seconds"] = train_s
            self._finish_step(step_metrics, train_s, time.perf_counter() - t0)
        self._set_status("done")
        self.sender.drop()

    def collect(self) -> list[Entry]:
        """Block until ``groups_per_step`` groups fresh enough to train on are in hand."""
        want = self.cfg.learner.groups_per_step
        batch: list[Entry] = []
        while len(batch) < want:
            self.maybe_resync()
            if self._backlog:
                entries, self._backlog = self._backlog[: want - len(batch)], self._backlog[want - len(batch):]
            else:
                entries = self.queue.read(self.consumer, want - len(batch), self.cfg.learner.read_block_ms)
            stale, fresh = [], []
            for e in entries:
                too_old = self.version - e.record.policy_version > self.cfg.queue.max_staleness
                (stale if too_old else fresh).append(e)
            if stale:
                self.queue.ack([], [e.entry_id for e in stale])
                self.dropped_stale_total += len(stale)
                self.metrics.dropped_stale.inc(len(stale))
                log.info("dropped %d groups older than %d versions", len(stale), self.cfg.queue.max_staleness)
            batch += fresh
        return batch

    def train_step(self, records) -> dict:
        lc = self.cfg.learner
        rewards = torch.tensor([r.rewards for r in records], dtype=torch.float32)  # (G, n)
        advantages = group_advantages(rewards, lc.adv_std_norm)
        batch = collate(records, advantages, self.version)
        for rec in records:
            self.metrics.staleness.observe(self.version - rec.policy_version)

        self.model.eval()  # no dropout: pi_old and pi must be the same function of the weights
        with torch.no_grad():
            pi_old, entropy = token_logprobs(self.model, batch)
        mu, mask = batch.behavior_logprobs, batch.mask
        weights, is_metrics = importance_weights(pi_old, mu, mask, lc.is_mode, lc.is_cap)

        # Groups whose rewards are all equal have zero advantage: they are skipped.
        informative = torch.nonzero(rewards.std(dim=1) > 0).squeeze(1)
        losses, grad_norms, ppo = [], [], {}
        if len(informative):
            for _epoch in range(lc.ppo_epochs):
                order = informative[torch.randperm(len(informative))]
                for groups in order.chunk(lc.minibatches):
                    rows = torch.nonzero(torch.isin(batch.group_index, groups)).squeeze(1)
                    mb: Batch = batch.select(rows)
                    pi, _ = token_logprobs(self.model, mb)
                    loss, ppo = ppo_clip_loss(pi, pi_old[rows], mb.advantages, mb.mask, weights[rows],
                                              lc.eps_low, lc.eps_high)
                    self.opt.zero_grad(set_to_none=True)
                    loss.backward()
                    grad_norms.append(torch.nn.utils.clip_grad_norm_(self.model.parameters(), lc.grad_clip).item())
                    self.opt.step()
                    losses.append(loss.item())
        lengths = mask.sum(1)
        return {
            "reward_mean": rewards.mean().item(),
            "response_length_mean": lengths.mean().item(),
            "entropy": masked_mean(entropy, mask).item(),
            "learner_loss": sum(losses) / len(losses) if losses else 0.0,
            "learner_grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
            "learner_lr": self.opt.param_groups[0]["lr"],
            "groups": len(records),
            "groups_by_precision": {p: sum(r.precision == p for r in records) for p in sorted({r.precision for r in records})},
            "groups_skipped_equal_reward": len(records) - len(informative),
            "tokens": batch.num_tokens,
            "staleness_mean": batch.staleness.float().mean().item(),
            "staleness_max": int(batch.staleness.max().item()),
            **mismatch_metrics(pi_old, mu, mask),
            **is_metrics,
            **ppo,
        }

    # -- weight sync ---------------------------------------------------------------------
    def live_workers(self) -> list[str]:
        return sorted(registry.live_workers(self.r, self.keys))

    def maybe_resync(self) -> None:
        """Bring newly joined (or departed) workers into a new generation while waiting."""
        now = time.monotonic()
        if now - self._last_membership_check < 0.5:
            return
        self._last_membership_check = now
        self._publish_state()
        live = self.live_workers()
        if self.sender.group is None and len(live) < self.cfg.workers \
                and time.monotonic() - self._monotonic_start < self.cfg.sync.join_timeout_s:
            # The first generation waits (up to join_timeout_s) for the fleet the run was
            # configured with, so no worker fills the first batches alone while the others start.
            return
        if set(live) != set(self.sender.members):
            self.sync_weights()

    def sync_weights(self) -> dict:
        try:
            stats = self.sender.sync(self.version, self.model.named_parameters, self.live_workers())
        except SyncError as e:
            log.warning("weight sync of version %d failed, re-forming next time: %s", self.version, e)
            self.metrics.sync_failures.inc()
            return {"weight_sync_failed": 1}
        for phase in ("pack", "transfer"):
            if f"{phase}_s" in stats:
                self.metrics.sync_seconds.labels(phase=phase).observe(stats[f"{phase}_s"])
        self.metrics.sync_bytes.inc(stats.get("bytes", 0) * stats.get("members", 0))
        return {"weight_sync_seconds": stats.get("pack_s", 0) + stats.get("transfer_s", 0),
                "weight_sync_members": stats.get("members", 0)}

    # -- bookkeeping -------------------------------------------------------------------------
    def _finish_step(self, m: dict, train_s: float, step_s: float) -> None:
        counters = self.queue.counters()
        self.metrics.queue_dead.inc(counters["dead"] - self.dead_seen)
        self.dead_seen = counters["dead"]
        m.update({
            "step": self.step,
            "learner_step": self.step,
            "learner_version": self.version,
            "learner_step_seconds": step_s,
            "learner_tokens_per_second": m["tokens"] / train_s if train_s > 0 else 0.0,
            "dropped_stale_total": self.dropped_stale_total,
            "queue_depth": self.queue.length(),
            "queue_pending": self.queue.pending(),
            "produced_total": counters["produced"],
            "queue_dead_total": counters["dead"],
            "time": time.time() - self.started_at,
        })
        self.last_metrics = m
        self.metrics.record(m)
        self._publish_state()
        log.info("step %d: reward %.3f, kl %.2e, %.2fs", self.step, m["reward_mean"], m["mismatch_kl"], step_s)

    def _set_status(self, status: str) -> None:
        self.status = status
        self._publish_state()

    def _publish_state(self) -> None:
        registry.set_learner_state(self.r, self.keys, status=self.status, step=self.step, version=self.version)

    def snapshot(self) -> dict:
        return {
            "status": self.status,
            "step": self.step,
            "version": self.version,
            "lr": self.opt.param_groups[0]["lr"],
            "sync_generation": self.sender.state.generation if self.sender.group else None,
            "sync_members": list(self.sender.members),
            "dropped_stale_total": self.dropped_stale_total,
            "last_metrics": self.last_metrics,
        }
