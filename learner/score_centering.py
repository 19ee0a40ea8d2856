"""Score centering (``learner.score_centering_k``): the additive loss term that cancels the sampler's drift.

Marek and Ryabinin, "Score Centering Stabilizes Off-policy Reinforcement Learning" (arXiv 2609.20807,
Eq. 14, with its top-k estimator). At one position, with p the training policy, q the rollout sampler,
s_v = grad log p_v and w_v = f(p_v / q_v) the is_mode's weight, the policy gradient's expectation
under q is ``E_q[A] E_q[w s] + Cov_q(A, w s)``. The first part is drift: wherever the expected
advantage at a prefix is not zero (a group baseline does not make it zero per prefix), it pulls the
trainer toward the sampler, and since the sampler is synced from the trainer it compounds. Score
centering subtracts ``mu_w = E_q[w s]`` from the sampled token's weighted score, so that part is
exactly zero.

The engine returns only the sampler's top-k head H (ids and log-probs, rlpipe/sampler_topk.py). The
tail is modelled as the trainer's, rescaled to the sampler's tail mass:

    Q_H = sum_H q_v,  P_H = sum_H p_v,  rho = (1 - Q_H) / max(1 - P_H, 1e-6),  q_v ~ rho p_v off H

Then ``mu_w = sum_H q_v f(p_v/q_v) s_v + alpha sum_tail p_v s_v`` with ``alpha = rho f(1/rho)`` (on
the tail p/q = 1/rho), and because ``sum_v p_v s_v = 0`` the tail sum is ``-sum_H p_v s_v``:

    c_v = q_v f(p_v / q_v) - alpha p_v            (v in H)
    C   = sum_H sg(c_v) log p_v                   grad C = mu_w
    loss_t += A_t C_t                             (aggregated with the policy loss, learner.loss_agg)

With no IS (``is_mode: none``) f = 1 and alpha = rho; untruncated IS (``vanilla_is``) gives c = 0, as
it should (w already makes the expectation p's). A sequence-level mode's weight W is the same for
every token the sampler could have drawn at a position (W is read off the sampled sequence):
c_v = W (q_v - rho p_v). The modes that correct through the PPO ratio against mu (ppo_is, bypass)
have no weight to centre and are refused (rlpipe/corrections.py CENTERING_WEIGHT).

What rlpipe chose where the paper leaves room:
- p in c and rho is the update's own forward (detached), as the term differentiates it; the sampled
  token's weight stays the is_mode's w = exp(pi_old - mu). In a single-pass step they are one forward.
- A candidate whose sampler log-prob is -inf (the sampler's top-k/top-p left it out, or the row had
  fewer than k candidates) is not in H: its q is 0 and its p counts in the trainer's tail.
- p is the learner's distribution after the row's temperature, top-k and top-p (learner/policy.py),
  the one q is too (vLLM's processed_logprobs), so both are normalized over the same support.
"""

from __future__ import annotations

import torch

from learner.loss import ISSettings, masked_mean, token_advantages
from rlpipe.corrections import CENTERING_WEIGHT

TAIL_FLOOR = 1e-6  # the trainer's tail mass below which rho's denominator is held


def token_weight(log_ratio: torch.Tensor, settings: ISSettings) -> torch.Tensor:
    """f(p/q) of a token-level mode at any log-ratio, as learner/loss.py importance_weights weighs the
    sampled token (the log-ratio clamped first): vanilla_is w, token_tis min(w, C), token_mis w or 0
    above C, icepop w inside [alpha, beta] else 0."""
    w = torch.exp(log_ratio.clamp(-settings.clamp, settings.clamp))
    if settings.mode == "vanilla_is":
        return w
    if settings.mode == "token_tis":
        return w.clamp(max=settings.cap)
    if settings.mode == "token_mis":
        return w * (w <= settings.cap)
    if settings.mode == "icepop":
        low = 1 / settings.icepop_beta if settings.icepop_alpha is None else settings.icepop_alpha
        return w * ((w >= low) & (w <= settings.icepop_beta))
    raise ValueError(f"score centering: {settings.mode!r} is not a token-level mode")


def centering_coefficients(pi_topk: torch.Tensor, mu_topk: torch.Tensor, weights: torch.Tensor,
                           settings: ISSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """c (N, T, K), detached, from the trainer's log-probs ``pi_topk`` (N, T, K) and the sampler's
    ``mu_topk`` (N, T, K; -inf: not a candidate) at the sampler's top-k ids, and the is_mode's
    per-token ``weights`` (N, T) (read by the sequence-level modes); also rho and Q_H, each (N, T)."""
    kind = CENTERING_WEIGHT.get(settings.mode)
    if kind is None:
        raise ValueError(f"score centering: not with is_mode {settings.mode!r}")
    with torch.no_grad():
        valid = torch.isfinite(mu_topk)
        p = torch.where(valid, pi_topk.detach().exp(), 0.0)
        q = torch.where(valid, mu_topk.exp(), 0.0)
        head_q, head_p = q.sum(-1), p.sum(-1)
        tail_q, tail_p = (1 - head_q).clamp(min=0), (1 - head_p).clamp(min=TAIL_FLOOR)
        rho = tail_q / tail_p
        if kind == "one":
            mass, alpha = q, rho
        elif kind == "sequence":
            mass, alpha = q * weights[..., None], rho * weights
        else:
            log_ratio = torch.where(valid, pi_topk.detach() - mu_topk, 0.0)
            mass = torch.where(valid, q * token_weight(log_ratio, settings), 0.0)
            tail_log_ratio = torch.log(tail_p) - torch.log(tail_q.clamp(min=1e-30))  # log(1/rho)
            alpha = torch.where(rho > 0, rho * token_weight(tail_log_ratio, settings), 0.0)
        coef = torch.where(valid, mass - alpha[..., None] * p, 0.0)
    return coef, rho, head_q


def centering_terms(pi_topk: torch.Tensor, mu_topk: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    weights: torch.Tensor, settings: ISSettings) -> tuple[torch.Tensor, dict]:
    """The per-token score-centering loss (N, T), ``A_t sum_H sg(c_v) log p_v``, 0 off the mask, to
    be added to the policy loss's per-token terms, and its metrics (token means):

    score_centering_drift      sum_H |c_v|: how far the sampler's expected score is from 0 (0 when the
                               sampler matches the trainer on the head and the tail)
    score_centering_term       the term itself, A_t C_t
    score_centering_head_mass  Q_H: the sampler's mass the top-k covers
    score_centering_rho        the tail ratio rho
    """
    coef, rho, head_q = centering_coefficients(pi_topk, mu_topk, weights, settings)
    valid = torch.isfinite(mu_topk)
    log_p = torch.where(valid, pi_topk, 0.0)  # no gradient (and no 0 x inf) through a non-candidate
    term = token_advantages(advantages) * (coef * log_p).sum(-1) * mask
    with torch.no_grad():
        metrics = {
            "score_centering_drift": masked_mean(coef.abs().sum(-1), mask).item(),
            "score_centering_term": masked_mean(term, mask).item(),
            "score_centering_head_mass": masked_mean(head_q, mask).item(),
            "score_centering_rho": masked_mean(rho, mask).item(),
        }
    return term, metrics
