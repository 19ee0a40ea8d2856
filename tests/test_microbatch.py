"""Token-budget micro-batches (``learner.max_tokens_per_microbatch``): each rank's rows go
forward in parts padded only to their own longest row, gradients accumulate, and the loss
denominators stay the whole minibatch's, so the step equals the single padded-batch step."""

from __future__ import annotations

import pytest
import torch

from learner.batch import collate, microbatches
from learner.train import Learner
from rlpipe.config import build_config
from tests.conftest import free_run_id
from tests.test_learner import params_vector, synthetic_groups


def test_microbatches_cover_every_row_once_within_the_budget():
    records = synthetic_groups_cache()
    batch = collate(records, torch.zeros(len(records), 4), 0)
    rows = torch.arange(len(batch.rewards))
    lengths = batch.attention_mask.sum(1)
    for budget in (1, 12, 25, 40, 1000):
        parts = microbatches(batch, rows, budget)
        assert sorted(torch.cat(parts).tolist()) == rows.tolist()
        for part in parts:
            padded = len(part) * int(lengths[part].max())
            assert padded <= budget or len(part) == 1, (budget, part)
    assert len(microbatches(batch, rows, 1)) == len(rows)  # every row alone
    assert [p.tolist() for p in microbatches(batch, rows, 0)] == [rows.tolist()]
    assert len(microbatches(batch, rows, 40)) < len(rows)  # and rows do share parts
    trimmed = batch.select(microbatches(batch, rows, 25)[0]).trimmed()
    assert trimmed.input_ids.shape[1] == int(trimmed.attention_mask.sum(1).max()) < batch.input_ids.shape[1]


_CACHE = {}


def synthetic_groups_cache():
    if "groups" not in _CACHE:
        from launch.demo import resolve_model
        from learner.policy import load_policy

        model = load_policy(resolve_model(build_config({}, environ={})))
        _CACHE["groups"] = synthetic_groups(model, 6, seed=5, noise=0.1)
    return _CACHE["groups"]


def learner_with(redis_server, toy_model_path, tmp_path, name, **settings):
    cfg = build_config({}, environ={}, run_id=free_run_id(name), run_dir=str(tmp_path / name),
                       redis_url=redis_server.url, seed=7, **{
                           "model.path": toy_model_path, "learner.groups_per_step": 6, "learner.minibatches": 2,
                           "learner.lr": 1e-3, "learner.threads": 1, "learner.loss_agg": "seq_mean_token_mean",
                           **settings})
    return Learner(cfg)


@pytest.mark.parametrize("is_mode", ["token_tis", "bypass"])
def test_a_step_in_token_budget_microbatches_equals_the_padded_step(redis_server, toy_model_path, tmp_path, is_mode):
    records = synthetic_groups_cache()
    padded = learner_with(redis_server, toy_model_path, tmp_path, "padded", **{"learner.is_mode": is_mode})
    parts = learner_with(redis_server, toy_model_path, tmp_path, "parts", **{
        "learner.is_mode": is_mode, "learner.max_tokens_per_microbatch": 25})
    before = params_vector(padded.model)
    torch.manual_seed(0)  # the same minibatch order for both
    a = padded.ppo.train_step(records)
    torch.manual_seed(0)
    b = parts.ppo.train_step(records)
    moved = params_vector(padded.model) - before
    diff = params_vector(padded.model) - params_vector(parts.model)
    assert moved.abs().max().item() > 1e-4, "the step did not train"
    # Norm-wise, not element-wise: Adam's first update is g / (|g| + eps), so an element whose gradient is
    # near zero moves by up to lr on reduction-order noise alone, and that noise differs by CPU kind
    # (AVX2 against AVX-512 kernels sum in another order). Summed over the update it stays ~1e-6 of it;
    # a microbatch weighted wrongly changes the direction by far more than 1e-3.
    assert diff.norm().item() < 1e-3 * moved.norm().item(), (diff.norm().item(), moved.norm().item())
    for key in ("learner_loss", "learner_grad_norm", "mismatch_kl", "entropy", "ppo_clip_fraction", "ppo_ratio_mean"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
