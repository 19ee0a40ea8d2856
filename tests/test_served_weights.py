"""``learner.served_weights``: with bf16/fp16 rollout the learner's forwards run at the
weights rounded as the engines hold them, and the fp32 master takes the update. On a real
model at a real learning rate most of an update is below bf16's resolution (learner/policy.py
ServedWeights): a learner at the master weights trains a policy no engine serves."""

from __future__ import annotations

import pytest
import torch

from learner.served import ServedWeights, join_bf16, served_dtype, split_bf16
from rlpipe.config import build_config
from tests.test_learner import params_vector
from tests.test_microbatch import learner_with, synthetic_groups_cache


@pytest.mark.parametrize("settings, dtype", [
    ({}, torch.bfloat16),  # the default: bf16 rollout
    ({"rollout.precision": "fp16"}, torch.float16),
    ({"rollout.precision": "int8"}, None),  # quantized on the learner: nothing to round to
    ({"rollout.fleet": ["bf16", "fp16"]}, None),  # engines hold different weights
    ({"learner.served_weights": False}, None),
])
def test_the_served_dtype_follows_the_rollout_precision(settings, dtype):
    assert served_dtype(build_config({}, environ={}, **settings)) == dtype


def test_rounded_weights_inside_and_the_exact_master_after():
    layer = torch.nn.Linear(8, 8)
    with torch.no_grad():
        layer.weight.add_(1e-5)  # off the bf16 grid
    master = layer.weight.detach().clone()
    served = ServedWeights(layer.parameters(), torch.bfloat16)
    served.begin_step()
    with served.rounded():
        assert torch.equal(layer.weight, master.to(torch.bfloat16).float())
        layer(torch.ones(1, 8)).sum().backward()
    assert torch.equal(layer.weight, master) and layer.weight.grad is not None
    with torch.no_grad():
        layer.weight.add_(1e-7)  # far below half a bf16 step of weights this size: nothing visible
    assert served.visible_fraction() < 0.05
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(1.5)
    assert served.visible_fraction() > 0.9


def test_the_master_comes_back_bit_for_bit_from_its_low_half_ties_and_extremes_included():
    """The bf16 path keeps only each master's low 16 bits (half a copy): values over 60 orders of
    magnitude, both signs, subnormals, the largest finite floats, and exact ties (low half 0x8000,
    rounded up or down by their top half's parity) come back bit for bit; forgetting which ties
    went up gets them wrong."""
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(300_000, generator=gen) * torch.logspace(-30, 30, 300_000)
    bits = torch.randint(-2**31, 2**31 - 1, (4000,), generator=gen, dtype=torch.int64).to(torch.int32)
    ties = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)
    extremes = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38])
    x = torch.cat([spread, ties[torch.isfinite(ties)], extremes])
    master = x.clone()
    low, tied_up = split_bf16(x)
    assert torch.equal(x, master.to(torch.bfloat16).float())  # served: rounded as an engine casts
    assert low.dtype == torch.int16 and 0 < len(tied_up) < len(ties)
    wrong = x.clone()
    join_bf16(x, low, tied_up)
    assert torch.equal(x.view(torch.int32), master.view(torch.int32))
    join_bf16(wrong, low, tied_up[:0])
    assert not torch.equal(wrong.view(torch.int32), master.view(torch.int32))


def test_the_step_is_the_one_at_the_served_weights_and_the_master_keeps_what_rounding_drops(
        redis_server, toy_model_path, tmp_path):
    records = synthetic_groups_cache()
    one = {"learner.ppo_epochs": 1, "learner.minibatches": 1}  # one optimizer step: after it, the weights differ
    served = learner_with(redis_server, toy_model_path, tmp_path, "served", **one)
    at_served = learner_with(redis_server, toy_model_path, tmp_path, "at-served",
                             **{**one, "learner.served_weights": False})
    at_master = learner_with(redis_server, toy_model_path, tmp_path, "at-master",
                             **{**one, "learner.served_weights": False})
    with torch.no_grad():  # at_served starts at exactly the weights the served learner rounds to
        for p, q in zip(served.model.parameters(), at_served.model.parameters()):
            q.copy_(p.to(torch.bfloat16))
    before, before_rounded = params_vector(served.model), params_vector(at_served.model)
    assert (before - before_rounded).abs().max() > 0  # the toy's fp32 weights are off the bf16 grid
    steps = {}
    for name, learner in (("served", served), ("at_served", at_served), ("at_master", at_master)):
        torch.manual_seed(0)
        steps[name] = learner.ppo.train_step(records)
    for key in ("learner_loss", "learner_grad_norm", "mismatch_kl", "entropy"):
        assert steps["served"][key] == pytest.approx(steps["at_served"][key], rel=1e-5, abs=1e-7), key
    # the test can tell: at the master weights the same step computes a different gradient
    assert steps["at_master"]["learner_grad_norm"] != pytest.approx(steps["served"]["learner_grad_norm"], rel=1e-5)
    moved = params_vector(served.model) - before
    assert torch.allclose(moved, params_vector(at_served.model) - before_rounded, atol=1e-7)
    after = params_vector(served.model)
    assert moved.abs().max() > 1e-4  # it trained, and the weights are the master's again, not left rounded:
    assert (after - after.to(torch.bfloat16).float()).abs().max() > 0
    assert 0 < steps["served"]["learner_served_visible_fraction"] <= 1
    assert "learner_served_visible_fraction" not in steps["at_master"]


def test_the_kl_reference_is_the_base_as_an_engine_serves_it(redis_server, toy_model_path, tmp_path):
    """With served weights the policy runs rounded, and so does the frozen reference: at step
    0 the two are the same function (kl_ref 0), as they are without rounding."""
    from learner.policy import load_policy
    from tests.test_learner import for_run, synthetic_groups

    learner = learner_with(redis_server, toy_model_path, tmp_path, "kl", **{"learner.kl_coef": 0.1,
                                                                           "sampling.n": 4})
    reference = params_vector(learner.ppo.reference)
    assert torch.equal(reference, reference.to(torch.bfloat16).float())  # on the bf16 grid
    assert not torch.equal(reference, params_vector(load_policy(toy_model_path)))  # the toy's fp32 weights are not
    records = for_run(synthetic_groups(load_policy(toy_model_path), 6, seed=11), learner.cfg)
    assert learner.ppo.train_step(records)["kl_ref"] == pytest.approx(0, abs=1e-9)
