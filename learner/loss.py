"""The RL loss as small pure functions with stated shapes (DESIGN.md, 'Loss').

Notation, per response token t of sample i:
    mu      behavior log-prob, reported by the rollout engine        (N, T)
    pi_old  learner log-prob when the batch is consumed (no grad)     (N, T)
    pi      learner log-prob now (with grad)                          (N, T)
    mask    1 on response tokens, 0 on prompt and padding             (N, T)

The mismatch weight ``w = exp(pi_old - mu)`` corrects for sampling from ``mu`` while
training ``pi``; truncated importance sampling (TIS) caps it at ``C``. Every function
returns its metrics as plain floats next to its result.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: large enough to never bind in practice, small enough to stay finite


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 if there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def group_advantages(rewards: torch.Tensor, std_norm: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, optionally over the group's std.

    rewards: (G, n) -> (G, n). A group whose rewards are all equal gets zeros.
    """
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if std_norm:
        centered = centered / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centered


def importance_weights(pi_old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, mode: str, cap: float):
    """Per-token mismatch weights (N, T), detached, and their metrics.

    none       w = 1
    token_tis  w = min(exp(pi_old - mu), cap)
    """
    log_ratio = (pi_old - mu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask
    raw = torch.exp(log_ratio)
    if mode == "none":
        w = torch.ones_like(raw)
    elif mode == "token_tis":
        w = raw.clamp(max=cap)
    else:
        raise ValueError(f"is_mode: unknown mode {mode!r}")
    w = (w * mask).detach()
    metrics = {
        "is_weight_mean": masked_mean(w, mask).item(),
        "is_weight_max": (w * mask).max().item() if mask.any() else 0.0,
        "is_truncated_fraction": masked_mean((raw > cap).float(), mask).item() if mode == "token_tis" else 0.0,
    }
    return w, metrics


def ppo_clip_loss(pi: torch.Tensor, pi_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  weights: torch.Tensor, eps_low: float, eps_high: float):
    """Token-mean PPO-clip loss, each token scaled by its mismatch weight.

    pi, pi_old, mask, weights: (N, T); advantages: (N,) broadcast over tokens.
    loss = -mean_t w_t * min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A),  r_t = exp(pi - pi_old)
    """
    adv = advantages[:, None]
    ratio = torch.exp((pi - pi_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    per_token = -weights * torch.minimum(unclipped, clipped)
    loss = masked_mean(per_token, mask)
    with torch.no_grad():
        metrics = {
            # tokens where the clipped branch is the one taken (its gradient is zero)
            "ppo_clip_fraction": masked_mean((clipped < unclipped).float(), mask).item(),
            "ppo_ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss, metrics


def mismatch_metrics(pi_old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the training policy is from the behavior policy on the sampled tokens.

    mismatch_kl     mean(mu - pi_old): the direct estimator of KL(mu || pi_old) on tokens sampled from mu
    mismatch_k3_kl  mean(exp(d) - d - 1), d = pi_old - mu: the non-negative, lower-variance k3 estimator
    """
    d = (pi_old - mu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "mismatch_kl": masked_mean(-d, mask).item(),
        "mismatch_k3_kl": masked_mean(torch.exp(d) - d - 1, mask).item(),
    }
