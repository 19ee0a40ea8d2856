"""The frozen reference policy of the KL penalty (``learner.kl_coef`` > 0).

The reference is the base model, ``model.path`` as the run started, never updated (a
learner resumed from a checkpoint still loads the base model here, not the checkpoint).
It runs only without grad, through the same micro-batches as the pi_old pass and in the
learner's compute precision (``learner.dtype`` autocast over its fp32 weights, exactly as
the policy runs, so at step 0 the two are the same function and the KL is 0). With
``learner.served_weights`` the policy runs at its weights rounded as the engines hold them
(learner/served.py), and so does the reference, rounded once here: the KL is between the
served policy and the base model as an engine would serve it, 0 at step 0 again.

Under DDP and FSDP each rank holds a whole copy (not sharded, not wrapped): its forwards
need no other rank, so ranks may run different numbers of them. That costs one full fp32
copy of the weights per rank; sharding it with the policy would halve nothing of the
optimizer state, which dominates, and would need the padded, collective forwards the
pi_old pass has.
"""

from __future__ import annotations

import torch

from learner.lora import BaseView
from learner.policy import load_policy
from learner.served import served_dtype


def load_reference(cfg, device: torch.device, policy=None, collective: bool = False):
    """The reference model on ``device``, frozen and in eval mode; None when ``learner.kl_coef`` is 0.
    Under ``learner.lora`` the base is frozen already: the reference is ``policy`` with its
    adapter off (learner/lora.py ``BaseView``; ``collective``: its forwards are FSDP's collectives)."""
    if not cfg.learner.kl_coef:
        return None
    if cfg.learner.lora.rank:
        return BaseView(policy, collective)
    return frozen_model(cfg.model.path, cfg, device)


def frozen_model(path: str, cfg, device: torch.device):
    """The model at ``path`` on ``device``, frozen and in eval mode, its weights rounded as the engines
    hold the policy's when the learner runs at served weights: the reference, and the distillation
    teacher (learner/distillation.py), so that one equal to the student is the served student."""
    model = load_policy(path).to(device)
    model.requires_grad_(False)
    if (dtype := served_dtype(cfg)) is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype))
    return model.eval()
