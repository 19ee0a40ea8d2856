"""The loss pieces against values worked out by hand on tiny tensors (padding included)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.loss import (
    IS_MODES,
    cispo_terms,
    compute_advantages,
    imitation_sum,
    ISSettings,
    importance_weights,
    kl_terms,
    loss_denominator,
    loss_sum,
    mismatch_metrics,
    ppo_clip_terms,
    sequence_kl,
    token_entropy,
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


def test_negative_scale_scales_only_the_negative_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    full, _ = compute_advantages(rewards, "grpo")
    adv, informative = compute_advantages(rewards, "grpo", negative_scale=0.25)
    assert informative.tolist() == [True, True, False]
    assert torch.equal(adv[full > 0], full[full > 0])
    assert torch.allclose(adv[full < 0], 0.25 * full[full < 0])
    assert adv[2].abs().sum() == 0  # a group without a spread stays without signal
    assert torch.allclose(compute_advantages(rewards, "grpo", negative_scale=0.0)[0].clamp(max=0), torch.zeros(3, 4))


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
    w, m = importance_weights(PI_OLD, MU, MASK, ISSettings(mode, **kw))
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
    # w = (e^0.5, e^-1, 1): beta 2 keeps [0.5, 2] (e^-1 = 0.37 is out), beta 3 keeps all of them
    ("icepop", {"icepop_beta": 2.0}, [E(0.5), 0, 1], (0, 0), (1 / 3, 1 / 2)),
    ("icepop", {"icepop_beta": 3.0}, [E(0.5), E(-1), 1], (0, 0), (0, 0)),
    ("icepop", {"icepop_beta": 1.5}, [0, 0, 1], (0, 0), (2 / 3, 1 / 2)),
    # independent bounds: [0.3, 1.5] keeps e^-1 (which 1/1.5 drops), [0.5, 3] drops it (which 1/3 keeps)
    ("icepop", {"icepop_beta": 1.5, "icepop_alpha": 0.3}, [0, E(-1), 1], (0, 0), (1 / 3, 1 / 2)),
    ("icepop", {"icepop_beta": 3.0, "icepop_alpha": 0.5}, [E(0.5), 0, 1], (0, 0), (1 / 3, 1 / 2)),
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
        w, m = importance_weights(PI_OLD, wild_mu, MASK, ISSettings(mode, cap=2.0, clamp=20.0))
        assert torch.isfinite(w).all() and math.isfinite(m["is_ess"]), mode
    w, _ = importance_weights(PI_OLD, wild_mu, MASK, ISSettings("vanilla_is", clamp=20.0))
    assert w[0, 0].item() == pytest.approx(E(20.0), rel=1e-5)


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="is_mode"):
        importance_weights(PI_OLD, MU, MASK, ISSettings("sometimes_tis", cap=2.0))


# -- policy loss ----------------------------------------------------------------------------------
def test_ppo_clip_loss_with_tis_by_hand():
    w, _ = importance_weights(PI_OLD, MU, MASK, ISSettings("token_tis", cap=1.5))
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
        w, _ = importance_weights(PI_OLD, PI_OLD, MASK, ISSettings(mode, cap=2.0, geo_low=0.5, geo_high=2.0))
        assert (w == MASK).all(), mode


def test_icepop_masks_exactly_the_tokens_a_loop_finds_outside_the_band():
    gen = torch.Generator().manual_seed(0)
    pi_old, mu = -torch.rand(4, 6, generator=gen) * 3, -torch.rand(4, 6, generator=gen) * 3
    mask = (torch.rand(4, 6, generator=gen) > 0.2).float()
    beta, alpha = 1.7, 0.8
    w, m = importance_weights(pi_old, mu, mask, ISSettings("icepop", icepop_beta=beta, icepop_alpha=alpha))
    masked = 0
    for i in range(4):
        for t in range(6):
            ratio = math.exp(pi_old[i, t] - mu[i, t])
            inside = alpha <= ratio <= beta
            expected = ratio if inside and mask[i, t] else 0.0
            masked += bool(mask[i, t]) and not inside
            assert w[i, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-7), (i, t)
    assert 0 < masked < mask.sum() and m["is_masked_fraction"] == pytest.approx(masked / mask.sum().item())


# -- CISPO --------------------------------------------------------------------------------------
def test_cispo_gradient_is_the_clipped_ratio_times_the_advantage():
    w, _ = importance_weights(PI_OLD, MU, MASK, ISSettings("token_tis", cap=1.5))
    pi = (PI_OLD + DELTA).requires_grad_(True)
    per_token, m = cispo_terms(pi, PI_OLD, ADV, MASK, w, eps_low=1.0, eps_high=0.2)
    loss = loss_sum(per_token, MASK, "token_mean") / loss_denominator(MASK, "token_mean", 8)
    loss.backward()
    # by hand: loss = -(1/3) sum_t w_t c_t A_t pi_t with c_t = clip(r_t, 0, 1.2) a constant,
    # so d loss / d pi_t = -(1/3) w_t c_t A_t, and no token's gradient is zero (unlike PPO-clip).
    w1, w2, w3 = 1.5, E(-1.0), 1.0
    c1, c2, c3 = 1.2, E(-0.4), E(0.1)  # r = e^0.3 = 1.35 clipped to 1.2; e^-0.4 and e^0.1 inside
    assert pi.grad[0, 0].item() == pytest.approx(-w1 * c1 * 1.0 / 3, rel=1e-6)
    assert pi.grad[0, 1].item() == pytest.approx(-w2 * c2 * 1.0 / 3, rel=1e-6)
    assert pi.grad[1, 0].item() == pytest.approx(-w3 * c3 * -2.0 / 3, rel=1e-6)
    assert pi.grad[0, 2].item() == 0 and pi.grad[1, 1:].abs().sum().item() == 0
    p = (PI_OLD + DELTA)
    value = -(w1 * c1 * 1.0 * p[0, 0] + w2 * c2 * 1.0 * p[0, 1] + w3 * c3 * -2.0 * p[1, 0]) / 3
    assert loss.item() == pytest.approx(value.item(), rel=1e-6)
    assert m["cispo_clip_fraction"] == pytest.approx(1 / 3)


def test_cispo_gradient_matches_autograd_of_the_objective_written_out():
    """The same gradient as differentiating sum_t w_t c_t A log pi_t with c_t held constant,
    here with a lower clip too (eps_low 0.1: e^-0.4 = 0.67 is raised to 0.9)."""
    w = torch.tensor([[1.0, 0.5, 0.0], [2.0, 0.0, 0.0]])
    pi = (PI_OLD + DELTA).requires_grad_(True)
    per_token, _ = cispo_terms(pi, PI_OLD, ADV, MASK, w, eps_low=0.1, eps_high=0.2)
    (grad,) = torch.autograd.grad(per_token.sum(), pi)
    x = (PI_OLD + DELTA).requires_grad_(True)
    objective = 0.0
    for i, t in [(0, 0), (0, 1), (1, 0)]:
        c = min(max(math.exp(DELTA[i, t].item()), 0.9), 1.2)
        objective = objective + w[i, t] * c * ADV[i] * x[i, t]
    (expected,) = torch.autograd.grad(-objective, x)
    assert torch.allclose(grad, expected, atol=1e-7)
    assert grad[0, 1].item() == pytest.approx(-0.5 * 0.9 * 1.0, rel=1e-6)


# -- KL against the reference ------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    pi = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 3.0], [-0.5, 7.0, 7.0]])  # junk in the padding
    for estimator, f in {"k1": lambda lr: -lr, "k2": lambda lr: lr * lr / 2,
                         "k3": lambda lr: E(lr) - 1 - lr}.items():
        k = kl_terms(pi, ref, MASK, estimator)
        log_r = [-1.5 + 1.0, -1.0 + 2.0, 0.0]  # ref - pi on the response tokens
        assert [k[0, 0].item(), k[0, 1].item(), k[1, 0].item()] == pytest.approx([f(x) for x in log_r], abs=1e-6)
        assert k[0, 2] == 0 and (k[1, 1:] == 0).all(), estimator
    assert sequence_kl(pi, ref, MASK).tolist() == pytest.approx([0.5 - 1.0, 0.0])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_terms(pi, ref, MASK, "k4")


def test_kl_estimators_of_a_known_distribution_converge_to_the_true_kl():
    # pi and ref over 3 tokens; tokens sampled from pi: k1 and k3 are unbiased, k2 close (small KL).
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.4, 0.4, 0.2])
    true_kl = (p * (p / q).log()).sum().item()
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    pi, ref = p.log()[tokens][None], q.log()[tokens][None]
    ones = torch.ones_like(pi)
    for estimator, tol in (("k1", 2e-3), ("k3", 2e-3), ("k2", 5e-3)):
        assert kl_terms(pi, ref, ones, estimator).mean().item() == pytest.approx(true_kl, abs=tol), estimator
    assert (kl_terms(pi, ref, ones, "k3") >= 0).all()


def test_kl_in_the_loss_and_in_the_reward_by_hand():
    """kl_in loss: coef x k3 per token joins the token-mean loss, its gradient through pi only;
    kl_in reward: each sample's reward less coef x its k1 sum, before the advantages."""
    coef = 0.1
    ref = torch.tensor([[-1.2, -1.5, 0.0], [-0.7, 0.0, 0.0]])
    pi = PI_OLD.clone().requires_grad_(True)
    kl = coef * kl_terms(pi, ref, MASK, "k3")
    (loss_sum(kl, MASK, "token_mean") / loss_denominator(MASK, "token_mean", 8)).backward()
    # d/dpi of (e^(ref - pi) - 1 - (ref - pi)) = 1 - e^(ref - pi)
    for (i, t) in [(0, 0), (0, 1), (1, 0)]:
        expected = coef * (1 - E(ref[i, t].item() - PI_OLD[i, t].item())) / 3
        assert pi.grad[i, t].item() == pytest.approx(expected, rel=1e-5)
    rewards = torch.tensor([[1.0, 0.0]])  # one group of the two rows
    shaped = rewards - coef * sequence_kl(PI_OLD, ref, MASK).view_as(rewards)
    # k1 sums: row 0 (-1 + 1.2) + (-2 + 1.5) = -0.3, row 1 -0.5 + 0.7 = 0.2
    assert shaped[0].tolist() == pytest.approx([1.0 + 0.03, 0.0 - 0.02])


# -- entropy ----------------------------------------------------------------------------------------
def test_token_entropy_and_its_gradient_against_a_softmax_loop():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 3, 5, generator=gen) * 2).requires_grad_(True)
    h = token_entropy(torch.log_softmax(logits, dim=-1))
    direct = torch.zeros(2, 3)
    for i in range(2):
        for t in range(3):
            z = [math.exp(v) for v in logits[i, t].tolist()]
            probs = [v / sum(z) for v in z]
            direct[i, t] = -sum(p * math.log(p) for p in probs)
    assert torch.allclose(h.detach(), direct, atol=1e-6)
    weights = torch.randn(2, 3, generator=gen)
    (grad,) = torch.autograd.grad((h * weights).sum(), logits)
    x = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(x, dim=-1)
    (expected,) = torch.autograd.grad((-(p * p.log()).sum(-1) * weights).sum(), x)
    assert torch.allclose(grad, expected, atol=1e-6)


def test_entropy_bonus_only_carries_a_gradient_when_asked():
    from learner.policy import token_logprobs
    from tests.test_topk_topp import LogitsModel, make_batch

    batch = make_batch([[1, 2, 3], [1, 4, 0]], [{"temperature": 0.8}, {"top_k": 3}])
    model = LogitsModel(torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(4)))
    _, plain = token_logprobs(model, batch)
    assert not plain.requires_grad  # entropy_coef 0: nothing of it is kept for a backward
    _, ent = token_logprobs(model, batch, entropy_grad=True)
    assert torch.equal(ent.detach(), plain)
    bonus = -0.01 * loss_sum(ent, batch.mask, "token_mean") / loss_denominator(batch.mask, "token_mean", 8)
    bonus.backward()
    grad = model.logits.grad[:, :-1]
    assert torch.isfinite(grad).all() and grad.abs().max() > 0


def test_tool_imitation_trains_the_tools_tokens_only_and_is_off_at_zero():
    """learner.tool_imitation: the gradient of the term reaches exactly the environment positions,
    scaled by the weight, and nothing when the weight is 0."""
    pi = torch.tensor([[-0.5, -2.0, -1.0], [-0.1, -3.0, -0.2]], requires_grad=True)
    env = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    total, m = imitation_sum(pi, env, 0.5, "token_mean")
    total.backward()
    assert torch.allclose(pi.grad, -0.5 * env)
    assert m["tool_nll"] == pytest.approx((2.0 + 3.0 + 0.2) / 3)
    assert imitation_sum(pi, env, 0.0, "token_mean") == (0.0, {})
    assert imitation_sum(pi, None, 1.0, "token_mean") == (0.0, {})
    assert imitation_sum(pi, torch.zeros_like(env), 1.0, "token_mean") == (0.0, {"tool_nll": 0.0})


def test_the_is_settings_are_built_from_the_config_whole():
    """One object carries learner.is_mode and its bounds: each field reads its config key."""
    from rlpipe.config import build_config

    lc = build_config({"learner": {"is_mode": "icepop", "is_cap": 3.0, "geo_low": 0.4, "geo_high": 2.5,
                                   "log_ratio_clamp": 10.0, "icepop_beta": 4.0, "icepop_alpha": 0.3}},
                      environ={}).learner
    assert ISSettings.of(lc) == ISSettings("icepop", 3.0, 0.4, 2.5, 10.0, 4.0, 0.3)
    assert ISSettings("bypass").against_mu and not ISSettings("token_tis").against_mu


def test_the_mismatch_after_a_tool_reads_the_first_sampled_token_after_each_tool_run():
    from learner.loss import after_tool_k3

    # row 0: model, model, tool, tool, model (the boundary), model; row 1: no tool
    mask = torch.tensor([[1., 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]])
    env = torch.tensor([[0., 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    mu = torch.zeros(2, 6)
    pi = torch.zeros(2, 6)
    pi[0, 4] = 0.5  # only the boundary token differs
    d = torch.tensor(0.5)
    assert after_tool_k3(pi, mu, mask, env) == pytest.approx(float(torch.exp(d) - d - 1))
    pi[0, 5] = 3.0  # a token further on is not the boundary's
    assert after_tool_k3(pi, mu, mask, env) == pytest.approx(float(torch.exp(d) - d - 1))
    assert after_tool_k3(pi, mu, mask, None) is None and after_tool_k3(pi, mu, mask, torch.zeros(2, 6)) is None
