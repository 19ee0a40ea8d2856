"""On-policy distillation (``learner.teacher``): a frozen teacher grades every token the student sampled.

The signal is the per-token reverse KL on the student's own samples, its k1 estimate at the sampled
token y_t (the form Thinking Machines' "On-Policy Distillation" post and tinker-cookbook's
``incorporate_kl_penalty`` use, and the single-token form of GKD's reverse KL, Agarwal et al. 2024):

    rkl_t = log mu(y_t) - log teacher(y_t)          (mu: the log-prob the sampler reported)
    A_t   = A_i - kl_coef * rkl_t                   (A_i: the sample's task advantage, GRPO/RLOO/...)

It enters as a per-token *advantage* (no gradient through the teacher or through rkl), added after
the task advantage is normalized, so the policy loss (PPO-clip or CISPO, with the is_mode's weight)
moves each token by how much more the student likes it than the teacher does. Not as a loss term:
the k1 estimate's own gradient, grad log pi(y_t), has expectation 0 under pi (the score's mean), so
``kl_coef * (log pi - log teacher)`` in the loss would carry no signal on average; the reverse KL's
gradient is the score weighted by the log-ratio, which is what the advantage gives.

What rlpipe chose where the references leave room:
- The student's log-prob is the sampler's (mu), as the cookbook uses the sampling client's: the
  student a user serves is the one graded, so an int8 engine's drift from the teacher is in the signal.
- The teacher's log-probs come from the learner's no-grad pass (learner/step.py ``_no_grad_pass``,
  the reference model's path), in the learner's precision and after the row's temperature, top-k and
  top-p (learner/policy.py), as the reference's are; |rkl_t| is clamped at ``learner.log_ratio_clamp``.
- No discount: each token's advantage holds its own rkl_t (the cookbook's default, discount 0).
- With a teacher every group has a signal, even one whose rewards are all equal: none is skipped.
  (With ``learner.dynamic_sampling`` such groups are still filtered before the step.)
"""

from __future__ import annotations

import torch

from learner.loss import kl_terms, masked_mean
from learner.reference import frozen_model


def load_teacher(cfg, device: torch.device):
    """The teacher on ``device``, frozen; None when ``learner.teacher.path`` is empty. The tokenizer
    match is checked at launch (rlpipe/teacher_check.py) and here again, for a learner started by hand.
    Always its own copy, even of the student's base under ``learner.lora``: that base is held as the
    engines serve it (int8 included, learner/lora.py), and the teacher is the model as it is."""
    path = cfg.learner.teacher.path
    if not path:
        return None
    from rlpipe.teacher_check import teacher_problem

    if why := teacher_problem(path, str(cfg.model.path)):
        raise SystemExit(why)
    return frozen_model(path, cfg, device)


def distill_advantages(advantages: torch.Tensor, student_lp: torch.Tensor, teacher_lp: torch.Tensor,
                       mask: torch.Tensor, kl_coef: float, clamp: float = 20.0) -> tuple[torch.Tensor, dict]:
    """Per-token advantages (N, T): the task's ``advantages`` (N,) less ``kl_coef`` x each token's
    reverse-KL estimate ``student_lp - teacher_lp`` (each (N, T)), 0 off ``mask``; detached. And the
    step's metrics, measured before the update (token means over ``mask``):

    distill_reverse_kl   the k1 estimate, mean log mu(y) - log teacher(y): the signal itself
    distill_k3           (r - 1) - log r with r = teacher / mu: the same KL, never negative, lower variance
    """
    with torch.no_grad():
        k1 = kl_terms(student_lp, teacher_lp, mask, "k1", clamp)
        per_token = (advantages[:, None] - kl_coef * k1) * mask
        metrics = {"distill_reverse_kl": masked_mean(k1, mask).item(),
                   "distill_k3": masked_mean(kl_terms(student_lp, teacher_lp, mask, "k3", clamp), mask).item()}
    return per_token, metrics
