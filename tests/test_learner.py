"""The learner's own steps on a real Redis and the real toy model (no workers needed)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from learner.app import learner_status
from learner.synthetic_groups import synthetic_groups as build_synthetic_groups
from learner.train import Learner
from rlpipe.config import build_config
from rlpipe.schema import Sample
from tests.conftest import free_run_id, learner_logprobs, wait_for
from tests.test_schema import make_record


@pytest.fixture
def learner(redis_server, toy_model_path, tmp_path):
    cfg = build_config({}, environ={}, run_id=free_run_id("l"), run_dir=str(tmp_path), redis_url=redis_server.url,
                       **{"model.path": toy_model_path, "learner.groups_per_step": 3, "queue.max_staleness": 2,
                          "sampling.n": 2})
    learner = Learner(cfg)
    learner.queue.ensure_consumer_group()
    learner.queue.r.set(learner.queue.keys.cursor, 1000)  # as if the workers had leased the prompts these use
    return learner


def run_record(learner, version: int = 0, **overrides):
    """A test record that belongs to the learner's run (its id, precision and sampling.n),
    made at ``version``, so the reader admits it (rlpipe/admission.py)."""
    rec = make_record(**{"run_id": learner.cfg.run_id, "precision": learner.cfg.rollout.precision,
                         "policy_version": version, "policy_version_end": version, **overrides})
    for sample in rec.samples:
        sample.versions = None
    return rec


def test_collect_drops_and_counts_groups_older_than_max_staleness(learner):
    learner.run_counters.version = 5
    for v in (0, 3, 5, 2, 4, 1):
        learner.queue.push(run_record(learner, v, group_id=f"v{v}"))
    batch = learner.collect()
    assert [e.record.policy_version for e in batch] == [3, 5, 4]  # 5-0 and 5-2 exceed 2 versions
    c = learner.queue.counters()
    assert c["dropped_stale"] == 2 and learner.dropped_stale_total == 2
    assert learner.queue.pending() == 3  # the batch awaits its acknowledgement
    assert c["produced"] == c["trained"] + c["dropped_stale"] + learner.queue.length()


def test_groups_held_when_redis_lost_their_push_go_back_to_the_stream(learner):
    """After a Redis restart that lost writes, groups the learner had read but not trained
    (in its batch, in its backlog) may be gone from the stream. Trained from memory, they
    would never count as produced while the lineage's consumed count grew, and the
    back-pressure allowance would keep one place too many for each, for good."""
    q = learner.queue
    ids = [q.push(run_record(learner, group_id=f"g{i}", prompt_index=i)) for i in range(6)]
    read = q.read(learner.ledger.consumer, 4)
    batch, learner.ledger.backlog = read[:2], read[2:]
    r = q.r
    r.xdel(q.keys.traj, ids[0], ids[2])  # the restart lost these pushes (and their counts)
    r.hset(q.keys.counters, "produced", 4)
    learner.ledger.after_redis_restart(batch)
    assert [e.entry_id for e in batch] == [ids[1]]
    # every group not trained yet takes a back-pressure place: the 6, not the 4 left in the stream
    learner._publish_state()
    assert q.lease_prompts("w0", 0).unconsumed == 6
    c = q.counters()
    assert c["produced"] == c["trained"] + q.length() == 6
    q.push(run_record(learner, group_id="g6", prompt_index=6))
    rest = learner.collect() + learner.collect()  # the backlog, then the two pushed again and a new one
    assert sorted(e.record.prompt_index for e in batch + rest) == list(range(7))


def test_a_step_widens_the_margin_of_rewarded_over_unrewarded_responses(learner):
    # Adam's first step moves every parameter by about +-lr (the sign of its gradient), so
    # only the first-order effect is predictable: keep the step small.
    for group in learner.opt.param_groups:
        group["lr"] = 1e-5
    prompt = np.array([1, 5, 6, 14, 7, 8, 17], dtype=np.int32)  # "<bos>12+34="
    good, bad = [9, 10, 2], [8, 9, 2]  # "56" and "45"
    with learner.ppo.served.rounded():  # on-policy (w = 1): the weights as a bf16 engine holds them
        mu = {tuple(t): learner_logprobs(learner.model, prompt, t).numpy() for t in (good, bad)}

    def group(rewards, name):
        samples = [Sample(np.array(t, dtype=np.int32), mu[tuple(t)], "stop", r)
                   for t, r in zip([good, bad, good, bad], rewards)]
        return make_record(prompt_tokens=prompt, samples=samples, group_id=name, policy_version=0,
                           policy_version_end=0, precision="bf16")

    def margin():
        return (learner_logprobs(learner.model, prompt, good).sum() - learner_logprobs(learner.model, prompt, bad).sum()).item()

    before = margin()
    metrics = learner.ppo.train_step([group([1.0, 0.0, 1.0, 0.0], "signal"), group([1.0] * 4, "flat")])
    assert margin() > before + 1e-3
    # (1e-5: the learner forwards the prompt once for the group, mu came from whole rows: float noise)
    assert metrics["mismatch_kl"] == pytest.approx(0, abs=1e-5) and metrics["is_weight_mean"] == pytest.approx(1, abs=1e-5)
    assert metrics["groups_skipped_equal_reward"] == 1
    assert metrics["reward_mean"] == pytest.approx(0.75)
    assert metrics["groups_by_precision"] == {"bf16": 2}
    assert torch.isfinite(torch.tensor([metrics["learner_loss"], metrics["learner_grad_norm"]])).all()


# -- every correction mode, precision and estimator runs a real step ------------------------------
def synthetic_groups(model, n_groups: int, seed: int = 0, noise: float = 0.05, precisions=("bf16",),
                     version: int = 0) -> list:
    """Groups of 4 random answers (2..4 tokens) to random sums, their mu the learner's own
    log-probs plus Gaussian noise (a mismatch of known size), rewards 0/1 with at least one
    of each (learner/synthetic_groups.py builds them), as test records (make_record's other fields)."""
    return [make_record(prompt_tokens=rec.prompt_tokens, samples=rec.samples, group_id=rec.group_id,
                        policy_version=version, policy_version_end=version, precision=rec.precision)
            for rec in build_synthetic_groups(model, n_groups, seed=seed, noise=noise, precisions=precisions,
                                              version=version, name="syn")]


def for_run(records: list, cfg) -> list:
    """``records`` as groups of ``cfg``'s run (the reader admits only those, rlpipe/admission.py)."""
    return [dataclasses.replace(rec, run_id=cfg.run_id) for rec in records]


def params_vector(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def base_model(toy_model_path):
    from learner.policy import load_policy

    return load_policy(toy_model_path)


def make_learner(redis_server, toy_model_path, tmp_path, **overrides) -> Learner:
    cfg = build_config({}, environ={}, run_id=free_run_id("l"), run_dir=str(tmp_path), redis_url=redis_server.url,
                       **{"model.path": toy_model_path, "learner.groups_per_step": 4, "learner.lr": 1e-4,
                          **overrides})
    return Learner(cfg)


@pytest.mark.parametrize("mode", ["none", "token_tis", "seq_tis", "token_mis", "seq_mis", "geo_mask", "icepop",
                                  "ppo_is", "vanilla_is", "bypass"])
def test_every_is_mode_takes_a_finite_step_that_changes_the_weights(mode, redis_server, toy_model_path, tmp_path,
                                                                     base_model):
    learner = make_learner(redis_server, toy_model_path, tmp_path, **{"learner.is_mode": mode})
    records = synthetic_groups(base_model, 4, precisions=("bf16", "fp8"))
    before = params_vector(learner.model)
    m = learner.ppo.train_step(records)
    assert (params_vector(learner.model) - before).abs().max() > 1e-6
    assert np.isfinite([m["learner_loss"], m["learner_grad_norm"], m["mismatch_kl"], m["is_ess"]]).all()
    # noise of std 0.05 on mu: E[mu - pi_old] = 0 and k3 ~ 0.05^2 / 2
    assert 1e-4 < m["mismatch_k3_kl"] < 5e-3 and m["mismatch_log_ppl_abs_diff"] > 0
    assert set(m["mismatch_by_precision"]) == {"bf16", "fp8"}


def test_icepops_lower_bound_reaches_the_step(redis_server, toy_model_path, tmp_path, base_model):
    """learner.icepop_alpha is the band's own lower bound (issue 33 item 8): with mu's noise of
    std 0.05, [0.999, 10] masks about half of the tokens, where [1/10, 10] masks none."""
    learner = make_learner(redis_server, toy_model_path, tmp_path, **{"learner.is_mode": "icepop",
                                                                      "learner.icepop_beta": 10.0,
                                                                      "learner.icepop_alpha": 0.999})
    m = learner.ppo.train_step(synthetic_groups(base_model, 4, precisions=("bf16", "fp8")))
    assert 0.2 < m["is_masked_fraction"] < 0.8, m["is_masked_fraction"]


def test_kl_penalty_against_the_base_model_starts_at_zero_then_measures_the_drift(
        redis_server, toy_model_path, tmp_path, base_model):
    from learner.reference import load_reference

    assert load_reference(build_config({}, environ={}), torch.device("cpu")) is None  # kl_coef 0: none loaded
    # The KL math against a direct computation at the master weights; with served weights
    # (the default) both sides are rounded: tests/test_served_weights.py.
    learner = make_learner(redis_server, toy_model_path, tmp_path, **{"learner.kl_coef": 0.1, "learner.lr": 1e-3,
                                                                      "sampling.n": 4, "learner.served_weights": False})
    reference = learner.ppo.reference
    assert not any(p.requires_grad for p in reference.parameters())
    records = for_run(synthetic_groups(base_model, 4, seed=11), learner.cfg)
    first = learner.ppo.train_step(records)
    assert first["kl_ref"] == pytest.approx(0, abs=1e-7)  # the policy is the reference
    assert first["kl_loss"] > 0  # the second epoch's KL term, after the first moved the policy
    learner.ppo.train_step(records)
    # kl_ref is the mean k3 over the response tokens of pi_old (the policy now) against the base model
    k3 = [float(np.exp(r - p) - 1 - (r - p))
          for rec in records for s in rec.samples
          for p, r in zip(learner_logprobs(learner.model, rec.prompt_tokens, s.tokens).tolist(),
                          learner_logprobs(base_model, rec.prompt_tokens, s.tokens).tolist())]
    third = learner.ppo.train_step(records)
    assert third["kl_ref"] == pytest.approx(sum(k3) / len(k3), rel=1e-4) and third["kl_ref"] > 1e-6
    assert torch.equal(params_vector(reference), params_vector(base_model))  # never updated


def test_kl_in_the_reward_gives_equal_reward_groups_a_signal(redis_server, toy_model_path, tmp_path, base_model):
    learner = make_learner(redis_server, toy_model_path, tmp_path, **{
        "learner.kl_coef": 0.5, "learner.kl_in": "reward", "learner.lr": 1e-3, "sampling.n": 4,
        "learner.served_weights": False})  # at the master weights, as the direct computation below
    records = for_run(synthetic_groups(base_model, 2, seed=12), learner.cfg)
    assert learner.ppo.train_step(records)["kl_loss"] == 0  # step 0: the policy is the reference
    flat = [dataclasses.replace(rec, samples=[dataclasses.replace(s, reward=1.0) for s in rec.samples])
            for rec in records]
    # each sample's penalty kl_coef x sum_t (log pi_old - log ref), from the policy as it now is
    penalty = [0.5 * float((learner_logprobs(learner.model, rec.prompt_tokens, s.tokens)
                            - learner_logprobs(base_model, rec.prompt_tokens, s.tokens)).sum())
               for rec in flat for s in rec.samples]
    m = learner.ppo.train_step(flat)
    assert m["kl_loss"] == pytest.approx(sum(penalty) / len(penalty), rel=1e-4, abs=1e-9)
    assert m["reward_mean"] == 1.0 and m["groups_skipped_equal_reward"] == 0  # the penalty tells them apart


def test_bypass_measures_the_same_mismatch_without_a_recompute_pass(redis_server, toy_model_path, tmp_path,
                                                                      base_model):
    records = synthetic_groups(base_model, 4, seed=3)
    full = make_learner(redis_server, toy_model_path, tmp_path, **{"learner.is_mode": "ppo_is"}).ppo.train_step(records)
    bypass = make_learner(redis_server, toy_model_path, tmp_path, **{"learner.is_mode": "bypass"}).ppo.train_step(records)
    # With one minibatch, the first epoch's forward pass is pi_old exactly; same loss, same update.
    for key in ("mismatch_kl", "mismatch_k3_kl", "mismatch_log_ppl_abs_diff", "entropy", "learner_loss"):
        assert bypass[key] == pytest.approx(full[key], rel=1e-5, abs=1e-8), key


def test_mismatch_is_split_by_the_precision_label(redis_server, toy_model_path, tmp_path, base_model):
    from learner.loss import mismatch_metrics

    learner = make_learner(redis_server, toy_model_path, tmp_path)
    # fp8 groups get 5x the noise of bf16 groups: their split metrics must show it
    records = [*synthetic_groups(base_model, 2, seed=1, noise=0.02, precisions=("bf16",)),
               *synthetic_groups(base_model, 2, seed=2, noise=0.3, precisions=("fp8",))]
    m = learner.ppo.train_step(records)
    split = m["mismatch_by_precision"]
    assert split["fp8"]["mismatch_k3_kl"] > 10 * split["bf16"]["mismatch_k3_kl"]
    # and each split equals the metric computed on that precision's rows alone
    from learner.batch import collate
    batch = collate(records[:2], torch.zeros(2, 4), 0)
    only_bf16 = mismatch_metrics(torch.zeros_like(batch.behavior_logprobs), batch.behavior_logprobs, batch.mask)
    assert split["bf16"]["mismatch_log_ppl_rollout"] == pytest.approx(only_bf16["mismatch_log_ppl_rollout"], rel=1e-6)
    assert m["mismatch_kl_fresh"] == pytest.approx(m["mismatch_kl"])  # every group is staleness 0 here


@pytest.mark.parametrize("overrides", [
    {"learner.advantage": "rloo"}, {"learner.advantage": "reinforce_pp"},
    {"learner.loss_agg": "seq_mean_token_mean"}, {"learner.loss_agg": "seq_sum_norm"},
    {"learner.dtype": "bf16"}, {"learner.dtype": "bf16", "learner.fp32_lm_head": True},
    {"learner.dtype": "fp16"}, {"learner.minibatches": 2, "learner.ppo_epochs": 1},
    {"learner.loss": "cispo"}, {"learner.entropy_coef": 0.05},
])
def test_estimators_aggregations_and_precisions_train(overrides, redis_server, toy_model_path, tmp_path, base_model):
    learner = make_learner(redis_server, toy_model_path, tmp_path, **overrides)
    reference = make_learner(redis_server, toy_model_path, tmp_path)
    records = synthetic_groups(base_model, 4, seed=5)
    before = params_vector(learner.model)
    m, ref = learner.ppo.train_step(records), reference.ppo.train_step(records)
    moved = params_vector(learner.model) - before
    assert moved.abs().max() > 1e-6 and np.isfinite(m["learner_loss"]) and m["learner_skipped_steps"] == 0
    # a different setting is a different update (the option is not ignored: an ignored one gives the
    # bit-identical update, the same inputs through the same code). Adam's first step is nearly
    # invariant to the advantages' scale, so rloo's update differs from grpo's by ~1e-7 of a ~1e-6 move.
    assert (params_vector(learner.model) - params_vector(reference.model)).abs().max() > 1e-9
    if "learner.dtype" in overrides:  # low-precision pi_old is close to, not equal to, fp32's
        assert 0 < abs(m["mismatch_kl"] - ref["mismatch_kl"]) < 1e-2


def test_fp16_loss_scaling_skips_overflowing_steps_and_backs_off(redis_server, toy_model_path, tmp_path, base_model):
    learner = make_learner(redis_server, toy_model_path, tmp_path, **{
        "learner.dtype": "fp16", "learner.loss_scale_init": 1e38, "learner.ppo_epochs": 1})
    before = params_vector(learner.model)
    m = learner.ppo.train_step(synthetic_groups(base_model, 4, seed=7))
    assert m["learner_skipped_steps"] == 1 and learner.scaler.skipped_steps == 1
    assert m["learner_loss_scale"] == pytest.approx(0.5e38)  # halved
    assert torch.equal(params_vector(learner.model), before)  # an overflowing step leaves the weights alone
    # A scale that leaves fp16 room: the toy's largest scaled gradient stays far below 65504 at 2**8 on any
    # CPU. The default 2**16 may overflow on its first step on some kernels (AVX512-FP16 paths accumulate
    # differently); skipping it then is the scaler's job, not a fault, so the sane arm does not rest on it.
    sane = make_learner(redis_server, toy_model_path, tmp_path, **{
        "learner.dtype": "fp16", "learner.ppo_epochs": 1, "learner.loss_scale_init": 2.0**8})
    sane_before = params_vector(sane.model)
    assert sane.ppo.train_step(synthetic_groups(base_model, 4, seed=7))["learner_skipped_steps"] == 0
    assert not torch.equal(params_vector(sane.model), sane_before)  # a step that fits is taken


def test_every_step_metric_is_exported_to_prometheus(redis_server, toy_model_path, tmp_path, base_model):
    from prometheus_client import generate_latest

    learner = make_learner(redis_server, toy_model_path, tmp_path)
    m = learner.ppo.train_step(synthetic_groups(base_model, 4, precisions=("bf16", "fp8")))
    m["lr_schedule"] = learner.schedule.state()
    learner.metrics.record(m)
    text = generate_latest(learner.metrics.registry).decode()
    for name in ("mismatch_kl", "mismatch_seq_kl", "mismatch_k3_kl", "mismatch_chi2_token", "mismatch_chi2_seq",
                 "mismatch_log_ppl_abs_diff", "mismatch_ppl_ratio", "mismatch_prob_diff_max", "is_weight_mean",
                 "is_weight_max", "is_ess", "is_truncated_fraction", "is_truncated_seq_fraction",
                 "is_masked_fraction", "is_masked_seq_fraction", "learner_grad_norm", "learner_grad_norm_smoothed",
                 "entropy", "reward_mean", "response_length_mean", "learner_loss_scale", "learner_lr"):
        assert f"\nrlpipe_{name}{{run_id=" in text, name
    assert 'rlpipe_mismatch_kl_by_precision{precision="fp8",run_id=' in text
    assert "rlpipe_lr_schedule_lr{" in text and "rlpipe_staleness_versions_bucket" in text


def test_the_learner_follows_its_lr_schedule_step_by_step(redis_server, toy_model_path, tmp_path, base_model):
    from learner.metrics import read_jsonl

    learner = make_learner(redis_server, toy_model_path, tmp_path, steps=4, workers=1, **{
        "learner.groups_per_step": 2, "learner.ppo_epochs": 1, "queue.max_staleness": 100, "sync.join_timeout_s": 0.1, "sampling.n": 4,
        "learner.schedule.kind": "warmup_cosine", "learner.schedule.warmup_steps": 2})
    for rec in for_run(synthetic_groups(base_model, 8, seed=9), learner.cfg):
        learner.queue.push(rec)
    learner.run()
    # lr 1e-4, warmup 2 of 4 steps, floor 10%: 1/2 warmup, full, cosine midpoint (0.1 + 0.9/2), floor
    lrs = [row["learner_lr"] for row in read_jsonl(tmp_path / "metrics.jsonl")]
    assert lrs == pytest.approx([0.5e-4, 1e-4, 0.55e-4, 0.1e-4], rel=1e-6)
    assert learner_status(learner)["lr_schedule"]["kind"] == "warmup_cosine"
    assert learner.queue.counters()["trained"] == 8 and learner.last_checkpoint["step"] == 4
    # the lease is released and its renewal thread ends with the run (it would stop the process otherwise)
    assert not learner.r.exists(learner.keys.learner + ":lease")
    wait_for(lambda: not any(t.name == "learner-lease" for t in threading.enumerate()), timeout=5,
             what="the lease thread to end")


def test_a_spent_time_budget_finishes_the_run_as_if_its_steps_were_done(redis_server, toy_model_path, tmp_path,
                                                                          base_model):
    from learner.metrics import read_jsonl

    learner = make_learner(redis_server, toy_model_path, tmp_path, steps=4, workers=1, train_budget_s=0.001, **{
        "learner.groups_per_step": 2, "learner.ppo_epochs": 1, "sync.join_timeout_s": 0.1, "sampling.n": 4})
    for rec in for_run(synthetic_groups(base_model, 8, seed=9), learner.cfg):
        learner.queue.push(rec)
    learner.run()
    # the first step outlasts a millisecond: the run ends after it, done (not stopped), checkpointed, acknowledged
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 1 and learner.step == 1 and learner.finished
    assert learner_status(learner)["status"] == "done" and learner.last_checkpoint["step"] == 1
    assert learner.queue.counters()["trained"] == 2 and learner.queue.pending() == 0
    unlimited = make_learner(redis_server, toy_model_path, tmp_path / "b", steps=1, workers=1, **{
        "learner.groups_per_step": 2, "learner.ppo_epochs": 1, "sync.join_timeout_s": 0.1, "sampling.n": 4})
    assert not unlimited.budget.spent(0, 1) and not unlimited.finished


def test_a_learner_run_serves_metrics_promtool_accepts_each_series_labelled_with_its_run(
        redis_server, toy_model_path, tmp_path, base_model):
    import httpx

    from learner.app import serve_in_thread
    from learner.metrics import METRICS, NOT_EXPORTED, describe, flatten, read_jsonl
    from tests.ops_tools import check_metrics, samples_without

    learner = make_learner(redis_server, toy_model_path, tmp_path, steps=2, workers=1, **{
        "learner.groups_per_step": 2, "learner.ppo_epochs": 1, "sync.join_timeout_s": 0.1, "sampling.n": 4})
    for rec in for_run(synthetic_groups(base_model, 4, seed=3), learner.cfg):
        learner.queue.push(rec)
    learner.run()
    text = httpx.get(f"http://{serve_in_thread(learner, '127.0.0.1', 0)}/metrics", timeout=30).text
    check_metrics(text)
    assert not samples_without(text, "run_id", learner.cfg.run_id)
    assert 'process_start_time_seconds{run_id="' in text
    # the run totals of metrics.jsonl are counters that hold the row's value
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    for name in ("produced_total", "trained_groups_total", "groups_skipped_total", "weight_sync_left_out_total"):
        assert f"# TYPE rlpipe_{name} counter" in text, name
        assert f'rlpipe_{name}{{run_id="{learner.cfg.run_id}"}} {float(rows[-1][name])}' in text, name
    assert f'rlpipe_trained_groups_total{{run_id="{learner.cfg.run_id}"}} 4.0' in text
    # every numeric key a step writes has its meaning in the table (HELP and tracker group)
    keys = {k.split("/")[0] for row in rows for k in flatten(row)}
    undescribed = {k for k in keys if describe(k)[1].startswith("metrics.jsonl key")} - NOT_EXPORTED
    assert not undescribed - {"mismatch_by_precision", "lr_schedule", "groups_by_precision", "reward_by_precision",
                              "staleness_hist"}, sorted(undescribed)
    assert f'# HELP rlpipe_reward_mean {METRICS["reward_mean"][1]}' in text


# -- dynamic sampling, single pass, response-only logits ----------------------------------------
def equal_reward_record(learner, reward: float, **overrides):
    rec = run_record(learner, **overrides)
    for s in rec.samples:
        s.reward = reward
    return rec


@pytest.mark.parametrize("dynamic", [True, False])
def test_dynamic_sampling_trains_only_groups_with_a_spread_and_settles_the_rest(learner, dynamic):
    """DAPO's dynamic sampling: a batch is ``groups_per_step`` groups that carry a signal;
    the all-equal ones read on the way are acknowledged and counted as filtered at once,
    their prompts settled (a second group for one is a duplicate), and the books balance."""
    learner.cfg.learner.dynamic_sampling = dynamic
    q = learner.queue
    for i in range(7):
        rec = run_record(learner, group_id=f"s{i}", prompt_index=i) if i % 2 else \
            equal_reward_record(learner, float(i % 4 == 0), group_id=f"e{i}", prompt_index=i)
        q.push(rec)
    batch = learner.collect()
    if not dynamic:  # the baseline: the first three, two of them without a signal
        assert [e.record.group_id for e in batch] == ["e0", "s1", "e2"]
        return
    assert [e.record.group_id for e in batch] == ["s1", "s3", "s5"]
    c = q.counters()
    assert c["filtered"] == 3 and learner.run_counters.filtered_total == 3  # e0, e2, e4; e6 is still unread
    assert c["produced"] == c["trained"] + c["filtered"] + q.length() and q.pending() == 3
    assert {0, 2, 4} <= set(q.dropped_indices())  # settled for good
    q.push(equal_reward_record(learner, 1.0, group_id="again", prompt_index=0))
    learner.ledger.trained(batch)
    learner.ledger.checkpoint_started()
    learner.ledger.durable()
    q.push(run_record(learner, group_id="s7", prompt_index=7))
    q.push(run_record(learner, group_id="s8", prompt_index=8))
    q.push(run_record(learner, group_id="s9", prompt_index=9))
    second = learner.collect()
    assert [e.record.group_id for e in second] == ["s7", "s8", "s9"]
    c = q.counters()
    assert (c["filtered"], c["duplicate"], c["trained"]) == (4, 1, 3)
    assert c["produced"] == c["trained"] + c["filtered"] + c["duplicate"] + q.length()  # the batch: still in it
    m = learner.ledger.sampling_metrics(second)
    assert m["groups_filtered_step"] == 4 and m["informative_fraction"] == pytest.approx(3 / 7)
    # s7-s9: 1 and 0 each; filtered since the last metrics: e0 and e4 all 1, e2 and e6 all 0
    assert m["reward_sampled_mean"] == pytest.approx((3 + 4) / 14)
    assert m["groups_sampled_per_trained"] == pytest.approx(7 / 3)
    assert m["sample_ratio_smoothed"] == pytest.approx(7 / 3)  # the first measurement, not smoothed into 1
    learner.run_counters.step = 5
    later = learner.ledger.sampling_metrics(second)  # nothing filtered since: 3 sampled for 3 trained
    assert later["sample_ratio_smoothed"] == pytest.approx(0.7 * 7 / 3 + 0.3 * 1)


@pytest.mark.parametrize("published, factor", [("3", 3), ("nan", 1), ("abc", 1), ("0.2", 1), ("1e9", 16)])
def test_the_fleet_allowance_grows_by_the_published_sample_ratio_within_bounds(learner, published, factor):
    """The learner reads on past filtered groups, so the fleet may keep (1 + max_lag) x
    groups_per_step x ratio groups unconsumed or in flight; a value in Redis that is not a
    sane ratio counts as 1, and none beyond MAX_SAMPLE_RATIO."""
    q = learner.queue
    q.r.hset(q.keys.learner, mapping={"version": 0, "consumed": 0, "sample_ratio": published})
    lease = q.lease_prompts("w0", 1000, backpressure=(0, 4, 1))
    assert lease.allowance == 2 * 4 * factor
    assert len(lease.prompts) == 2 * 4 * factor


def test_the_fleet_samples_more_per_version_not_further_ahead(learner):
    """Under dynamic sampling each place still free takes ``ratio`` samples; the groups already
    in hand take one place each. With 3 of a 4-group step unconsumed and a ratio of 3, the fleet
    may start 3 more for the last place, not 4 x 3 - 3 = 9 (whose surplus would arrive after the
    learner moved on, stale); what is in flight counts against them."""
    q = learner.queue
    q.r.hset(q.keys.learner, mapping={"version": 0, "consumed": 0, "sample_ratio": "3"})
    for i in range(3):
        q.push(run_record(learner, group_id=f"u{i}", prompt_index=100 + i))
    lease = q.lease_prompts("w0", 1000, backpressure=(0, 4, 0))
    assert (lease.unconsumed, lease.allowance, len(lease.prompts)) == (3, 3, 3)
    again = q.lease_prompts("w1", 1000, backpressure=(0, 4, 0))
    assert (again.allowance, again.prompts) == (0, [])  # the 3 in flight fill it
    ahead = q.lease_prompts("w1", 1000, backpressure=(0, 4, 1))  # one more step allowed: its 4 places x 3
    assert ahead.allowance == 12 and len(ahead.prompts) == 12


def test_a_single_pass_step_equals_the_recompute_pass_step(redis_server, toy_model_path, tmp_path, base_model):
    """With one epoch of one minibatch, pi_old from the update's own forward is the recompute
    pass's pi_old exactly: the same update, the same mismatch, one forward fewer."""
    records = synthetic_groups(base_model, 4)
    out = {}
    for single in (True, False):
        learner = make_learner(redis_server, toy_model_path, tmp_path / str(single), **{
            "learner.ppo_epochs": 1, "learner.is_mode": "token_tis", "learner.single_pass": single})
        before = params_vector(learner.model)
        m = learner.ppo.train_step(records)
        out[single] = (params_vector(learner.model) - before, m)
    (d_single, m_single), (d_two, m_two) = out[True], out[False]
    assert d_single.abs().max() > 1e-6
    assert torch.allclose(d_single, d_two, atol=1e-7)
    for key in ("mismatch_kl", "is_ess", "learner_loss", "entropy"):
        assert m_single[key] == pytest.approx(m_two[key], rel=1e-4, abs=1e-7), key


def test_response_only_logits_equal_the_full_head_on_every_response_token(base_model):
    from learner.batch import collate
    from learner.policy import response_start, token_logprobs

    records = synthetic_groups(base_model, 3)
    batch = collate(records, torch.zeros(3, 4), 0)
    assert response_start(batch) > 0
    with torch.no_grad():
        lp, ent = token_logprobs(base_model, batch, response_only=True)
        full_lp, full_ent = token_logprobs(base_model, batch, response_only=False)
    on = batch.mask.bool()
    assert torch.allclose(lp[on], full_lp[on], atol=1e-5) and torch.allclose(ent[on], full_ent[on], atol=1e-5)
    assert lp.shape == full_lp.shape and (lp[:, : response_start(batch)] == 0).all()


def test_a_groups_prompt_forwarded_once_gives_the_plain_paths_logprobs_and_gradients(toy_model_path):
    """The shared-prompt forward (the prompt once, its KV cache repeated for the samples) is the
    same function as the plain one: equal log-probs on every response token, equal gradients."""
    from learner.batch import collate
    from learner.policy import load_policy, token_logprobs

    model = load_policy(toy_model_path)
    model.eval()
    records = synthetic_groups(model, 3)
    records[1] = dataclasses.replace(records[1], prompt_tokens=np.array([1, 5, 6, 7, 8, 9, 14, 5, 17], np.int32))
    batch = collate(records, torch.zeros(3, 4), 0)
    grads = {}
    for share in (True, False):
        model.zero_grad()
        lp, ent = token_logprobs(model, batch, share_prompt=share)
        (lp * batch.mask).sum().backward()
        grads[share] = (lp.detach(), ent.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]))
    on = batch.mask.bool()
    (lp_s, ent_s, g_s), (lp_p, ent_p, g_p) = grads[True], grads[False]
    assert torch.allclose(lp_s[on], lp_p[on], atol=1e-5) and torch.allclose(ent_s[on], ent_p[on], atol=1e-5)
    assert g_p.abs().max() > 0
    assert (g_s - g_p).abs().max() <= 1e-4 * g_p.abs().max(), ((g_s - g_p).abs().max(), g_p.abs().max())


def test_the_retokenize_arm_trains_the_answers_text_tokenized_again(redis_server, toy_model_path, tmp_path,
                                                                     base_model):
    """learner.retokenize: the step trains the re-tokenized rows and counts what changed (the toy's tokenizer
    reads one character a token, so its answers come back as the same ids; tests/test_retokenize.py has
    answers that change)."""
    learner = make_learner(redis_server, toy_model_path, tmp_path, **{"learner.retokenize": True,
                                                                       "learner.ppo_epochs": 1})
    records = synthetic_groups(base_model, 4, seed=7)
    before = params_vector(learner.model)
    m = learner.train(records)
    assert m["retokenized_changed_tokens"] == 0 and not torch.equal(params_vector(learner.model), before)
    plain = make_learner(redis_server, toy_model_path, tmp_path, **{"learner.ppo_epochs": 1})
    assert "retokenized_changed_tokens" not in plain.train(records)


def test_tool_imitation_trains_the_tools_tokens_beside_the_policy_loss(redis_server, toy_model_path, tmp_path,
                                                                       base_model):
    """learner.tool_imitation: collate marks the environment tokens inside each answer, the step reports
    their negative log-likelihood, and it falls as the term trains them; off, the key is absent."""
    from learner.batch import collate
    records = synthetic_groups(base_model, 4, seed=3)
    for rec in records:
        for s in rec.samples:  # the first answer token becomes a tool's: context only, no behaviour log-prob
            s.mask = np.ones(len(s.tokens), dtype=np.uint8)
            s.mask[0] = 0
            s.logprobs = s.logprobs.copy()
            s.logprobs[0] = 0.0
    batch = collate(records, torch.zeros(len(records), 4), 0, 0)
    plen = len(records[0].prompt_tokens)
    assert batch.env_mask[0, plen - 1] == 1 and batch.env_mask.sum() == sum(len(r.samples) for r in records)
    assert (batch.env_mask * batch.mask).sum() == 0
    overrides = {"learner.ppo_epochs": 1, "task.type": "math", "task.dataset": "mawps:singleop",  # a tool's task
                 "task.tool": "calculator"}
    plain = make_learner(redis_server, toy_model_path, tmp_path, **overrides)
    assert "tool_nll" not in plain.train(records)
    learner = make_learner(redis_server, toy_model_path, tmp_path, **overrides,
                           **{"learner.tool_imitation": 1.0, "learner.lr": 3e-3})
    nll = [learner.train(records)["tool_nll"] for _ in range(4)]
    assert nll[0] > 0 and nll[-1] < nll[0], nll
