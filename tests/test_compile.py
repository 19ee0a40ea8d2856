"""``learner.compile``: each decoder layer compiled (inductor) computes what eager does, the
parameter names stay as they are (checkpoints and weight sync read them);
whether it pays is bench/learner_speed.py's question. A compile costs tens of seconds on a CPU,
so this is the suite's one compile.

Compiled and eager kernels sum in different orders, and which order depends on the CPU (AVX2,
AVX-512 and AMX take different paths), so elementwise tolerances tuned on one CPU fail on
another: an embedding row's gradient sums many tokens' contributions that nearly cancel, and one
machine's 9 such elements were off by 1.6e-4. What fp32 guarantees is norm-wise: a sum of n
terms in another order differs by about sqrt(n) * eps relative to the sum of their magnitudes.
So each tensor is compared by its norm-wise relative error, against NORM_TOLERANCE, which is
~100x fp32's eps (the toy's sums are a few hundred terms long) and still 100x below what one
wrong weight does (test_the_check_sees_one_wrong_weight)."""

from __future__ import annotations

import torch

from learner.batch import collate
from learner.policy import compile_layers, load_policy, token_logprobs
from tests.test_learner import synthetic_groups

NORM_TOLERANCE = 1e-5


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||a||, in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    scale = a.norm().item()
    return (a - b).norm().item() / scale if scale else (a - b).norm().item()


def test_compiled_layers_compute_the_same_log_probs_and_gradients(toy_model_path):
    eager, compiled = load_policy(toy_model_path), load_policy(toy_model_path)
    assert compile_layers(compiled) == len(compiled.model.layers) > 1
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    records = synthetic_groups(eager, 4, seed=3)
    batch = collate(records, torch.ones(len(records), 4), 0)
    torch._dynamo.reset()
    for model in (eager, compiled):
        lp, _ = token_logprobs(model, batch, "fp32")
        (-(lp * batch.mask).sum()).backward()
    lp_compiled, lp_eager = token_logprobs(compiled, batch, "fp32")[0], token_logprobs(eager, batch, "fp32")[0]
    assert relative_error(lp_eager, lp_compiled) < NORM_TOLERANCE
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert relative_error(a.grad, b.grad) < NORM_TOLERANCE, name


def test_the_check_sees_one_wrong_weight(toy_model_path):
    """The tolerance is tight enough to fail: one layer's weight off by 1% of its size (a compiled
    layer that read a stale or wrong weight would be off by far more) moves the log-probs' and the
    gradients' norm-wise errors 100x or more past it."""
    right, wrong = load_policy(toy_model_path), load_policy(toy_model_path)
    with torch.no_grad():
        weight = wrong.model.layers[0].mlp.down_proj.weight
        weight.add_(1e-2 * weight.abs().mean() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    records = synthetic_groups(right, 4, seed=3)
    batch = collate(records, torch.ones(len(records), 4), 0)
    for model in (right, wrong):
        lp, _ = token_logprobs(model, batch, "fp32")
        (-(lp * batch.mask).sum()).backward()
    lp_right, lp_wrong = token_logprobs(right, batch, "fp32")[0], token_logprobs(wrong, batch, "fp32")[0]
    errors = {name: relative_error(a.grad, b.grad)
              for (name, a), (_, b) in zip(right.named_parameters(), wrong.named_parameters())}
    print(f"log-probs {relative_error(lp_right, lp_wrong):.2e}, gradients up to {max(errors.values()):.2e}")
    assert relative_error(lp_right, lp_wrong) > 10 * NORM_TOLERANCE
    assert max(errors.values()) > 100 * NORM_TOLERANCE
