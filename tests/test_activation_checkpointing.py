"""``learner.activation_checkpointing``: the same gradients, fewer activations kept for the
backward pass, and parameter names unchanged (checkpoints and weight sync read them)."""

from __future__ import annotations

import torch

from learner.batch import collate
from learner.policy import enable_activation_checkpointing, load_policy, token_logprobs
from tests.test_learner import synthetic_groups


def backward_with_saved_bytes(model, batch) -> int:
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = token_logprobs(model, batch, "fp32")
        loss = -(lp * batch.mask).sum()
    loss.backward()
    return sum(saved)


def test_checkpointed_layers_give_the_same_gradients_and_keep_fewer_activations(toy_model_path):
    plain, ckpt = load_policy(toy_model_path), load_policy(toy_model_path)
    assert enable_activation_checkpointing(ckpt) == len(ckpt.model.layers) > 0
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    records = synthetic_groups(plain, 4, seed=3)
    batch = collate(records, torch.ones(len(records), 4), 0)
    plain_bytes = backward_with_saved_bytes(plain, batch)
    ckpt_bytes = backward_with_saved_bytes(ckpt, batch)
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-5), name
    print(f"activations saved for backward: {plain_bytes} bytes plain, {ckpt_bytes} checkpointed")
    assert ckpt_bytes < 0.8 * plain_bytes
    with torch.no_grad():  # no-grad passes (pi_old) go straight through
        assert torch.equal(token_logprobs(ckpt, batch, "fp32")[0], token_logprobs(plain, batch, "fp32")[0])
