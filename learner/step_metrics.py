"""What a learner step reports: its metrics (rewards, losses and gradient norms, staleness,
the mismatch between the engines' log-probs and the learner's, by precision too), computed from
what the step measured, and the run's running totals they carry (the smoothed gradient norm,
the groups skipped, the staleness histogram).

learner/step.py's PPOStep computes a step; turning what it measured into the step's metrics is
a separate job, and with it PPOStep was over the 300-line rule, so it lives here.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from learner.batch import Batch
from learner.loss import after_tool_k3, masked_mean, mismatch_metrics
from learner.routing import take_tally


@dataclass
class UpdateStats:
    """What the optimizer steps of one learner step measured."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    skipped: int = 0  # fp16 steps skipped on overflow
    ppo_rows: list[dict] = field(default_factory=list)  # PPO statistics per minibatch
    kl_losses: list[float] = field(default_factory=list)  # kl_in loss: the KL term of each optimizer step


@dataclass
class StepOutcome:
    """Everything a learner step's metrics are computed from."""

    records: list
    rewards: torch.Tensor  # (G, n)
    informative: torch.Tensor  # (G,) bool: groups with a learning signal
    batch: Batch
    pi_old: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor  # the batch's, less rows bypass never measured
    is_metrics: dict
    update: UpdateStats
    kl_metrics: dict = field(default_factory=dict)


class StepMetrics:
    """``step_metrics(outcome)``: one step's metrics; it also brings the run's counters and the
    staleness histogram up to date with the step."""

    def __init__(self, cfg, model, opt, scaler, counters, staleness_histogram):
        self.cfg, self.model, self.opt, self.scaler = cfg, model, opt, scaler
        self.counters, self.staleness = counters, staleness_histogram

    def __call__(self, o: StepOutcome) -> dict:
        records, rewards, informative, batch = o.records, o.rewards, o.informative, o.batch
        pi_old, mu, mask, entropy = o.pi_old, batch.behavior_logprobs, o.mask, o.entropy
        losses, grad_norms, skipped, ppo_rows = o.update.losses, o.update.grad_norms, o.update.skipped, o.update.ppo_rows
        is_metrics, kl_metrics = o.is_metrics, dict(o.kl_metrics)
        if o.update.kl_losses:  # kl_in loss: the KL term, averaged over the step's optimizer updates
            kl_metrics["kl_loss"] = sum(o.update.kl_losses) / len(o.update.kl_losses)
        clamp = self.cfg.learner.log_ratio_clamp
        finite = [g for g in grad_norms if math.isfinite(g)]
        if finite:
            step_norm = sum(finite) / len(finite)
            a = self.cfg.learner.grad_norm_ema
            self.counters.grad_norm_smoothed = step_norm if self.counters.grad_norm_smoothed is None else \
                a * self.counters.grad_norm_smoothed + (1 - a) * step_norm
        self.counters.groups_skipped_total += int((~informative).sum())
        by_precision, staleness_by_precision = {}, {}  # a slow precision's groups are the staler ones
        precisions = [r.precision for r in records for _ in r.samples]
        for p in sorted(set(precisions)):
            rows = torch.tensor([q == p for q in precisions], device=mask.device)
            by_precision[p] = mismatch_metrics(pi_old[rows], mu[rows], mask[rows], clamp)
            lag = batch.staleness[rows.to(batch.staleness.device)]
            staleness_by_precision[p] = {"staleness_mean": lag.float().mean().item(),
                                         "staleness_max": int(lag.max().item())}
        fresh = batch.staleness == 0  # the precision effect alone, without policy lag
        staleness = Counter(int(self.counters.version - r.oldest_version) for r in records)  # oldest model token
        for s, count in staleness.items():
            for _ in range(count):
                self.staleness.observe(s)
        return {
            "reward_mean": rewards.mean().item(),
            "response_length_mean": batch.mask.sum(1).float().mean().item(),
            "entropy": masked_mean(entropy, mask).item(),
            "learner_loss": sum(losses) / len(losses) if losses else 0.0,
            "learner_grad_norm": sum(finite) / len(finite) if finite else 0.0,
            "learner_grad_norm_max": max(finite) if finite else 0.0,
            "learner_grad_norm_smoothed": self.counters.grad_norm_smoothed or 0.0,
            "learner_lr": self.opt.param_groups[0]["lr"],
            "learner_loss_scale": self.scaler.scale,
            "learner_skipped_steps": skipped,
            "learner_skipped_steps_total": self.scaler.skipped_steps,
            "groups": len(records),
            "groups_by_precision": {p: sum(r.precision == p for r in records) for p in sorted({r.precision for r in records})},
            "reward_by_precision": {p: rewards[[r.precision == p for r in records]].mean().item()
                                    for p in sorted({r.precision for r in records})},
            "groups_skipped_equal_reward": int((~informative).sum()),
            "groups_skipped_total": self.counters.groups_skipped_total,
            "tokens": int(batch.mask.sum().item()),  # model tokens: the environment's are context only
            "tokens_masked": sum(int((~s.model_mask()).sum()) for r in records for s in r.samples),
            "model_turns_mean": sum(s.model_turns() for r in records for s in r.samples)
            / max(1, sum(len(r.samples) for r in records)),
            "staleness_mean": batch.staleness.float().mean().item(),
            "staleness_max": int(batch.staleness.max().item()),
            "staleness_hist": {str(s): c for s, c in sorted(staleness.items())},
            "staleness_by_precision": staleness_by_precision,
            **mismatch_metrics(pi_old, mu, mask, clamp),
            "mismatch_kl_fresh": mismatch_metrics(pi_old[fresh], mu[fresh], mask[fresh], clamp)["mismatch_kl"]
            if fresh.any() else None,
            "mismatch_by_precision": by_precision,
            "mismatch_k3_after_tool": after_tool_k3(pi_old, mu, mask, batch.env_mask, clamp),
            **is_metrics,
            **kl_metrics,
            # PPO statistics averaged over the step's minibatches (on rank 0's rows under DDP)
            **{k: sum(m[k] for m in ppo_rows) / len(ppo_rows) for k in (ppo_rows[0] if ppo_rows else {})},
            # routes recorded by the engines: how often this rank's forwards of the step chose the same experts
            **take_tally(self.model).metrics(),
        }
