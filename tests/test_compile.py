"""``learner.compile``: each decoder layer compiled (inductor) computes what eager does, the
parameter names stay as they are (checkpoints and weight sync read them);
whether it pays is bench/learner.py's question. A compile costs tens of seconds on a CPU,
so this is the suite's one compile."""

from __future__ import annotations

import torch

from learner.batch import collate
from learner.policy import compile_layers, load_policy, token_logprobs
from tests.test_learner import synthetic_groups


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
    assert torch.allclose(token_logprobs(compiled, batch, "fp32")[0], token_logprobs(eager, batch, "fp32")[0],
                          atol=1e-5)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name
