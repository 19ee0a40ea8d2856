"""The RL loss as small pure functions with stated shapes (docs/design.md, 'Loss').

Notation, per response token t of sample i:
    mu      behavior log-prob, reported by the rollout engine        (N, T)
    pi_old  learner log-prob when the batch is consumed (no grad)     (N, T)
    pi      learner log-prob now (with grad)                          (N, T)
    mask    1 on response tokens, 0 on prompt and padding             (N, T)

The mismatch weight ``w = exp(pi_old - mu)`` corrects for sampling from ``mu`` (the
rollout engine, in its precision, maybe some versions old) while training ``pi``.
Every log-ratio is clamped to ``[-clamp, clamp]`` before ``exp`` so that one wild token
cannot produce inf or nan. Functions return their metrics as plain floats.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from rlpipe.corrections import IS_MODES, RATIO_AGAINST_MU  # learner.is_mode's values


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 if there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def token_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """A sample's advantage (N,) as every one of its tokens' (N, 1), or per-token advantages (N, T) as they
    are (on-policy distillation adds a per-token term to the sample's: learner/distillation.py)."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


def row_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T) -> (N,): the sum of each row over its response tokens."""
    return (x * mask).sum(dim=1)


def row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T) -> (N,): the mean of each row over its response tokens."""
    return row_sum(x, mask) / mask.sum(dim=1).clamp(min=1)


# -- advantages ------------------------------------------------------------------------------
def compute_advantages(rewards: torch.Tensor, estimator: str = "grpo", std_norm: bool = True,
                       eps: float = 1e-6, negative_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages (G, n) for rewards (G, n), and which groups carry signal (G,) bool.

    grpo          r - mean(group), divided by the group's std when ``std_norm``
    rloo          r_i - mean of the *other* samples of the group = n/(n-1) (r_i - mean)
    reinforce_pp  r - mean(group), then normalised by the mean and std over every sample of
                  the informative groups in the batch (REINFORCE++ with a group baseline)

    A group whose rewards are all equal has no signal under any of them: its advantages
    are 0 and it is reported as not informative, so the learner skips it (dynamic sampling).
    ``negative_scale`` (``learner.negative_scale``) then scales the advantages below 0: pushing
    a sampled token down spreads its mass over the others (entropy grows), while pulling a right
    answer up concentrates it, which is what greedy pass@1 reads.
    """
    informative = (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0
    n = rewards.shape[1]
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        adv = centered / (rewards.std(dim=1, keepdim=True) + eps) if std_norm and n > 1 else centered
    elif estimator == "rloo":
        adv = centered * n / max(n - 1, 1)
    elif estimator == "reinforce_pp":
        signal = centered[informative]
        adv = centered
        if signal.numel() > 1:
            adv = (centered - signal.mean()) / (signal.std() + eps)
    else:
        raise ValueError(f"advantage: unknown estimator {estimator!r}")
    if negative_scale != 1.0:
        adv = torch.where(adv < 0, adv * negative_scale, adv)
    return adv * informative[:, None], informative


# -- importance weights ----------------------------------------------------------------------
@dataclass(frozen=True)
class ISSettings:
    """``learner.is_mode`` and its bounds as one value, built once from the config (:meth:`of`) and passed
    whole: a new setting is one field here, named as its key (or mapped in ``KEYS``)."""

    mode: str = "token_tis"
    cap: float = 2.0  # learner.is_cap: C below
    geo_low: float = 0.5
    geo_high: float = 2.0
    clamp: float = 20.0  # learner.log_ratio_clamp: |log w| at most this before exp
    icepop_beta: float = 2.0
    icepop_alpha: float | None = None
    KEYS: ClassVar[dict[str, str]] = {"mode": "is_mode", "cap": "is_cap", "clamp": "log_ratio_clamp"}

    @classmethod
    def of(cls, learner_config) -> ISSettings:
        """The settings of a ``LearnerConfig``."""
        return cls(**{f.name: getattr(learner_config, cls.KEYS.get(f.name, f.name)) for f in fields(cls)})

    @property
    def against_mu(self) -> bool:
        """Whether the PPO ratio is taken against mu (the behaviour log-probs) instead of pi_old."""
        return self.mode in RATIO_AGAINST_MU


def importance_weights(pi_old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, settings: ISSettings):
    """Per-token mismatch weights (N, T), detached, and their metrics, for the correction ``settings``
    names (its mode, ``C`` its cap).

    With ``w_t = exp(pi_old - mu)`` per token, ``W = prod_t w_t`` per sequence and
    ``g = W ** (1/len)`` its geometric mean:

    none, ppo_is, bypass   1 (ppo_is and bypass correct through the PPO ratio instead)
    vanilla_is             w_t, untruncated (for ablations: unbounded variance)
    token_tis              min(w_t, C)
    seq_tis                min(W, C), the same for every token of the sequence
    token_mis              w_t if w_t <= C else 0 (the token is rejected, not truncated)
    seq_mis                W if W <= C else 0 (the whole sequence is rejected)
    geo_mask               1 if geo_low <= g <= geo_high else 0, per sequence
    icepop                 w_t if alpha <= w_t <= beta else 0: two-sided token masking (IcePop, Ling team,
                           "Small Leak Can Sink a Great Ship", 2025: M(k) = k inside [alpha, beta], 0 outside;
                           its two bounds are independent, and alpha defaults to 1/beta). A token outside the
                           band leaves the loss altogether (masked, not truncated); one inside keeps its
                           weight w_t, as IcePop's M does and slime's ``icepop_function``.
    """
    mode, cap, geo_low, geo_high, clamp = settings.mode, settings.cap, settings.geo_low, settings.geo_high, settings.clamp
    icepop_beta, icepop_alpha = settings.icepop_beta, settings.icepop_alpha
    if mode not in IS_MODES:
        raise ValueError(f"is_mode: unknown mode {mode!r}")
    log_w = (pi_old - mu).clamp(-clamp, clamp) * mask
    w_tok = torch.exp(log_w)
    seq_log_w = log_w.sum(dim=1, keepdim=True).clamp(-clamp, clamp)  # (N, 1)
    w_seq = torch.exp(seq_log_w).expand_as(w_tok)
    no = torch.zeros_like(mask, dtype=torch.bool)
    truncated, rejected = no, no
    if mode in ("none", "ppo_is", "bypass"):
        w = torch.ones_like(w_tok)
    elif mode == "vanilla_is":
        w = w_tok
    elif mode == "token_tis":
        truncated = w_tok > cap
        w = w_tok.clamp(max=cap)
    elif mode == "seq_tis":
        truncated = w_seq > cap
        w = w_seq.clamp(max=cap)
    elif mode == "token_mis":
        rejected = w_tok > cap
        w = w_tok * ~rejected
    elif mode == "seq_mis":
        rejected = w_seq > cap
        w = w_seq * ~rejected
    elif mode == "icepop":
        alpha = 1 / icepop_beta if icepop_alpha is None else icepop_alpha
        rejected = (w_tok < alpha) | (w_tok > icepop_beta)
        w = w_tok * ~rejected
    else:  # geo_mask
        geo = torch.exp(log_w.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1))
        rejected = ((geo < geo_low) | (geo > geo_high)).expand_as(w_tok)
        w = (~rejected).to(w_tok.dtype)
    on = mask.bool()
    w = (w * mask).detach()
    return w, weight_metrics(w, truncated & on, rejected & on, mask)


def weight_metrics(w: torch.Tensor, truncated: torch.Tensor, masked: torch.Tensor, mask: torch.Tensor) -> dict:
    """IS weight statistics over response tokens, and per sequence.

    is_ess is the normalised effective sample size (sum w)^2 / (n sum w^2) in (0, 1]:
    1 when every weight is equal, 1/n when one weight carries everything. is_ess_seq is the
    same over the sequences' mean weights (the relevant one for sequence-level modes).
    """
    n_tok = mask.sum().clamp(min=1)
    w_row = row_mean(w, mask)
    rows = (mask.sum(dim=1) > 0).float()

    def ess(x, m):
        return ((x * m).sum() ** 2 / (m.sum().clamp(min=1) * (x * x * m).sum()).clamp(min=1e-30)).item()

    return {
        "is_weight_mean": ((w * mask).sum() / n_tok).item(),
        "is_weight_max": (w * mask).max().item() if mask.any() else 0.0,
        "is_ess": ess(w, mask),
        "is_ess_seq": ess(w_row, rows),
        "is_truncated_fraction": (truncated.float().sum() / n_tok).item(),
        "is_truncated_seq_fraction": (truncated.any(dim=1).float().sum() / rows.sum().clamp(min=1)).item(),
        "is_masked_fraction": (masked.float().sum() / n_tok).item(),
        "is_masked_seq_fraction": (masked.any(dim=1).float().sum() / rows.sum().clamp(min=1)).item(),
    }


# -- policy loss -------------------------------------------------------------------------------
def ppo_clip_terms(pi: torch.Tensor, ref: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   weights: torch.Tensor, eps_low: float, eps_high: float, clamp: float = 20.0):
    """Per-token PPO-clip loss (N, T), each token scaled by its mismatch weight.

    ``ref`` is pi_old, or mu for the modes that take the ratio against the behavior policy.
    loss_t = -w_t * min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A),  r_t = exp(pi - ref)
    """
    adv = token_advantages(advantages)
    ratio = torch.exp((pi - ref).clamp(-clamp, clamp))
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    per_token = -weights * torch.minimum(unclipped, clipped) * mask
    with torch.no_grad():
        metrics = {
            # tokens where the clipped branch is the one taken (its gradient is zero)
            "ppo_clip_fraction": masked_mean((clipped < unclipped).float(), mask).item(),
            "ppo_ratio_mean": masked_mean(ratio, mask).item(),
        }
    return per_token, metrics


def cispo_terms(pi: torch.Tensor, ref: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                weights: torch.Tensor, eps_low: float, eps_high: float, clamp: float = 20.0):
    """Per-token CISPO loss (N, T) (MiniMax-M1, arXiv 2506.13585): REINFORCE on log pi, each
    token weighted by its clipped importance ratio with the gradient stopped,

        loss_t = -w_t * sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * pi_t,   r_t = exp(pi - ref)

    so unlike PPO-clip no token's gradient is ever dropped: the clip bounds its weight only
    (d loss_t / d pi_t = -w_t * clip(r_t) * A). ``ref`` and ``weights`` are what the PPO path
    gets (pi_old, or mu for ppo_is/bypass; the is_mode's mismatch weight w_t), and they
    compose the same way: the mismatch weight multiplies the token's term. The paper
    aggregates token-level over the batch (``loss_agg: token_mean``). The loss *value* is a
    surrogate (its gradient is the policy gradient); it is what ``learner_loss`` reports.
    """
    adv = token_advantages(advantages)
    ratio = torch.exp((pi - ref).clamp(-clamp, clamp))
    coef = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    per_token = -weights * coef * adv * pi * mask
    with torch.no_grad():
        metrics = {
            "cispo_clip_fraction": masked_mean((coef != ratio).float(), mask).item(),
            "ppo_ratio_mean": masked_mean(ratio, mask).item(),
        }
    return per_token, metrics


POLICY_LOSSES = {"ppo_clip": ppo_clip_terms, "cispo": cispo_terms}


# -- regularisers ------------------------------------------------------------------------------
KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_terms(pi: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, estimator: str,
             clamp: float = 20.0) -> torch.Tensor:
    """Per-token estimates (N, T) of KL(pi || ref) from tokens sampled from pi (Schulman,
    "Approximating KL divergence", 2020), with ``log r = ref - pi`` per token:

    k1   -log r               unbiased, can be negative
    k2   (log r)^2 / 2        biased, low variance
    k3   (r - 1) - log r      unbiased, never negative, low variance

    Gradients flow through ``pi`` (the reference is frozen); 0 off the mask.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: unknown estimator {estimator!r}")
    log_r = (ref - pi).clamp(-clamp, clamp)
    if estimator == "k1":
        k = -log_r
    elif estimator == "k2":
        k = log_r * log_r / 2
    else:
        k = torch.exp(log_r) - 1 - log_r
    return k * mask


def sequence_kl(pi: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """(N, T) -> (N,): each sequence's k1 sum, log pi(y) - log ref(y): the KL penalty that
    ``kl_in: reward`` subtracts (times kl_coef) from each sample's reward."""
    return row_sum(kl_terms(pi, ref, mask, "k1", clamp), mask)


class _Entropy(torch.autograd.Function):
    """H = -sum_v p_v log p_v over the last dimension, saving only the log-probs for the
    backward (dH/dlog p_v = -p_v (log p_v + 1), p recomputed there): the log-softmax keeps
    the same tensor, so the entropy adds no (N, T, V) copy to what the loss already holds."""

    @staticmethod
    def forward(ctx, logp_all):
        ctx.save_for_backward(logp_all)
        return -(logp_all.exp() * logp_all).sum(-1)

    @staticmethod
    def backward(ctx, grad):
        (logp_all,) = ctx.saved_tensors
        return -grad[..., None] * logp_all.exp() * (logp_all + 1)


def token_entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """(N, T, V) normalised log-probs -> (N, T) entropy of each position's distribution.
    Without grad mode (or for a tensor without grad) nothing is kept for a backward."""
    if torch.is_grad_enabled() and logp_all.requires_grad:
        return _Entropy.apply(logp_all)
    return -(logp_all.exp() * logp_all).sum(-1)


LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum_norm")


def loss_sum(per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """The numerator of the aggregated loss; the loss is ``loss_sum / loss_denominator``.

    The two halves are separate so data-parallel ranks can sum their own rows and divide
    by the denominator of the whole minibatch:

    token_mean             sum over all tokens / number of tokens (long answers weigh more)
    seq_mean_token_mean    mean over sequences of each sequence's token mean (each answer weighs the same)
    seq_sum_norm           sum over all tokens / (sequences x norm_length): Dr. GRPO's constant
                           normaliser, with no length bias in either direction
    """
    if agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg: unknown aggregation {agg!r}")
    if agg == "seq_mean_token_mean":
        return row_mean(per_token, mask).sum()
    return (per_token * mask).sum()


def imitation_sum(pi: torch.Tensor, env_mask: torch.Tensor | None, coef: float, agg: str) -> tuple:
    """``learner.tool_imitation``: ``coef`` x the negative log-likelihood of the tokens an in-turn
    tool wrote into the answer, as a :func:`loss_sum` numerator over ``env_mask``, and its mean
    (``tool_nll``). The policy loss never sees those tokens (the model did not sample them);
    this term lets the model learn to write the tool's values itself, so that some of the
    skill stays when it is served without the tool. (0.0, {}) when off."""
    if not coef or env_mask is None:
        return 0.0, {}
    if not env_mask.any():  # a micro-batch without a tool call still reports the key, for the step's mean
        return 0.0, {"tool_nll": 0.0}
    return loss_sum(-coef * pi, env_mask, agg), {"tool_nll": masked_mean(-pi.detach(), env_mask).item()}


def loss_denominator(mask: torch.Tensor, agg: str, norm_length: int) -> float:
    """What :func:`loss_sum` is divided by, from the mask alone."""
    if agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg: unknown aggregation {agg!r}")
    if agg == "token_mean":
        return float(mask.sum().item())
    if agg == "seq_mean_token_mean":
        return float(mask.shape[0])
    return float(mask.shape[0] * norm_length)


# -- mismatch ----------------------------------------------------------------------------------
def after_tool_k3(pi_old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, env_mask: torch.Tensor | None,
                  clamp: float = 20.0) -> float | None:
    """The k3 mismatch (mean e^d - d - 1, d = pi_old - mu) on the first sampled token after each run of
    a tool's tokens inside an answer: where a tool episode's rollout-training mismatch is said to widen
    (the tool's text is context the engine read in another batch shape than the learner). None without one."""
    if env_mask is None:
        return None
    after = mask.bool() & torch.nn.functional.pad(env_mask[:, :-1], (1, 0)).bool()
    if not after.any():
        return None
    d = (pi_old - mu).clamp(-clamp, clamp)[after]
    return (torch.exp(d) - d - 1).mean().item()


def mismatch_metrics(pi_old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, clamp: float = 20.0) -> dict:
    """How far the training policy is from the behavior policy on the sampled tokens.

    With d = pi_old - mu per token (the log of the mismatch weight):
    mismatch_kl                 mean_t(-d): the direct (k1) estimator of KL(mu || pi_old) per token
    mismatch_seq_kl             mean_i sum_t(-d): the same per sequence (grows with length)
    mismatch_k3_kl              mean_t(e^d - d - 1): non-negative, lower-variance k3 estimator
    mismatch_chi2_token         mean_t(e^2d) - 1: chi-square divergence, what drives IS variance
    mismatch_chi2_seq           mean_i(e^(2 sum_t d)) - 1
    mismatch_log_ppl_train      mean_i of -mean_t pi_old (per-token log-perplexity of each sequence)
    mismatch_log_ppl_rollout    mean_i of -mean_t mu
    mismatch_log_ppl_abs_diff   mean_i |log_ppl_train - log_ppl_rollout| (seed 001's indicator, per token)
    mismatch_ppl_ratio          mean_i exp(log_ppl_train - log_ppl_rollout)
    mismatch_prob_diff_max/mean |e^pi_old - e^mu| over tokens
    """
    d = (pi_old - mu).clamp(-clamp, clamp) * mask
    rows = (mask.sum(dim=1) > 0).float()
    n_rows = rows.sum().clamp(min=1)
    ppl_train, ppl_rollout = row_mean(-pi_old, mask), row_mean(-mu, mask)
    ppl_diff = (ppl_train - ppl_rollout).clamp(-clamp, clamp)
    prob_diff = (pi_old.exp() - mu.exp()).abs() * mask
    seq_log_w = row_sum(d, mask)
    return {
        "mismatch_kl": masked_mean(-d, mask).item(),
        "mismatch_seq_kl": ((-seq_log_w) * rows).sum().item() / n_rows.item(),
        "mismatch_k3_kl": masked_mean(torch.exp(d) - d - 1, mask).item(),
        "mismatch_chi2_token": masked_mean(torch.exp(2 * d), mask).item() - 1.0,
        "mismatch_chi2_seq": ((torch.exp(2 * seq_log_w.clamp(-clamp / 2, clamp / 2)) * rows).sum() / n_rows).item() - 1.0,
        "mismatch_log_ppl_train": ((ppl_train * rows).sum() / n_rows).item(),
        "mismatch_log_ppl_rollout": ((ppl_rollout * rows).sum() / n_rows).item(),
        "mismatch_log_ppl_abs_diff": ((ppl_diff.abs() * rows).sum() / n_rows).item(),
        "mismatch_ppl_ratio": ((torch.exp(ppl_diff) * rows).sum() / n_rows).item(),
        "mismatch_prob_diff_max": prob_diff.max().item() if mask.any() else 0.0,
        "mismatch_prob_diff_mean": masked_mean(prob_diff, mask).item(),
    }
