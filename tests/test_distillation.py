"""On-policy distillation (learner/distillation.py): the per-token advantage against a reference written
out, its expected gradient against the exact reverse KL's, a teacher equal to the student gives no signal,
a different one the signal a direct computation gives, and teachers that cannot teach are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from learner.distillation import distill_advantages
from learner.loss import ISSettings, importance_weights, loss_denominator, loss_sum, ppo_clip_terms
from rlpipe.config import ConfigError, build_config
from rlpipe.teacher_check import teacher_problem
from tests.conftest import learner_logprobs
from tests.test_learner import base_model, for_run, make_learner, synthetic_groups  # noqa: F401 (base_model: a fixture)

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
MU = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 9.0]])  # junk in the padding must not matter
TEACHER = torch.tensor([[-1.5, -0.5, 3.0], [-40.0, 1.0, 1.0]])  # row 1: a token the teacher all but rules out
ADV = torch.tensor([1.0, -2.0])


def reference(adv, mu, teacher, mask, coef, clamp):
    """A_t = A_i - coef * clamp(log mu(y_t) - log teacher(y_t)) on the response tokens, in loops."""
    out = torch.zeros_like(mu)
    for i in range(mu.shape[0]):
        for t in range(mu.shape[1]):
            if mask[i, t]:
                out[i, t] = adv[i] - coef * max(-clamp, min(clamp, mu[i, t].item() - teacher[i, t].item()))
    return out


def test_the_per_token_advantage_equals_the_reference_and_reports_the_reverse_kl():
    got, m = distill_advantages(ADV, MU, TEACHER, MASK, kl_coef=0.5, clamp=20.0)
    assert torch.allclose(got, reference(ADV, MU, TEACHER, MASK, 0.5, 20.0))
    assert got[1, 0].item() == pytest.approx(-2.0 - 0.5 * 20.0)  # 39.5 clamped at log_ratio_clamp
    assert m["distill_reverse_kl"] == pytest.approx((0.5 - 1.5 + 20.0) / 3)
    k3 = [torch.exp(torch.tensor(d)) - 1 - d for d in (-0.5, 1.5, -20.0)]  # log r = teacher - mu, clamped
    assert m["distill_k3"] == pytest.approx(float(sum(k3)) / 3, rel=1e-6)
    assert not got.requires_grad


def test_the_loss_and_its_gradient_with_per_token_advantages_equal_the_reference():
    """PPO-clip with the distillation's per-token advantages, value and gradient, against the same
    objective written token by token (as tests/test_loss.py checks the IS modes)."""
    adv, _ = distill_advantages(ADV, MU, TEACHER, MASK, kl_coef=0.3, clamp=20.0)
    pi_old = MU + torch.tensor([[0.2, -0.1, 0.0], [0.05, 0.0, 0.0]])
    w, _ = importance_weights(pi_old, MU, MASK, ISSettings("token_tis", cap=1.1))
    delta = torch.tensor([[0.4, -0.3, 0.0], [0.1, 0.0, 0.0]])
    pi = (pi_old + delta).requires_grad_(True)
    per_token, _ = ppo_clip_terms(pi, pi_old, adv, MASK, w, eps_low=0.2, eps_high=0.28)
    loss = loss_sum(per_token, MASK, "token_mean") / loss_denominator(MASK, "token_mean", 8)
    loss.backward()
    x = (pi_old + delta).requires_grad_(True)
    expected = 0.0
    for i, t in [(0, 0), (0, 1), (1, 0)]:
        a = ADV[i].item() - 0.3 * max(-20.0, min(20.0, MU[i, t].item() - TEACHER[i, t].item()))
        r = torch.exp(x[i, t] - pi_old[i, t])
        wt = min(torch.exp(pi_old[i, t] - MU[i, t]).item(), 1.1)
        expected = expected - wt * torch.minimum(r * a, r.clamp(0.8, 1.28) * a) / 3
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(pi.grad, x.grad, atol=1e-7) and pi.grad.abs().sum() > 0


def test_its_expected_gradient_is_the_exact_reverse_kls():
    """On-policy (pi = mu, ratio 1), no task reward: the loss's gradient summed over every token the
    student could sample, each weighted by its probability, is the gradient of KL(student || teacher)
    computed over the whole vocabulary. (The k1 estimate put in the loss instead would give 0 here.)"""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, generator=g, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(6, generator=g), -1)
    logp = torch.log_softmax(logits, -1)
    pi = logp[:, None]  # (V, 1): one row per token the student could sample
    mu, mask = pi.detach(), torch.ones(6, 1)
    adv, _ = distill_advantages(torch.zeros(6), mu, teacher[:, None], mask, kl_coef=1.0)
    per_token, _ = ppo_clip_terms(pi, mu, adv, mask, torch.ones(6, 1), 0.2, 0.28)
    (got,) = torch.autograd.grad((logp.exp().detach() * per_token[:, 0]).sum(), logits)
    fresh = torch.log_softmax(logits, -1)
    exact = (fresh.exp() * (fresh - teacher)).sum()
    (want,) = torch.autograd.grad(exact, logits)
    assert torch.allclose(got, want, atol=1e-6) and want.abs().sum() > 1e-3


@pytest.fixture(scope="module")
def other_teacher(toy_model_path, tmp_path_factory):
    """The toy with every weight moved a little: the student's tokenizer, another model."""
    from learner.policy import load_policy

    out = tmp_path_factory.mktemp("teacher")
    model = load_policy(toy_model_path)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{toy_model_path}/{name}", out / name)
    return str(out), model


# At the master weights, as the synthetic groups' mu (with served weights the teacher is rounded as served).
FP32 = {"learner.served_weights": False}


def test_a_teacher_equal_to_the_student_gives_no_signal(redis_server, toy_model_path, tmp_path, base_model):  # noqa: F811
    records = synthetic_groups(base_model, 3, seed=4, noise=0.0)  # mu: the student's own log-probs
    plain = make_learner(redis_server, toy_model_path, tmp_path, **FP32).ppo.train_step(records)
    taught = make_learner(redis_server, toy_model_path, tmp_path, **{"learner.teacher.path": toy_model_path, **FP32})
    m = taught.ppo.train_step(records)
    assert abs(m["distill_reverse_kl"]) < 1e-6 and m["distill_k3"] < 1e-7  # float rounding only
    assert m["learner_loss"] == pytest.approx(plain["learner_loss"], rel=1e-4, abs=1e-6)
    assert "distill_reverse_kl" not in plain


def test_another_teacher_grades_each_token_and_moves_the_step(redis_server, toy_model_path, tmp_path, base_model,  # noqa: F811
                                                              other_teacher):
    path, teacher = other_teacher
    records = synthetic_groups(base_model, 3, seed=4, noise=0.0)
    plain = make_learner(redis_server, toy_model_path, tmp_path, **FP32).ppo.train_step(records)
    learner = make_learner(redis_server, toy_model_path, tmp_path, **{"learner.teacher.path": path, **FP32})
    assert not any(p.requires_grad for p in learner.ppo.teacher.parameters())
    flat = for_run(records, learner.cfg)
    m = learner.ppo.train_step(flat)
    diffs = [float(d) for rec in flat for s in rec.samples
             for d in (torch.as_tensor(s.logprobs) - learner_logprobs(teacher, rec.prompt_tokens, s.tokens))]
    assert m["distill_reverse_kl"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-4)
    assert m["distill_k3"] > 1e-3 and m["learner_loss"] != pytest.approx(plain["learner_loss"], rel=1e-3)


def test_a_teacher_that_cannot_teach_is_refused_at_launch(toy_model_path, tmp_path):
    from launch.checks import validate_run

    def run(teacher):
        return build_config({}, environ={}, **{"model.path": toy_model_path, "learner.teacher.path": teacher})

    with pytest.raises(ConfigError, match=r"learner\.teacher\.path: .*nowhere is not a directory"):
        validate_run(run(str(tmp_path / "nowhere")))
    same = tmp_path / "same"
    shutil.copytree(toy_model_path, same)
    assert teacher_problem(str(same), toy_model_path) is None
    other = tmp_path / "other"
    shutil.copytree(toy_model_path, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]  # the same tokens, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"learner\.teacher\.path: .*other/tokenizer\.json's vocabulary is not "
                                          r"the student's .*2 ids name other tokens"):
        validate_run(run(str(other)))
    (other / "config.json").unlink()
    assert "has no config.json" in teacher_problem(str(other), toy_model_path)
    assert build_config({}, environ={}).learner.teacher.path == ""  # off by default
