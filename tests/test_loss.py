"""The loss pieces against values worked out by hand on tiny tensors (padding included)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.loss import (
    IS_MODES,
    compute_advantages,
    importance_weights,
    loss_denominator,
    loss_sum,
    mismatch_metrics,
    ppo_clip_terms,
)

# Two samples of different lengths, right-padded: 2 response tokens and 1.
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
PI_OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
MU = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 9.0]])  # junk in the padding must not matter
# log w = pi_old - mu on the response tokens: row 0 (0.5, -1.0), row 1 (0.0).
# Sequence weights W: row 0 e^-0.5 = 0.6065, row 1 1.0; geometric means e^-0.25 = 0.7788 and 1.0.
DELTA = torch.tensor([[0.3, -0.4, 5.0], [0.1, 5.0, 5.0]])
ADV = torch.tensor([1.0, -2.0])
E = math.exp


# -- advantages ---------------------------------------------------------------------------------
def test_grpo_advantages_by_hand():
    adv, informative = compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), "grpo")
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of (1, 0, 0, 1)
    assert adv[0].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0] and informative.tolist() == [True, False]
    plain, _ = compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), "grpo", std_norm=False)
    assert plain[0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_subtracts_the_mean_of_the_other_samples():
    adv, _ = compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0]]), "rloo")
    assert adv[0].tolist() == pytest.approx([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    assert adv[1].tolist() == pytest.approx([3.0, -1.0, -1.0, -1.0])


def test_reinforce_pp_normalises_over_the_informative_groups_of_the_batch():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    adv, informative = compute_advantages(rewards, "reinforce_pp")
    # centered rows 0 and 2: (.75, -.25, -.25, -.25) and (1.5, -.5, -.5, -.5); their 8 values
    # have mean 0 and unbiased variance (0.75 + 3.0) / 7. The flat group stays out of the statistics.
    std = math.sqrt(3.75 / 7)
    assert adv[0].tolist() == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)
    assert adv[2].tolist() == pytest.approx([1.5 / std, -0.5 / std, -0.5 / std, -0.5 / std], rel=1e-5)
    assert adv[1].tolist() == [0.0] * 4 and informative.tolist() == [True, False, True]


def test_unknown_estimator_is_an_error():
    with pytest.raises(ValueError, match="advantage"):
        compute_advantages(torch.ones(1, 2), "ppo")


# -- importance weights ---------------------------------------------------------------------------
def weights(mode, **kw):
    w, m = importance_weights(PI_OLD, MU, MASK, mode, **kw)
    assert w[0, 2] == 0 and (w[1, 1:] == 0).all(), "padding carries no weight"
    return [w[0, 0].item(), w[0, 1].item(), w[1, 0].item()], m


@pytest.mark.parametrize("mode,kw,expected,truncated,masked", [
    ("none", {}, [1, 1, 1], (0, 0), (0, 0)),
    ("ppo_is", {}, [1, 1, 1], (0, 0), (0, 0)),
    ("bypass", {}, [1, 1, 1], (0, 0), (0, 0)),
    ("vanilla_is", {}, [E(0.5), E(-1), 1], (0, 0), (0, 0)),
    ("token_tis", {"cap": 1.5}, [1.5, E(-1), 1], (1 / 3, 1 / 2), (0, 0)),
    ("seq_tis", {"cap": 0.9}, [E(-0.5), E(-0.5), 0.9], (1 / 3, 1 / 2), (0, 0)),
    ("seq_tis", {"cap": 2.0}, [E(-0.5), E(-0.5), 1], (0, 0), (0, 0)),
    ("token_mis", {"cap": 1.5}, [0, E(-1), 1], (0, 0), (1 / 3, 1 / 2)),
    ("seq_mis", {"cap": 0.9}, [E(-0.5), E(-0.5), 0], (0, 0), (1 / 3, 1 / 2)),
    ("geo_mask", {"geo_low": 0.8, "geo_high": 1.2}, [0, 0, 1], (0, 0), (2 / 3, 1 / 2)),
    ("geo_mask", {"geo_low": 0.7, "geo_high": 0.99}, [1, 1, 0], (0, 0), (1 / 3, 1 / 2)),
])
def test_every_is_mode_by_hand(mode, kw, expected, truncated, masked):
    w, m = weights(mode, **kw)
    assert w == pytest.approx(expected, rel=1e-6)
    assert (m["is_truncated_fraction"], m["is_truncated_seq_fraction"]) == pytest.approx(truncated)
    assert (m["is_masked_fraction"], m["is_masked_seq_fraction"]) == pytest.approx(masked)
    assert m["is_weight_mean"] == pytest.approx(sum(expected) / 3, rel=1e-6)
    assert m["is_weight_max"] == pytest.approx(max(expected), rel=1e-6)


def test_effective_sample_size_by_hand():
    _, m = weights("token_tis", cap=1.5)
    w = [1.5, E(-1), 1.0]
    assert m["is_ess"] == pytest.approx(sum(w) ** 2 / (3 * sum(x * x for x in w)), rel=1e-6)
    rows = [(1.5 + E(-1)) / 2, 1.0]  # per-sequence mean weights
    assert m["is_ess_seq"] == pytest.approx(sum(rows) ** 2 / (2 * sum(x * x for x in rows)), rel=1e-6)
    _, flat = weights("none")
    assert flat["is_ess"] == pytest.approx(1.0) and flat["is_ess_seq"] == pytest.approx(1.0)


def test_log_ratios_are_clamped_so_weights_stay_finite():
    wild_mu = MU.clone()
    wild_mu[0, 0] = -500.0  # pi_old - mu = 499
    for mode in IS_MODES:
        w, m = importance_weights(PI_OLD, wild_mu, MASK, mode, cap=2.0, clamp=20.0)
        assert torch.isfinite(w).all() and math.isfinite(m["is_ess"]), mode
    w, _ = importance_weights(PI_OLD, wild_mu, MASK, "vanilla_is", clamp=20.0)
    assert w[0, 0].item() == pytest.approx(E(20.0), rel=1e-5)


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="is_mode"):
        importance_weights(PI_OLD, MU, MASK, "sometimes_tis", cap=2.0)


# -- policy loss ----------------------------------------------------------------------------------
def test_ppo_clip_loss_with_tis_by_hand():
    w, _ = importance_weights(PI_OLD, MU, MASK, "token_tis", cap=1.5)
    pi = (PI_OLD + DELTA).requires_grad_(True)
    per_token, m = ppo_clip_terms(pi, PI_OLD, ADV, MASK, w, eps_low=0.2, eps_high=0.28)
    total, denom = loss_sum(per_token, MASK, "token_mean"), loss_denominator(MASK, "token_mean", 8)
    loss = total / denom
    w1, w2, w3 = 1.5, E(-1.0), 1.0
    r1, r2, r3 = E(0.3), E(-0.4), E(0.1)
    t1 = -w1 * min(r1 * 1.0, 1.28 * 1.0)   # ratio clipped above 1 + eps_high
    t2 = -w2 * min(r2 * 1.0, 0.8 * 1.0)    # below 1 - eps_low with A > 0: the unclipped term is smaller
    t3 = -w3 * min(r3 * -2.0, r3 * -2.0)   # inside the clip range
    assert denom == 3 and loss.item() == pytest.approx((t1 + t2 + t3) / 3, abs=1e-6)
    loss.backward()
    # d/dpi of -w * r * A is -w * A * r, zero where the clipped branch is taken; token-mean divides by 3.
    assert pi.grad[0, 0].item() == 0.0
    assert pi.grad[0, 1].item() == pytest.approx(-w2 * 1.0 * r2 / 3, rel=1e-6)
    assert pi.grad[1, 0].item() == pytest.approx(-w3 * -2.0 * r3 / 3, rel=1e-6)
    assert pi.grad[0, 2].item() == 0 and pi.grad[1, 1:].abs().sum().item() == 0
    assert m["ppo_clip_fraction"] == pytest.approx(1 / 3)


def test_ppo_is_takes_the_ratio_against_the_behavior_policy():
    pi = (PI_OLD + DELTA).requires_grad_(True)
    per_token, _ = ppo_clip_terms(pi, MU, ADV, MASK, torch.ones_like(MASK) * MASK, 0.2, 0.28)
    # r = exp(pi - mu) = exp(log w + delta): e^0.8 (clipped to 1.28), e^-1.4, e^0.1 (A = -2)
    assert per_token[0, :2].tolist() == pytest.approx([-1.28, -E(-1.4)], rel=1e-6)
    assert per_token[1, 0].item() == pytest.approx(2 * E(0.1), rel=1e-6)
    per_token.sum().backward()
    assert pi.grad[0, 0].item() == 0.0 and pi.grad[0, 1].item() == pytest.approx(-E(-1.4), rel=1e-6)


def test_loss_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 7.0], [3.0, 7.0, 7.0]])  # 7s sit in the padding
    cases = {"token_mean": 6 / 3, "seq_mean_token_mean": (1.5 + 3.0) / 2, "seq_sum_norm": 6 / (2 * 4)}
    for agg, expected in cases.items():
        total, denom = loss_sum(per_token, MASK, agg), loss_denominator(MASK, agg, norm_length=4)
        assert total.item() / denom == pytest.approx(expected), agg
    with pytest.raises(ValueError, match="loss_agg"):
        loss_sum(per_token, MASK, "median")
    with pytest.raises(ValueError, match="loss_agg"):
        loss_denominator(MASK, "median", 4)


# -- mismatch metrics ------------------------------------------------------------------------------
def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(PI_OLD, MU, MASK)
    d = [0.5, -1.0, 0.0]
    assert m["mismatch_kl"] == pytest.approx(sum(-x for x in d) / 3, rel=1e-6)
    assert m["mismatch_seq_kl"] == pytest.approx((0.5 + 0.0) / 2, rel=1e-6)
    assert m["mismatch_k3_kl"] == pytest.approx(sum(E(x) - x - 1 for x in d) / 3, rel=1e-6)
    assert m["mismatch_chi2_token"] == pytest.approx(sum(E(2 * x) for x in d) / 3 - 1, rel=1e-6)
    assert m["mismatch_chi2_seq"] == pytest.approx((E(-1.0) + 1.0) / 2 - 1, rel=1e-6)
    # per-token log-perplexities: train (1.5, 0.5), rollout (1.25, 0.5)
    assert m["mismatch_log_ppl_train"] == pytest.approx(1.0) and m["mismatch_log_ppl_rollout"] == pytest.approx(0.875)
    assert m["mismatch_log_ppl_abs_diff"] == pytest.approx(0.125)
    assert m["mismatch_ppl_ratio"] == pytest.approx((E(0.25) + 1) / 2, rel=1e-6)
    diffs = [E(-1.0) - E(-1.5), E(-1.0) - E(-2.0), 0.0]
    assert m["mismatch_prob_diff_max"] == pytest.approx(max(diffs), rel=1e-6)
    assert m["mismatch_prob_diff_mean"] == pytest.approx(sum(diffs) / 3, rel=1e-6)


def test_identical_policies_have_no_mismatch_and_unit_weights():
    m = mismatch_metrics(PI_OLD, PI_OLD, MASK)
    assert m["mismatch_kl"] == 0 and m["mismatch_k3_kl"] == 0 and m["mismatch_log_ppl_abs_diff"] == 0
    assert m["mismatch_chi2_token"] == 0 and m["mismatch_ppl_ratio"] == 1
    for mode in IS_MODES:
        w, _ = importance_weights(PI_OLD, PI_OLD, MASK, mode, cap=2.0, geo_low=0.5, geo_high=2.0)
        assert (w == MASK).all(), mode
