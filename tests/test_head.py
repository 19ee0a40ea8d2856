"""The chunked head (learner/head.py) is the plain path's function: the same log-probs, entropies
and gradients, on every path the learner takes (whole rows, a group's prompt once), with and without
top-k/top-p, with the entropy's gradient, in fp32 and under bf16 autocast, and a chunk of any size.
One test shows the check can fail: a head that drops the temperature is far past the bound."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from learner.batch import collate
from learner.head import chunkable_head, head_logprobs
from learner.policy import load_policy, token_logprobs
from learner.synthetic_groups import synthetic_groups


@pytest.fixture(scope="module")
def model(toy_model_path):
    m = load_policy(toy_model_path)
    m.eval()
    return m


def batch_of(model, temperature=0.7, top_k=-1, top_p=1.0):
    records = synthetic_groups(model, 3, max_len=6, prompt_len=5)
    batch = collate(records, torch.randn(3, 4), 0)
    n = len(batch.input_ids)
    return dataclasses.replace(batch, temperature=torch.full((n,), temperature),
                               top_k=torch.full((n,), top_k, dtype=torch.long),
                               top_p=torch.full((n,), top_p, dtype=torch.float32))


def run(model, batch, **kw):
    """Log-probs, entropies (on the mask) and the parameters' gradient of a loss reading both."""
    model.zero_grad()
    lp, ent = token_logprobs(model, batch, entropy_grad=True, **kw)
    on = batch.mask.bool()
    weights = torch.linspace(0.5, 1.5, int(on.sum()))
    (lp[on] * weights).sum().add((ent[on] * weights.flip(0)).sum() * 0.3).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return lp.detach()[on], ent.detach()[on], grad


def close(a, b, rel):
    """Norm-wise relative error: what the arithmetic guarantees whatever the CPU's kernels."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) <= rel


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("trunc", [{}, {"top_k": 5, "top_p": 0.9}])
@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_chunked_head_equals_the_plain_path(model, share, trunc, chunk):
    batch = batch_of(model, **trunc)
    lp0, ent0, g0 = run(model, batch, share_prompt=share)
    lp1, ent1, g1 = run(model, batch, share_prompt=share, head_chunk=chunk)
    assert close(lp1, lp0, 1e-5) and close(ent1, ent0, 1e-5)
    assert g0.abs().max() > 0 and close(g1, g0, 1e-4), float((g1 - g0).norm() / g0.norm())


def test_chunked_head_under_bf16_autocast_is_the_plain_paths_bf16(model):
    batch = batch_of(model)
    lp0, ent0, g0 = run(model, batch, dtype="bf16")
    lp1, ent1, g1 = run(model, batch, dtype="bf16", head_chunk=2)
    # the same bf16 products, summed in other blocks: bf16's unit round-off is 2**-8
    assert close(lp1, lp0, 2e-2) and close(g1, g0, 5e-2)


def test_a_head_without_the_temperature_is_caught(model):
    """The bound above can fail: dividing by the temperature is a small change to the function and
    moves the log-probs far past 1e-5."""
    batch = batch_of(model, temperature=0.7)
    lp0, _, _ = run(model, batch)
    lp1, _, _ = run(model, dataclasses.replace(batch, temperature=torch.ones_like(batch.temperature)),
                    head_chunk=4)
    assert not close(lp1, lp0, 1e-3)


def test_only_a_plain_local_head_is_chunked(model):
    assert chunkable_head(model) is model.get_output_embeddings().weight
    biased = torch.nn.Linear(4, 8, bias=True)
    holder = type("M", (), {"get_output_embeddings": lambda self: biased})()
    assert chunkable_head(holder) is None


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_do():
    torch.manual_seed(0)
    hidden = torch.randn(7, 16, requires_grad=True)
    weight = torch.randn(32, 16)
    targets = torch.randint(0, 32, (7,))
    ones = torch.ones(7)
    lp, ent = head_logprobs(hidden, weight, targets, ones, -torch.ones(7, dtype=torch.long), ones,
                            torch.float32, 2, False)
    lp.sum().backward()
    ref = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(lp, ref, atol=1e-6) and not ent.requires_grad
    h2 = hidden.detach().clone().requires_grad_()
    torch.log_softmax(h2 @ weight.T, -1).gather(-1, targets[:, None]).sum().backward()
    assert torch.allclose(hidden.grad, h2.grad, atol=1e-5)
