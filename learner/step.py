"""One learner step's PPO update on a batch of groups (DESIGN.md 'Loss'), split out of the
loop in learner/train.py so that file reads top to bottom.

    score       advantages per group (GRPO, RLOO or REINFORCE++); all-equal groups carry no signal: skipped
    recompute   pi_old with the training policy (no grad); mismatch metrics and IS weights vs mu
    update      ppo_epochs x minibatches optimizer steps on the PPO-clip loss, in the training precision

Every forward goes through micro-batches of at most a token budget (:func:`token_budget`),
so no batch, however long its rows, can take more activation memory than the learner was
given (a 2,048-token record OOM-killed the learner when it padded the whole batch at once).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from learner.batch import Batch, collate, microbatches
from learner.loss import (
    RATIO_AGAINST_MU,
    compute_advantages,
    importance_weights,
    loss_denominator,
    loss_sum,
    masked_mean,
    mismatch_metrics,
    ppo_clip_terms,
)
from learner.policy import token_logprobs

# Activation memory per token of a decoder forward kept for the backward: about 17 values
# per hidden unit per layer (Korthikanti et al. 2022: 34 bytes in 16-bit, attention's
# quadratic term aside), and the fp32 logits with their softmax, log-softmax and gradient.
VALUES_PER_HIDDEN_PER_LAYER = 17
LOGIT_COPIES = 4


def token_budget(model_config, memory_gib: float, activation_checkpointing: bool) -> int:
    """The most padded tokens one forward may hold within ``memory_gib`` of activations
    (fp32 estimate): ``learner.max_tokens_per_microbatch`` when it is 0 (auto)."""
    hidden, layers = model_config.hidden_size, model_config.num_hidden_layers
    kept_layers = 1 if activation_checkpointing else layers  # with checkpointing, one layer's at a time
    per_token = 4 * (VALUES_PER_HIDDEN_PER_LAYER * hidden * kept_layers + (2 * hidden * layers if
                     activation_checkpointing else 0) + LOGIT_COPIES * model_config.vocab_size)
    return max(1, int(memory_gib * 2**30 // per_token))


@dataclass
class UpdateStats:
    """What the optimizer steps of one learner step measured."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    skipped: int = 0  # fp16 steps skipped on overflow
    ppo_rows: list[dict] = field(default_factory=list)  # PPO statistics per minibatch


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


def _token_weighted(parts: list[tuple[dict, float]]) -> dict:
    """Per-micro-batch PPO statistics (token means) as one mean over all their tokens."""
    if len(parts) == 1:
        return parts[0][0]
    tokens = sum(n for _, n in parts) or 1.0
    return {k: sum(m[k] * n for m, n in parts) / tokens for k in parts[0][0]}


class PPOStep:
    """The PPO update of one learner step on every rank; it holds no queue or Redis state."""

    def __init__(self, cfg, ranks, model, train_model, opt, scaler, counters, staleness_histogram):
        self.cfg, self.ranks, self.model, self.train_model = cfg, ranks, model, train_model
        self.opt, self.scaler, self.counters, self.staleness = opt, scaler, counters, staleness_histogram
        self.device = ranks.device
        lc = cfg.learner
        self.loss_norm_length = lc.loss_norm_length or cfg.sampling.max_tokens
        self.max_tokens = lc.max_tokens_per_microbatch or token_budget(
            model.config, lc.activation_memory_gib, lc.activation_checkpointing)

    @property
    def version(self) -> int:
        return self.counters.version

    def train_step(self, records) -> dict:
        """One optimizer step's worth of PPO on ``records``; returns the step's metrics.

        Every rank holds every record; each computes and trains on its own rows (dist.py).
        """
        lc = self.cfg.learner
        rewards = torch.tensor([r.rewards for r in records], dtype=torch.float32)  # (G, n)
        advantages, informative = compute_advantages(rewards, lc.advantage, lc.adv_std_norm)
        batch = collate(records, advantages, self.version).to(self.device)
        self.model.eval()  # no dropout: pi_old and pi must be the same function of the weights
        if lc.is_mode == "bypass":
            return self._train_step_bypass(records, rewards, informative, batch)
        pi_old, entropy = self._recompute_pi_old(batch)
        mu = batch.behavior_logprobs
        weights, is_metrics = importance_weights(pi_old, mu, batch.mask, lc.is_mode, lc.is_cap, lc.geo_low,
                                                 lc.geo_high, lc.log_ratio_clamp)
        ref = mu if lc.is_mode in RATIO_AGAINST_MU else pi_old
        update = self._update(batch, informative, weights, ref)
        return self._step_metrics(StepOutcome(records, rewards, informative, batch, pi_old, entropy, batch.mask,
                                              is_metrics, update))

    def _recompute_pi_old(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """pi_old and the entropy of every row under the current weights, in the training
        precision (each rank computes its rows, then every rank has all of them)."""
        lc, ranks = self.cfg.learner, self.ranks
        n_rows = len(batch.rewards)
        mine = ranks.mine(torch.arange(n_rows, device=self.device))
        width = batch.mask.shape[1]
        lp = torch.zeros(len(mine), width, device=self.device)
        ent = torch.zeros(len(mine), width, device=self.device)
        position = {int(row): i for i, row in enumerate(mine.tolist())}
        parts = microbatches(batch, mine, self.max_tokens) if len(mine) else []
        n_parts = len(parts)
        if ranks.sharded:  # every rank runs as many forwards (each gathers the layers): extra ones are discarded
            parts += [torch.arange(1, device=self.device)] * (ranks.max(n_parts) - n_parts)
        with torch.no_grad():
            for i, part in enumerate(parts):
                mb = batch.select(part).trimmed()
                part_lp, part_ent = token_logprobs(self.model, mb, lc.dtype, lc.fp32_lm_head)
                if i < n_parts:
                    at = torch.tensor([position[int(row)] for row in part.tolist()], device=self.device)
                    lp[at, : part_lp.shape[1]], ent[at, : part_ent.shape[1]] = part_lp, part_ent
        return ranks.share_rows(lp, mine, n_rows), ranks.share_rows(ent, mine, n_rows)

    def _train_step_bypass(self, records, rewards, informative, batch) -> dict:
        """``is_mode: bypass``: pi_old is taken to be mu, so there is no recompute pass; the
        mismatch is measured on the first epoch's forward passes instead (of the rows that
        took part in one: groups without signal are never forwarded)."""
        lc, ranks = self.cfg.learner, self.ranks
        mu, n_rows = batch.behavior_logprobs, len(batch.rewards)
        everyone = torch.arange(n_rows, device=self.device)
        pi_old, entropy, seen = torch.zeros_like(mu), torch.zeros_like(mu), torch.zeros(n_rows, device=self.device)
        weights, is_metrics = importance_weights(mu, mu, batch.mask, lc.is_mode, lc.is_cap, lc.geo_low, lc.geo_high,
                                                 lc.log_ratio_clamp)

        def first_epoch(rows, pi, ent, took_part):  # pi may be trimmed to the rows' longest
            pi_old[rows, : pi.shape[1]], entropy[rows, : ent.shape[1]] = pi.detach(), ent.detach()
            seen[rows] = float(took_part)

        update = self._update(batch, informative, weights, mu, first_epoch)
        pi_old = ranks.share_rows(pi_old[seen.bool()], everyone[seen.bool()], n_rows)
        entropy = ranks.share_rows(entropy[seen.bool()], everyone[seen.bool()], n_rows)
        mask = batch.mask * ranks.share_rows(seen, everyone, n_rows).clamp(max=1)[:, None]
        return self._step_metrics(StepOutcome(records, rewards, informative, batch, pi_old, entropy, mask,
                                              is_metrics, update))

    def _update(self, batch, informative, weights, ref, first_epoch=None) -> UpdateStats:
        """``ppo_epochs`` x ``minibatches`` optimizer steps on the PPO-clip loss of the
        informative groups; ``first_epoch(rows, pi, entropy, took_part)`` sees epoch 0's forwards.

        Each rank's rows of a minibatch go forward in micro-batches of at most
        ``learner.max_tokens_per_microbatch`` padded tokens, and their gradients accumulate
        into one optimizer step; the loss denominator is the whole minibatch's, so the step
        is the same as one padded forward of all of them. (``max_tokens_per_microbatch`` 0:
        the token budget of ``learner.activation_memory_gib``.)"""
        lc, ranks = self.cfg.learner, self.ranks
        groups = torch.nonzero(informative).squeeze(1).to(self.device)
        out = UpdateStats()
        for epoch in range(lc.ppo_epochs if len(groups) else 0):
            order = groups[torch.randperm(len(groups)).to(self.device)]
            for mb_groups in order.chunk(lc.minibatches):
                rows = torch.nonzero(torch.isin(batch.group_index, mb_groups)).squeeze(1)
                denom = loss_denominator(batch.mask[rows], lc.loss_agg, self.loss_norm_length)  # the whole minibatch's
                local = ranks.mine(rows)
                share = ranks.world if len(local) else 0.0  # a rank with no rows still joins the all-reduce
                local = local if len(local) else rows[:1]
                parts = microbatches(batch, local, self.max_tokens)
                n_parts = len(parts)
                if ranks.sharded:  # every rank must run as many forwards (each one gathers the layers)
                    parts += [parts[-1][:1]] * (ranks.max(n_parts) - n_parts)  # with weight 0
                self.opt.zero_grad(set_to_none=True)
                total, ppo_parts = 0.0, []
                for i, part in enumerate(parts):
                    mb = batch.select(part).trimmed() if len(parts) > 1 else batch.select(part)
                    width = mb.mask.shape[1]
                    weight = share if i < n_parts else 0.0
                    with ranks.no_sync(self.train_model, sync=i == len(parts) - 1):
                        pi, ent = token_logprobs(self.train_model, mb, lc.dtype, lc.fp32_lm_head)
                        if first_epoch and epoch == 0 and i < n_parts:
                            first_epoch(part, pi, ent, share > 0)
                        per_token, ppo_m = ppo_clip_terms(pi, ref[part, :width], mb.advantages, mb.mask,
                                                          weights[part, :width], lc.eps_low, lc.eps_high,
                                                          lc.log_ratio_clamp)
                        part_total = loss_sum(per_token, mb.mask, lc.loss_agg)  # this rank's rows
                        # DDP and FSDP average gradients over ranks; scaling by the world size makes it the sum.
                        self.scaler.backward(part_total * weight / denom)
                    if i < n_parts:
                        total += part_total.item()
                        ppo_parts.append((ppo_m, mb.mask.sum().item()))
                out.ppo_rows.append(_token_weighted(ppo_parts))
                grad_norm, was_skipped = self.scaler.step(self.opt, self.model.parameters(), lc.grad_clip)
                out.skipped += was_skipped
                out.grad_norms.append(grad_norm)
                out.losses.append(ranks.sum([total * (share > 0)])[0] / denom)
        return out

    def _step_metrics(self, o: StepOutcome) -> dict:
        records, rewards, informative, batch = o.records, o.rewards, o.informative, o.batch
        pi_old, mu, mask, entropy = o.pi_old, batch.behavior_logprobs, o.mask, o.entropy
        losses, grad_norms, skipped, ppo_rows = o.update.losses, o.update.grad_norms, o.update.skipped, o.update.ppo_rows
        is_metrics = o.is_metrics
        clamp = self.cfg.learner.log_ratio_clamp
        finite = [g for g in grad_norms if math.isfinite(g)]
        if finite:
            step_norm = sum(finite) / len(finite)
            a = self.cfg.learner.grad_norm_ema
            self.counters.grad_norm_smoothed = step_norm if self.counters.grad_norm_smoothed is None else \
                a * self.counters.grad_norm_smoothed + (1 - a) * step_norm
        self.counters.groups_skipped_total += int((~informative).sum())
        by_precision = {}
        precisions = [r.precision for r in records for _ in r.samples]
        for p in sorted(set(precisions)):
            rows = torch.tensor([q == p for q in precisions], device=mask.device)
            by_precision[p] = mismatch_metrics(pi_old[rows], mu[rows], mask[rows], clamp)
        fresh = batch.staleness == 0  # the precision effect alone, without policy lag
        staleness = Counter(int(self.version - r.policy_version) for r in records)
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
            "tokens": int(batch.mask.sum().item()),
            "staleness_mean": batch.staleness.float().mean().item(),
            "staleness_max": int(batch.staleness.max().item()),
            "staleness_hist": {str(s): c for s, c in sorted(staleness.items())},
            **mismatch_metrics(pi_old, mu, mask, clamp),
            "mismatch_kl_fresh": mismatch_metrics(pi_old[fresh], mu[fresh], mask[fresh], clamp)["mismatch_kl"]
            if fresh.any() else None,
            "mismatch_by_precision": by_precision,
            **is_metrics,
            # PPO statistics averaged over the step's minibatches (on rank 0's rows under DDP)
            **{k: sum(m[k] for m in ppo_rows) / len(ppo_rows) for k in (ppo_rows[0] if ppo_rows else {})},
        }
