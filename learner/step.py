"""One learner step's PPO update on a batch of groups (docs/design.md 'Loss'), split out of the
loop in learner/train.py so that file reads top to bottom.

    recompute   pi_old with the training policy (no grad), and the frozen reference's log-probs
                when there is a KL penalty (learner/reference.py); mismatch metrics and IS weights vs mu
    score       advantages per group (GRPO, RLOO or REINFORCE++), from rewards less the KL penalty
                with ``kl_in: reward``; all-equal groups carry no signal: skipped
    update      ppo_epochs x minibatches optimizer steps on the policy loss (PPO-clip or CISPO), plus
                the KL term (``kl_in: loss``) and less the entropy bonus, in the training precision

Every forward goes through micro-batches of at most a token budget (:func:`token_budget`),
so no batch, however long its rows, can take more activation memory than the learner was
given (a 2,048-token record OOM-killed the learner when it padded the whole batch at once).

The step's metrics, from what it measured, are learner/step_metrics.py's.
"""

from __future__ import annotations

import torch

from learner.batch import collate, microbatches
from learner.distillation import distill_advantages
from learner.lora import trainable
from learner.loss import (
    POLICY_LOSSES,
    ISSettings,
    compute_advantages,
    imitation_sum,
    importance_weights,
    kl_terms,
    loss_denominator,
    loss_sum,
    masked_mean,
    sequence_kl,
)
from learner.policy import token_logprobs
from learner.score_centering import centering_terms
from learner.served import ServedWeights, served_dtype
from learner.step_metrics import StepMetrics, StepOutcome, UpdateStats

# Activation memory per token of a decoder forward kept for the backward: about 17 values
# per hidden unit per layer (Korthikanti et al. 2022: 34 bytes in 16-bit, attention's
# quadratic term aside), and the fp32 logits with their softmax, log-softmax and gradient.
VALUES_PER_HIDDEN_PER_LAYER = 17
LOGIT_COPIES = 4


def token_budget(model_config, memory_gib: float, activation_checkpointing: bool, head_chunk: int = 0) -> int:
    """The most padded tokens one forward may hold within ``memory_gib`` of activations
    (fp32 estimate): ``learner.max_tokens_per_microbatch`` when it is 0 (auto). With the chunked
    head (``head_chunk`` > 0) the logits cost one chunk's, whatever the tokens, not a row per token."""
    hidden, layers, vocab = model_config.hidden_size, model_config.num_hidden_layers, model_config.vocab_size
    kept_layers = 1 if activation_checkpointing else layers  # with checkpointing, one layer's at a time
    per_token = 4 * (VALUES_PER_HIDDEN_PER_LAYER * hidden * kept_layers + (2 * hidden * layers if
                     activation_checkpointing else 0) + (0 if head_chunk else LOGIT_COPIES * vocab))
    memory = memory_gib * 2**30 - 4 * LOGIT_COPIES * vocab * head_chunk
    return max(1, int(max(memory, 0) // per_token))


def takes_single_pass(lc, has_reference: bool) -> bool:
    """Whether a step under learner settings ``lc`` takes pi_old from the update's own forward
    (:attr:`PPOStep.single_pass` says why): one epoch of one minibatch and no reference model."""
    return lc.single_pass and lc.ppo_epochs == 1 and lc.minibatches == 1 and not has_reference


def _token_weighted(parts: list[tuple[dict, float]]) -> dict:
    """Per-micro-batch PPO statistics (token means) as one mean over all their tokens."""
    if len(parts) == 1:
        return parts[0][0]
    tokens = sum(n for _, n in parts) or 1.0
    return {k: sum(m[k] * n for m, n in parts) / tokens for k in parts[0][0]}


class PPOStep:
    """The PPO update of one learner step on every rank; it holds no queue or Redis state."""

    def __init__(self, cfg, ranks, model, train_model, opt, scaler, counters, staleness_histogram, reference=None,
                 teacher=None):
        self.cfg, self.ranks, self.model, self.train_model = cfg, ranks, model, train_model
        self.reference = reference  # the frozen base model of the KL penalty (learner/reference.py), or None
        self.teacher = teacher  # the frozen teacher of on-policy distillation (learner/distillation.py), or None
        self.opt, self.scaler, self.counters = opt, scaler, counters
        # the step's metrics from what it measured (learner/step_metrics.py)
        self.step_metrics = StepMetrics(cfg, model, opt, scaler, counters, staleness_histogram)
        self.device = ranks.device
        lc = cfg.learner
        self.loss_norm_length = lc.loss_norm_length or cfg.sampling.max_tokens
        self.is_settings = ISSettings.of(lc)  # the mismatch correction, one value for every call
        self.centering = lc.score_centering_k > 0  # score centering: the records carry the sampler's top-k
        self.max_tokens = lc.max_tokens_per_microbatch or token_budget(
            model.config, lc.activation_memory_gib, lc.activation_checkpointing, lc.head_chunk)
        # the weights the engines compute with (under LoRA the adapter: the base is served as it is, learner/lora.py)
        self.served = ServedWeights(trainable(model), served_dtype(cfg))
        # One rank only: a rank's groups differ in number, and under DDP or FSDP (whose fully_shard
        # wraps the model in place) every rank must run as many forwards, each gathering the layers.
        # Not under activation checkpointing either: a layer recomputed in the backward appends its keys to the
        # prompt's shared KV cache a second time (a shape error in the backward, tests/test_lora.py).
        self.share_prompt = lc.share_prompt and ranks.world == 1 and not lc.activation_checkpointing

    @property
    def version(self) -> int:
        return self.counters.version

    def train_step(self, records) -> dict:
        """One optimizer step's worth of PPO on ``records``; returns the step's metrics.

        Every rank holds every record; each computes and trains on its own rows (dist.py).
        """
        lc = self.cfg.learner
        rewards = torch.tensor([r.rewards for r in records], dtype=torch.float32)  # (G, n)
        batch = collate(records, torch.zeros_like(rewards), self.version).to(self.device)
        self.model.eval()  # no dropout: pi_old and pi must be the same function of the weights
        bypass = lc.is_mode == "bypass"
        self.served.begin_step()
        if bypass or self.single_pass:
            return self._train_step_single_pass(records, rewards, batch, bypass)
        with self.served.rounded():
            pi_old, entropy, ref_lp, teacher_lp = self._no_grad_pass(batch)
        mu = batch.behavior_logprobs
        # kl_in reward: each sample's reward less kl_coef x its k1 sum against the reference, under
        # the policy that sampled it as the learner sees it (pi_old).
        kl_metrics, scored = self._kl_before_update(pi_old, ref_lp, batch.mask, rewards)
        advantages, informative = compute_advantages(scored, lc.advantage, lc.adv_std_norm,
                                                         negative_scale=lc.negative_scale)
        batch.advantages = advantages.reshape(-1).to(self.device)  # rows are records x samples (collate)
        informative, distill_metrics = self._with_teacher(batch, teacher_lp, informative)
        weights, is_metrics = importance_weights(pi_old, mu, batch.mask, self.is_settings)
        ref = mu if self.is_settings.against_mu else pi_old
        update = self._update(batch, informative, weights, ref, ref_lp)
        metrics = self.step_metrics(StepOutcome(records, rewards, informative, batch, pi_old, entropy, batch.mask,
                                                is_metrics, update, kl_metrics))
        if (visible := self.served.visible_fraction()) is not None:
            metrics["learner_served_visible_fraction"] = visible
        return {**metrics, **distill_metrics}

    @property
    def single_pass(self) -> bool:
        """pi_old is the update's own first forward (``learner.single_pass``): with one epoch of
        one minibatch and no reference model, the update runs at exactly the weights a recompute
        pass would (the step's own, served-rounded), so that pass would give pi_old = pi, a
        ratio of exactly 1, at the cost of one more forward of the batch."""
        return takes_single_pass(self.cfg.learner, self.reference is not None)

    def _no_grad_pass(self, batch, policy: bool = True):
        """pi_old and the entropy of every row under the current weights (``policy``), and the
        reference model's and the teacher's log-probs of every row (each if there is one), in the
        training precision, through the same micro-batches: (pi_old, entropy, ref, teacher), each
        (N, T) or None. Each rank computes its rows, then every rank has all of them."""
        lc, ranks = self.cfg.learner, self.ranks
        models = {"pi_old": self.model} if policy else {}
        frozen = {"ref": self.reference, "teacher": self.teacher}
        models.update({name: model for name, model in frozen.items() if model is not None})
        if not models:
            return None, None, None, None
        n_rows = len(batch.rewards)
        mine = ranks.mine(torch.arange(n_rows, device=self.device))
        width = batch.mask.shape[1]
        out = {name: torch.zeros(len(mine), width, device=self.device) for name in [*models, "entropy"]}
        position = {int(row): i for i, row in enumerate(mine.tolist())}
        parts = microbatches(batch, mine, self.max_tokens) if len(mine) else []
        n_parts = len(parts)
        # Sharded, every rank runs as many policy forwards (each gathers the layers): extra ones are discarded.
        # A separate reference is whole on every rank: it runs only on real parts (LoRA's is the policy: on all).
        if (policy or any(getattr(m, "collective", False) for m in frozen.values())) and ranks.sharded:
            parts += [torch.arange(1, device=self.device)] * (ranks.max(n_parts) - n_parts)
        with torch.no_grad():
            for i, part in enumerate(parts):
                mb = batch.select(part).trimmed()
                at = torch.tensor([position[int(row)] for row in part.tolist()], device=self.device) \
                    if i < n_parts else None
                for name, model in models.items():
                    if at is None and name in frozen and not getattr(model, "collective", False):
                        continue  # a whole reference runs on real parts only (a sharded one, LoRA's, on every one)
                    part_lp, part_ent = token_logprobs(model, mb, lc.dtype, lc.fp32_lm_head,
                                                       response_only=lc.response_logits, share_prompt=self.share_prompt,
                                                       head_chunk=lc.head_chunk)
                    if at is not None:
                        out[name][at, : part_lp.shape[1]] = part_lp
                        if name == "pi_old":
                            out["entropy"][at, : part_ent.shape[1]] = part_ent
        full = {name: ranks.share_rows(value, mine, n_rows) for name, value in out.items()
                if name != "entropy" or policy}
        return full.get("pi_old"), full.get("entropy"), full.get("ref"), full.get("teacher")

    def _kl_before_update(self, pi, ref_lp, mask, rewards) -> tuple[dict, torch.Tensor]:
        """The KL metrics of the step's samples against the reference, measured before the
        update (``kl_ref``: the mean per-token estimate the loss or reward uses), and the
        rewards the advantages are computed from: with ``kl_in: reward``, less ``kl_coef`` x
        each sample's k1 sum (``kl_loss`` is then the mean penalty per sample)."""
        lc = self.cfg.learner
        if ref_lp is None:
            return {}, rewards
        estimator = "k1" if lc.kl_in == "reward" else lc.kl_estimator
        metrics = {"kl_ref": masked_mean(kl_terms(pi, ref_lp, mask, estimator, lc.log_ratio_clamp), mask).item()}
        if lc.kl_in != "reward":
            return {**metrics, "kl_loss": 0.0}, rewards  # the update's KL term replaces it (none without signal)
        penalty = lc.kl_coef * sequence_kl(pi, ref_lp, mask, lc.log_ratio_clamp).cpu().view_as(rewards)  # (G, n)
        metrics["kl_loss"] = penalty.mean().item()
        return metrics, rewards - penalty

    def _train_step_single_pass(self, records, rewards, batch, bypass: bool) -> dict:
        """No recompute pass: pi_old is taken from the update's own forward (:attr:`single_pass`),
        or is mu itself (``is_mode: bypass``). The IS weights and the mismatch are measured on
        that forward, of the rows that took part in one (groups without signal are never
        forwarded). Under bypass a reference model's KL is measured against mu."""
        lc, ranks = self.cfg.learner, self.ranks
        mu, n_rows = batch.behavior_logprobs, len(batch.rewards)
        _, _, ref_lp, teacher_lp = self._no_grad_pass(batch, policy=False)
        kl_metrics, scored = self._kl_before_update(mu, ref_lp, batch.mask, rewards)
        advantages, informative = compute_advantages(scored, lc.advantage, lc.adv_std_norm,
                                                         negative_scale=lc.negative_scale)
        batch.advantages = advantages.reshape(-1).to(self.device)
        informative, distill_metrics = self._with_teacher(batch, teacher_lp, informative)
        everyone = torch.arange(n_rows, device=self.device)
        pi_old, entropy, seen = torch.zeros_like(mu), torch.zeros_like(mu), torch.zeros(n_rows, device=self.device)

        def first_epoch(rows, pi, ent, took_part):  # pi may be trimmed to the rows' longest
            pi_old[rows, : pi.shape[1]], entropy[rows, : ent.shape[1]] = pi.detach(), ent.detach()
            seen[rows] = float(took_part)

        update = self._update(batch, informative, None, None, ref_lp, first_epoch)
        pi_old = ranks.share_rows(pi_old[seen.bool()], everyone[seen.bool()], n_rows)
        entropy = ranks.share_rows(entropy[seen.bool()], everyone[seen.bool()], n_rows)
        mask = batch.mask * ranks.share_rows(seen, everyone, n_rows).clamp(max=1)[:, None]
        _, is_metrics = importance_weights(mu if bypass else pi_old, mu, mask, self.is_settings)
        metrics = self.step_metrics(StepOutcome(records, rewards, informative, batch, pi_old, entropy, mask,
                                                is_metrics, update, kl_metrics))
        if (visible := self.served.visible_fraction()) is not None:
            metrics["learner_served_visible_fraction"] = visible
        return {**metrics, **distill_metrics}

    def _with_teacher(self, batch, teacher_lp, informative) -> tuple[torch.Tensor, dict]:
        """With a teacher, ``batch.advantages`` become per token: the task's less ``teacher.kl_coef`` x
        each token's reverse KL against the teacher, the student being the sampler (mu); every group
        then has a signal (learner/distillation.py). Returns the groups to train and the metrics."""
        if teacher_lp is None:
            return informative, {}
        lc = self.cfg.learner
        batch.advantages, metrics = distill_advantages(batch.advantages, batch.behavior_logprobs, teacher_lp,
                                                       batch.mask, lc.teacher.kl_coef, lc.log_ratio_clamp)
        return torch.ones_like(informative), metrics

    def _update(self, batch, informative, weights, ref, ref_lp=None, first_epoch=None) -> UpdateStats:
        """``ppo_epochs`` x ``minibatches`` optimizer steps on the policy loss of the
        informative groups; ``first_epoch(rows, pi, entropy, took_part)`` sees epoch 0's forwards.

        Per token the loss is the policy term (``learner.loss``: PPO-clip or CISPO, scaled by
        the mismatch weight), plus ``kl_coef`` x the reference KL estimate with ``kl_in: loss``
        (``ref_lp`` the reference's log-probs; not weighted), less ``entropy_coef`` x the
        token's entropy; all aggregated together by ``loss_agg`` (with token_mean the bonus is
        exactly the mean token entropy). The KL and entropy terms reach only the rows the
        update forwards: those of informative groups.

        Each rank's rows of a minibatch go forward in micro-batches of at most
        ``learner.max_tokens_per_microbatch`` padded tokens, and their gradients accumulate
        into one optimizer step; the loss denominator is the whole minibatch's, so the step
        is the same as one padded forward of all of them. (``max_tokens_per_microbatch`` 0:
        the token budget of ``learner.activation_memory_gib``.)"""
        lc, ranks = self.cfg.learner, self.ranks
        policy_terms = POLICY_LOSSES[lc.loss]
        eps = (lc.cispo_eps_low, lc.cispo_eps_high) if lc.loss == "cispo" else (lc.eps_low, lc.eps_high)
        kl_in_loss = ref_lp is not None and lc.kl_in == "loss"
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
                total, kl_total, ppo_parts = 0.0, 0.0, []
                with self.served.rounded():  # forwards and backwards at the served weights; the step at the master's
                    for i, part in enumerate(parts):
                        mb = batch.select(part).trimmed() if len(parts) > 1 else batch.select(part)
                        width = mb.mask.shape[1]
                        weight = share if i < n_parts else 0.0
                        with ranks.no_sync(self.train_model, sync=i == len(parts) - 1):
                            pi, ent, *topk = token_logprobs(self.train_model, mb, lc.dtype, lc.fp32_lm_head,
                                                            entropy_grad=lc.entropy_coef > 0,
                                                            response_only=lc.response_logits,
                                                            share_prompt=self.share_prompt, head_chunk=lc.head_chunk,
                                                            with_topk=self.centering)
                            if first_epoch and epoch == 0 and i < n_parts:
                                first_epoch(part, pi, ent, share > 0)
                            w_part, ref_part = self._weights(mb, pi, weights, ref, part, width)
                            per_token, ppo_m = self._policy_terms(policy_terms, pi, topk, mb, w_part, ref_part, eps)
                            if kl_in_loss:
                                kl = lc.kl_coef * kl_terms(pi, ref_lp[part, :width], mb.mask, lc.kl_estimator,
                                                           lc.log_ratio_clamp)
                                per_token = per_token + kl
                                kl_total += loss_sum(kl.detach(), mb.mask, lc.loss_agg).item() * (i < n_parts)
                            if lc.entropy_coef:
                                per_token = per_token - lc.entropy_coef * ent
                            imitation, imitation_m = imitation_sum(pi, mb.env_mask, lc.tool_imitation, lc.loss_agg)
                            part_total = loss_sum(per_token, mb.mask, lc.loss_agg) + imitation  # this rank's rows
                            # DDP and FSDP average gradients over ranks; scaling by the world size makes it the sum.
                            self.scaler.backward(part_total * weight / denom)
                        if i < n_parts:
                            total += part_total.item()
                            ppo_parts.append(({**ppo_m, **imitation_m}, mb.mask.sum().item()))
                out.ppo_rows.append(_token_weighted(ppo_parts))
                grad_norm, was_skipped = self.scaler.step(self.opt, self.model.parameters(), lc.grad_clip)
                out.skipped += was_skipped
                out.grad_norms.append(grad_norm)
                loss, kl_loss = ranks.sum([total * (share > 0), kl_total * (share > 0)])
                out.losses.append(loss / denom)
                if kl_in_loss:
                    out.kl_losses.append(kl_loss / denom)
        return out

    def _policy_terms(self, policy_terms, pi, topk, mb, weights, ref, eps) -> tuple[torch.Tensor, dict]:
        """A micro-batch's policy loss per token (``learner.loss``, each token scaled by its mismatch
        weight) and its metrics; with ``learner.score_centering_k``, plus the score-centering term
        (learner/score_centering.py) of ``topk``, [the log-probs at the sampler's top-k ids]."""
        per_token, metrics = policy_terms(pi, ref, mb.advantages, mb.mask, weights, *eps, self.cfg.learner.log_ratio_clamp)
        if topk:
            term, centering = centering_terms(topk[0], mb.sampler_topk_logprobs, mb.advantages, mb.mask, weights,
                                              self.is_settings)
            per_token, metrics = per_token + term, {**metrics, **centering}
        return per_token, metrics

    def _weights(self, mb, pi, weights, ref, part, width):
        """A micro-batch's IS weights and PPO reference: the step's (sliced to its rows), or
        in a single pass its own forward's, pi_old = pi detached."""
        if weights is not None:
            return weights[part, :width], ref[part, :width]
        old = pi.detach()
        w, _ = importance_weights(old, mb.behavior_logprobs, mb.mask, self.is_settings)
        return w, mb.behavior_logprobs if self.is_settings.against_mu else old
