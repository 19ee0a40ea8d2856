"""The loss pieces against values worked out by hand on tiny tensors (padding included)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.loss import group_advantages, importance_weights, mismatch_metrics, ppo_clip_loss

# Two samples of different lengths, right-padded: 2 response tokens and 1.
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
PI_OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
MU = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 9.0]])  # junk in the padding must not matter
DELTA = torch.tensor([[0.3, -0.4, 5.0], [0.1, 5.0, 5.0]])
ADV = torch.tensor([1.0, -2.0])


def test_grpo_advantages_by_hand():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), std_norm=True)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of (1, 0, 0, 1)
    expected = [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std]
    assert adv[0].tolist() == pytest.approx(expected, rel=1e-5)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # an all-equal group carries no signal
    plain = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), std_norm=False)
    assert plain[0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_token_tis_weights_truncate_at_the_cap():
    w, m = importance_weights(PI_OLD, MU, MASK, "token_tis", cap=1.5)
    # exp(pi_old - mu) on the response tokens: e^0.5 = 1.6487 (> cap), e^-1, e^0
    assert w[0, :2].tolist() == pytest.approx([1.5, math.exp(-1.0)], rel=1e-6)
    assert w[1, 0].item() == pytest.approx(1.0)
    assert w[0, 2].item() == 0 and w[1, 1:].tolist() == [0, 0]
    assert m["is_truncated_fraction"] == pytest.approx(1 / 3)
    assert m["is_weight_mean"] == pytest.approx((1.5 + math.exp(-1.0) + 1.0) / 3, rel=1e-6)
    assert m["is_weight_max"] == pytest.approx(1.5)
    none, m0 = importance_weights(PI_OLD, MU, MASK, "none", cap=1.5)
    assert none.tolist() == MASK.tolist() and m0["is_truncated_fraction"] == 0


def test_ppo_clip_loss_with_tis_by_hand():
    w, _ = importance_weights(PI_OLD, MU, MASK, "token_tis", cap=1.5)
    pi = (PI_OLD + DELTA).requires_grad_(True)
    loss, m = ppo_clip_loss(pi, PI_OLD, ADV, MASK, w, eps_low=0.2, eps_high=0.28)
    w1, w2, w3 = 1.5, math.exp(-1.0), 1.0
    r1, r2, r3 = math.exp(0.3), math.exp(-0.4), math.exp(0.1)
    t1 = -w1 * min(r1 * 1.0, 1.28 * 1.0)   # ratio clipped above 1 + eps_high
    t2 = -w2 * min(r2 * 1.0, 0.8 * 1.0)    # below 1 - eps_low with A > 0: the unclipped term is smaller
    t3 = -w3 * min(r3 * -2.0, r3 * -2.0)   # inside the clip range
    assert loss.item() == pytest.approx((t1 + t2 + t3) / 3, abs=1e-6)  # float32 terms of size ~2 cancel
    loss.backward()
    # d/dpi of -w * r * A is -w * A * r, zero where the clipped branch is taken; token-mean divides by 3.
    assert pi.grad[0, 0].item() == 0.0
    assert pi.grad[0, 1].item() == pytest.approx(-w2 * 1.0 * r2 / 3, rel=1e-6)
    assert pi.grad[1, 0].item() == pytest.approx(-w3 * -2.0 * r3 / 3, rel=1e-6)
    assert pi.grad[0, 2].item() == 0 and pi.grad[1, 1:].abs().sum().item() == 0
    assert m["ppo_clip_fraction"] == pytest.approx(1 / 3)


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(PI_OLD, MU, MASK)
    d = [0.5, -1.0, 0.0]
    assert m["mismatch_kl"] == pytest.approx(sum(-x for x in d) / 3, rel=1e-6)
    assert m["mismatch_k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 3, rel=1e-6)


def test_identical_policies_have_no_mismatch_and_unit_weights():
    m = mismatch_metrics(PI_OLD, PI_OLD, MASK)
    assert m["mismatch_kl"] == 0 and m["mismatch_k3_kl"] == 0
    w, _ = importance_weights(PI_OLD, PI_OLD, MASK, "token_tis", cap=2.0)
    assert (w == MASK).all()


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="is_mode"):
        importance_weights(PI_OLD, MU, MASK, "sometimes_tis", cap=2.0)
