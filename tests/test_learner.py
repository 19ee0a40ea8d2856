"""The learner's own steps on a real Redis and the real toy model (no workers needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.train import Learner
from rlpipe.config import build_config
from rlpipe.schema import Sample
from tests.conftest import free_run_id, learner_logprobs
from tests.test_schema import make_record


@pytest.fixture
def learner(redis_server, toy_model_path, tmp_path):
    cfg = build_config({}, environ={}, run_id=free_run_id("l"), run_dir=str(tmp_path), redis_url=redis_server.url,
                       **{"model.path": toy_model_path, "learner.groups_per_step": 3, "queue.max_staleness": 2})
    learner = Learner(cfg)
    learner.queue.ensure_consumer_group()
    return learner


def test_collect_drops_and_counts_groups_older_than_max_staleness(learner):
    learner.version = 5
    for v in (0, 3, 5, 2, 4, 1):
        learner.queue.push(make_record(policy_version=v, policy_version_end=v, group_id=f"v{v}"))
    batch = learner.collect()
    assert [e.record.policy_version for e in batch] == [3, 5, 4]  # 5-0 and 5-2 exceed 2 versions
    c = learner.queue.counters()
    assert c["dropped_stale"] == 2 and learner.dropped_stale_total == 2
    assert learner.queue.pending() == 3  # the batch awaits its acknowledgement
    assert c["produced"] == c["trained"] + c["dropped_stale"] + learner.queue.length()


def test_a_step_widens_the_margin_of_rewarded_over_unrewarded_responses(learner):
    # Adam's first step moves every parameter by about +-lr (the sign of its gradient), so
    # only the first-order effect is predictable: keep the step small.
    for group in learner.opt.param_groups:
        group["lr"] = 1e-5
    prompt = np.array([1, 5, 6, 14, 7, 8, 17], dtype=np.int32)  # "<bos>12+34="
    good, bad = [9, 10, 2], [8, 9, 2]  # "56" and "45"
    mu = {tuple(t): learner_logprobs(learner.model, prompt, t).numpy() for t in (good, bad)}  # on-policy: w = 1

    def group(rewards, name):
        samples = [Sample(np.array(t, dtype=np.int32), mu[tuple(t)], "stop", r)
                   for t, r in zip([good, bad, good, bad], rewards)]
        return make_record(prompt_tokens=prompt, samples=samples, group_id=name, policy_version=0,
                           policy_version_end=0, precision="bf16")

    def margin():
        return (learner_logprobs(learner.model, prompt, good).sum() - learner_logprobs(learner.model, prompt, bad).sum()).item()

    before = margin()
    metrics = learner.train_step([group([1.0, 0.0, 1.0, 0.0], "signal"), group([1.0] * 4, "flat")])
    assert margin() > before + 1e-3
    assert metrics["mismatch_kl"] == pytest.approx(0, abs=1e-6) and metrics["is_weight_mean"] == pytest.approx(1)
    assert metrics["groups_skipped_equal_reward"] == 1
    assert metrics["reward_mean"] == pytest.approx(0.75)
    assert metrics["groups_by_precision"] == {"bf16": 2}
    assert torch.isfinite(torch.tensor([metrics["learner_loss"], metrics["learner_grad_norm"]])).all()
