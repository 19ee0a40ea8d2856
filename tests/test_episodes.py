"""Multi-turn episodes in the record and the learner (issue 23, item 4 and the learner side of 5).

A sample's ``tokens`` are the whole episode after the prompt, model turns and environment
messages interleaved, with a loss ``mask`` (1 model token, 0 environment token; rlpipe/schema.py).
Here: the mask on the wire (round trip, old records, dead letters) and against the run
(rlpipe/admission.py); the loss, its gradient and every mismatch metric blind to environment
tokens, however wild their values; a learner step on episodes; and a 3-turn episode sampled
by a real fp32 vLLM engine on token ids, recomputed by the learner over the exact ids.
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from learner.batch import collate
from learner.loss import (
    IS_MODES,
    ISSettings,
    POLICY_LOSSES,
    importance_weights,
    kl_terms,
    loss_denominator,
    loss_sum,
    masked_mean,
    mismatch_metrics,
    sequence_kl,
)
from learner.policy import load_policy, token_logprobs
from rlpipe.admission import longest_model_turn
from rlpipe.schema import GroupRecord, Sample, SchemaError, decode_group, encode_group
from tests.test_admission import CURSOR, run_check
from tests.test_schema import make_record

# prompt "12+30=" then: model "42" <eos> | environment " 7=" | model "9" <eos> | environment "8" | model "5"
PROMPT = [1, 5, 6, 14, 7, 4, 17]
TOKENS = [8, 6, 2, 19, 11, 17, 13, 2, 12, 9]
MASK = [1, 1, 1, 0, 0, 0, 1, 1, 0, 1]


def episode(tokens=TOKENS, mask=MASK, lp: float = -0.5, versions=None, reward: float = 1.0) -> Sample:
    mask = np.asarray(mask, dtype=np.uint8)
    return Sample(np.asarray(tokens, dtype=np.int32), np.where(mask == 1, lp, 0.0).astype(np.float32), "stop",
                  reward, None if versions is None else np.asarray(versions, dtype=np.int32), mask=mask)


def episode_record(**overrides) -> GroupRecord:
    samples = [episode(), episode([5, 2, 19, 6, 2], [1, 1, 0, 1, 1], lp=-1.0, reward=0.0)]
    return make_record(**{"samples": samples, "prompt_tokens": np.asarray(PROMPT, dtype=np.int32), **overrides})


# -- the wire ------------------------------------------------------------------------------------------
def test_a_masked_episode_round_trips():
    rec = episode_record()
    raw = msgpack.unpackb(encode_group(rec), raw=False)
    assert raw["samples"][0]["mask"] == bytes(MASK)  # one uint8 per token
    back = decode_group(encode_group(rec))
    for a, b in zip(back.samples, rec.samples):
        assert a.mask.dtype == np.uint8 and a.mask.tolist() == b.mask.tolist()
        assert a.tokens.tolist() == b.tokens.tolist() and a.logprobs.tobytes() == b.logprobs.tobytes()
    assert back.samples[0].model_mask().tolist() == [bool(m) for m in MASK]


def test_a_record_without_a_mask_reads_exactly_as_before():
    """An old record (no mask key) decodes with ``mask`` None, every token the model's, and
    collates to the same batch as the same record with an explicit all-ones mask."""
    old = make_record()
    raw = msgpack.unpackb(encode_group(old), raw=False)
    assert all("mask" not in s for s in raw["samples"])
    back = decode_group(encode_group(old))
    assert all(s.mask is None and s.model_mask().all() for s in back.samples)
    ones = dataclasses.replace(old, samples=[dataclasses.replace(s, mask=np.ones(len(s.tokens), np.uint8))
                                             for s in old.samples])
    a, b = collate([back], torch.zeros(1, 2), 4), collate([decode_group(encode_group(ones))], torch.zeros(1, 2), 4)
    for name in ("input_ids", "mask", "behavior_logprobs", "staleness"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.mask.sum() == sum(len(s.tokens) for s in old.samples)


def payload_with(mask, logprobs=None) -> bytes:
    raw = msgpack.unpackb(encode_group(episode_record()), raw=False)
    raw["samples"][0]["mask"] = mask
    if logprobs is not None:
        raw["samples"][0]["logprobs"] = np.asarray(logprobs, dtype="<f4").tobytes()
    return msgpack.packb(raw, use_bin_type=True)


@pytest.mark.parametrize("mask, logprobs, reason", [
    (bytes(MASK[:-1]), None, r"mask: 9 values for 10 tokens"),
    (bytes([2 if m else 0 for m in MASK]), None, "mask: values other than 0"),
    (bytes(len(MASK)), np.zeros(len(MASK)), "mask: no model token"),
    (list(MASK), None, "mask: expected bytes"),
    # a mask shifted one token against its log-probs: a model token's log-prob at an environment position
    (bytes(MASK[1:] + [0]), None, "logprobs: -0.5 at environment position 2"),
])
def test_a_bad_mask_is_a_dead_letter_with_its_reason(mask, logprobs, reason):
    with pytest.raises(SchemaError, match=reason):
        decode_group(payload_with(mask, logprobs))


def test_the_writer_refuses_a_mask_of_another_length():
    rec = episode_record()
    rec.samples[1].mask = rec.samples[1].mask[:2]
    with pytest.raises(SchemaError, match="samples.1..mask"):
        encode_group(rec)


# -- against the run -----------------------------------------------------------------------------------
def admit(rec) -> None:
    run_check(rec.run_id).check(decode_group(encode_group(rec)), handed_out=CURSOR, reissued=2)


def test_an_episode_is_bounded_per_model_turn_not_in_total():
    """``sampling.max_tokens`` (8 here) bounds each run of model tokens; the episode as a whole
    only by max_model_len with the prompt."""
    turns = [5] * 8 + [19] * 3 + [6] * 8 + [19] * 3 + [7] * 8  # 24 model tokens in 3 turns of 8
    mask = [1] * 8 + [0] * 3 + [1] * 8 + [0] * 3 + [1] * 8
    long_episode = episode(turns, mask)
    assert longest_model_turn(long_episode.mask) == 8
    admit(episode_record(samples=[long_episode, episode()]))
    merged = episode([5] * 9 + [19], [1] * 9 + [0])  # one turn of 9
    with pytest.raises(SchemaError, match="model turn of 9 tokens.*sampling.max_tokens 8"):
        admit(episode_record(samples=[merged, episode()]))
    too_long = episode([5] * 8 + [19] * 60 + [6], [1] * 8 + [0] * 60 + [1])
    with pytest.raises(SchemaError, match="max_model_len"):
        admit(episode_record(samples=[too_long, episode()]))


def test_versions_of_model_tokens_lie_in_the_span_and_environment_tokens_may_reach_the_learners():
    # policy_version 2..3; the learner is at VERSION 4: the last message was appended after an update
    ok = episode(versions=[2, 2, 2, 3, 3, 3, 3, 3, 4, 3])
    admit(episode_record(samples=[ok, episode()], policy_version=2, policy_version_end=3))
    late_model = episode(versions=[2, 2, 2, 3, 3, 3, 3, 3, 3, 4])
    with pytest.raises(SchemaError, match="per-token versions 2..4 outside policy_version 2..3"):
        admit(episode_record(samples=[late_model, episode()], policy_version=2, policy_version_end=3))
    future_env = episode(versions=[2, 2, 2, 3, 3, 9, 3, 3, 3, 3])
    with pytest.raises(SchemaError, match="environment tokens' versions"):
        admit(episode_record(samples=[future_env, episode()], policy_version=2, policy_version_end=3))


def test_staleness_counts_from_the_oldest_model_token():
    first = episode(versions=[3, 3, 3, 1, 1, 1, 4, 4, 4, 4])  # environment tokens' versions do not count
    second = episode([5, 2, 19, 6, 2], [1, 1, 0, 1, 1], versions=[4, 4, 4, 4, 4])
    rec = episode_record(samples=[first, second], policy_version=1, policy_version_end=4)
    assert first.oldest_version(1) == 3 and second.oldest_version(1) == 4 and rec.oldest_version == 3
    assert episode().oldest_version(2) == 2  # no per-token versions: the record's
    assert collate([rec], torch.zeros(1, 2), 6).staleness.tolist() == [3, 2]


def test_the_learner_drops_an_episode_by_its_oldest_model_token(redis_server, toy_model_path, tmp_path):
    """Both episodes were opened at version 1 (``policy_version``); the learner is at 5 with
    ``max_staleness`` 2. One's model turns were all sampled at 3 or later (an update came
    before the model's first turn): 2 versions old, trained. The other's first turn was
    sampled at 1: 4 versions old, dropped and counted."""
    from learner.train import Learner
    from rlpipe.config import build_config
    from tests.conftest import free_run_id

    cfg = build_config({}, environ={}, run_id=free_run_id("ep"), run_dir=str(tmp_path), redis_url=redis_server.url,
                       **{"model.path": toy_model_path, "learner.groups_per_step": 1, "queue.max_staleness": 2,
                          "sampling.n": 2, "rollout.precision": "fp8",
                          "learner.dynamic_sampling": False})  # the episodes' rewards are equal: staleness alone
    learner = Learner(cfg)
    learner.queue.ensure_consumer_group()
    learner.run_counters.version = 5
    short = [5, 2, 19, 6, 2], [1, 1, 0, 1, 1]
    old = episode_record(run_id=cfg.run_id, group_id="old", policy_version=1, policy_version_end=4,
                         samples=[episode(versions=[1, 1, 1, 3, 3, 3, 3, 4, 4, 4]), episode(*short, versions=[3] * 5)])
    fresh = episode_record(run_id=cfg.run_id, group_id="fresh", policy_version=1, policy_version_end=4,
                           samples=[episode(versions=[3, 3, 3, 3, 3, 3, 4, 4, 4, 4]),
                                    episode(*short, versions=[3, 3, 4, 4, 4])])
    assert (old.oldest_version, fresh.oldest_version) == (1, 3)
    current = episode_record(run_id=cfg.run_id, group_id="current", policy_version=5, policy_version_end=5)
    for rec in (old, fresh, current):  # (current: so that a wrong rule fails here rather than waits)
        learner.queue.push(rec)
    batch = learner.collect()
    assert [e.record.group_id for e in batch] == ["fresh"]
    assert learner.queue.counters()["dropped_stale"] == 1 and learner.dropped_stale_total == 1


# -- the loss and the metrics ----------------------------------------------------------------------------
# Two rows, right-padded: row 0 an episode (model, model, env, env, model, env, model), row 1 a
# plain response of 3. Every environment position carries wild values: a log-prob gap of 25
# between learner and rollout, a current policy far off, a huge entropy.
EP_MASK = torch.tensor([[1.0, 1, 0, 0, 1, 0, 1, 0], [1.0, 1, 1, 0, 0, 0, 0, 0]])
ENV = torch.tensor([[0.0, 0, 1, 1, 0, 1, 0, 0], [0.0] * 8])


def _on_model_tokens(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T) -> (N, K): each row's values at its model tokens, right-padded with 0."""
    rows = [x[i][mask[i].bool()] for i in range(len(x))]
    out = torch.zeros(len(x), max(len(r) for r in rows))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _tensors():
    gen = torch.Generator().manual_seed(3)
    pi_old = -torch.rand(2, 8, generator=gen) * 2 - 0.1
    mu = pi_old + torch.randn(2, 8, generator=gen) * 0.3
    delta = torch.randn(2, 8, generator=gen) * 0.2
    entropy = torch.rand(2, 8, generator=gen)
    ref = pi_old + torch.randn(2, 8, generator=gen) * 0.1
    # the environment's positions: wild values any leak would show
    pi_old, mu = pi_old * (1 - ENV) - 0.01 * ENV, mu * (1 - ENV) - 25.0 * ENV
    delta, entropy, ref = delta + 7.0 * ENV, entropy + 1e3 * ENV, ref - 30.0 * ENV
    return pi_old, mu, delta, entropy, ref


def _everything(pi_old, mu, delta, entropy, ref, mask, mode, loss, agg):
    """Every number the learner derives from these tensors: metrics, loss and d loss / d pi."""
    adv = torch.tensor([1.0, -0.7])
    w, is_m = importance_weights(pi_old, mu, mask, ISSettings(mode, cap=1.5, geo_low=0.7, geo_high=1.4))
    pi = (pi_old + delta).requires_grad_(True)
    against = mu if mode in ("ppo_is", "bypass") else pi_old
    per_token, ppo_m = POLICY_LOSSES[loss](pi, against, adv, mask, w, 0.2, 0.28)
    per_token = per_token + 0.1 * kl_terms(pi, ref, mask, "k3") - 0.01 * entropy
    total = loss_sum(per_token, mask, agg) / loss_denominator(mask, agg, norm_length=6)
    total.backward()
    metrics = {**is_m, **ppo_m, **mismatch_metrics(pi_old, mu, mask), "loss": total.item(),
               "entropy": masked_mean(entropy, mask).item(), "tokens": mask.sum().item(),
               "response_length_mean": mask.sum(1).mean().item(),
               "kl_ref": masked_mean(kl_terms(pi_old, ref, mask, "k3"), mask).item(),
               **{f"seq_kl_{i}": v for i, v in enumerate(sequence_kl(pi_old, ref, mask).tolist())}}
    return metrics, w, pi.grad


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
@pytest.mark.parametrize("mode", IS_MODES)
def test_environment_tokens_leave_no_trace_in_the_loss_its_gradient_or_any_metric(mode, loss, agg):
    """The masked episode gives exactly what the same episode gives with its environment
    tokens cut out: every metric, the loss, the IS weights and the gradient of each model
    token; the gradient at environment tokens is 0. The environment positions hold wild
    values, so an implementation that let one of them in would fail."""
    tensors = _tensors()
    masked, w, grad = _everything(*tensors, EP_MASK, mode, loss, agg)
    cut_mask = _on_model_tokens(EP_MASK, EP_MASK)
    cut, cut_w, cut_grad = _everything(*(_on_model_tokens(t, EP_MASK) for t in tensors), cut_mask, mode, loss, agg)
    assert masked.keys() == cut.keys()
    for key in masked:
        assert masked[key] == pytest.approx(cut[key], rel=1e-5, abs=1e-6), key
    assert torch.allclose(_on_model_tokens(w, EP_MASK), cut_w, atol=1e-6)
    assert torch.allclose(_on_model_tokens(grad, EP_MASK), cut_grad, atol=1e-7)
    assert grad[ENV.bool()].abs().max() == 0
    assert w[ENV.bool()].abs().max() == 0
    # and the construction has teeth: trained as model tokens, the environment's values move the metrics
    leaky, _, _ = _everything(*tensors, EP_MASK + ENV, mode, loss, agg)
    assert leaky["mismatch_kl"] != pytest.approx(cut["mismatch_kl"])
    assert leaky["loss"] != pytest.approx(cut["loss"])


# -- a learner step on episodes -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy(toy_model_path):
    return load_policy(toy_model_path)


def recompute(model, rec: GroupRecord) -> list[np.ndarray]:
    """The learner's log-probs of each sample's model tokens, over the exact ids (prompt + episode)."""
    batch = collate([rec], torch.zeros(1, len(rec.samples)), 0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    return [logp[i][batch.mask[i].bool()].numpy() for i in range(len(rec.samples))]


def learner_episodes(model, n_groups: int = 3, seed: int = 0, run_id: str = "run") -> list[GroupRecord]:
    """Groups of 4 episodes of random turns whose environment messages are tokens the toy
    model finds very unlikely (``<pad>``, ``<unk>``, ``%``), with mu = the learner's own
    recompute on the model tokens: a learner that measured environment tokens would see a
    mismatch of several nats there."""
    rng = np.random.default_rng(seed)
    records = []
    for g in range(n_groups):
        prompt = np.array([1, *rng.integers(5, 14, 2), 14, *rng.integers(5, 14, 2), 17], dtype=np.int32)
        samples = []
        for i in range(4):
            tokens, mask = [], []
            for turn in range(3):
                model_turn = [*rng.integers(4, 14, int(rng.integers(1, 4))), 2]
                tokens += model_turn
                mask += [1] * len(model_turn)
                if turn < 2:
                    env = list(rng.choice([0, 3, 18], int(rng.integers(1, 4))))
                    tokens += env
                    mask += [0] * len(env)
            samples.append(Sample(np.array(tokens, np.int32), np.zeros(len(tokens), np.float32), "stop",
                                  float(i % 2), mask=np.array(mask, np.uint8)))
        rec = make_record(run_id=run_id, prompt_tokens=prompt, samples=samples, group_id=f"ep-{seed}-{g}",
                          policy_version=0, policy_version_end=0, precision="fp32")
        for s, exact in zip(rec.samples, recompute(model, rec)):
            s.logprobs[s.mask == 1] = exact
        records.append(decode_group(encode_group(rec)))  # through the wire
    return records


@pytest.mark.parametrize("mode", ["token_tis", "seq_tis", "geo_mask"])
def test_a_learner_step_on_episodes_measures_and_trains_model_tokens_only(mode, redis_server, toy_model_path,
                                                                          tmp_path, toy):
    from tests.test_learner import make_learner, params_vector

    learner = make_learner(redis_server, toy_model_path, tmp_path,
                           **{"learner.is_mode": mode, "learner.groups_per_step": 3, "rollout.precision": "fp32",
                              "sampling.n": 4, "learner.geo_low": 0.9, "learner.geo_high": 1.1})
    records = learner_episodes(toy, run_id=learner.cfg.run_id)
    model_tokens = [int(s.mask.sum()) for r in records for s in r.samples]
    env_tokens = sum(len(s.tokens) for r in records for s in r.samples) - sum(model_tokens)
    # mu at the environment positions is 0 and the toy model gives those tokens a few nats less:
    pi_env = [lp for r in records for s, lp in zip(r.samples, _env_logprobs(toy, r))]
    assert max(float(x.max()) for x in pi_env) < -3.0
    before = params_vector(learner.model)
    m = learner.ppo.train_step(records)
    assert (params_vector(learner.model) - before).abs().max() > 1e-6
    assert abs(m["mismatch_kl"]) < 1e-5 and m["mismatch_k3_kl"] < 1e-6 and m["mismatch_log_ppl_abs_diff"] < 1e-5
    assert m["mismatch_prob_diff_max"] < 1e-5 and m["mismatch_chi2_seq"] < 1e-4
    assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and m["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert m["is_truncated_fraction"] == 0 and m["is_masked_fraction"] == 0 and m["is_masked_seq_fraction"] == 0
    assert m["tokens"] == sum(model_tokens) and m["tokens_masked"] == env_tokens
    turns = [sum(1 for i, x in enumerate(s.mask) if x and (i == 0 or not s.mask[i - 1])) for r in records for s in r.samples]
    assert m["model_turns_mean"] == pytest.approx(np.mean(turns)) and min(turns) > 1
    assert m["response_length_mean"] == pytest.approx(np.mean(model_tokens))
    # the same episodes without their masks (every token trained, mu 0 on the environment's):
    unmasked = [dataclasses.replace(r, samples=[dataclasses.replace(s, mask=None) for s in r.samples])
                for r in records]
    leaky = make_learner(redis_server, toy_model_path, tmp_path,
                         **{"learner.is_mode": mode, "learner.groups_per_step": 3, "rollout.precision": "fp32",
                            "sampling.n": 4}).ppo.train_step(unmasked)
    assert leaky["mismatch_kl"] > 0.5 and leaky["tokens_masked"] == 0 and leaky["model_turns_mean"] == 1


def _env_logprobs(model, rec) -> list[np.ndarray]:
    batch = collate([rec], torch.zeros(1, len(rec.samples)), 0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    prompt = len(rec.prompt_tokens)
    return [logp[i, prompt - 1: prompt - 1 + len(s.tokens)][torch.from_numpy(s.mask == 0)].numpy()
            for i, s in enumerate(rec.samples)]


# -- re-tokenization -----------------------------------------------------------------------------------
def retokenized(tok, ids: list[int]) -> list[int]:
    """What a text-in server trains on: the history decoded to text and tokenized again."""
    return tok(tok.decode(ids), add_special_tokens=False)["input_ids"]


def test_the_toy_tokenizer_does_not_round_trip_some_pairs_of_ids(toy_model_path):
    """Two ids the engine can sample one after the other whose decoded text tokenizes to other
    ids: the toy tokenizer drops a space (``"1 "`` sampled as ``1``, `` `` comes back as ``1``
    alone; any sampled space id is lost). A session that kept text, not ids, would train on ids that were never sampled,
    with behavior log-probs that belong to other tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    pairs = [(a, b) for a in range(4, len(tok)) for b in range(4, len(tok)) if retokenized(tok, [a, b]) != [a, b]]
    assert pairs, "the toy tokenizer round-trips every pair of ordinary ids"
    one, space = tok.get_vocab()["1"], tok.get_vocab()[" "]
    assert (one, space) in pairs and retokenized(tok, [one, space]) == [one]
    history = PROMPT[1:] + TOKENS
    assert retokenized(tok, history) != history  # the episode above: its environment message " 7="


# -- a 3-turn episode against the engine ---------------------------------------------------------------
def engine_episode(worker, tok, before_turn=None) -> GroupRecord:
    """A 3-turn episode sampled by the worker's engine on token ids, as a session keeps it:
    turn 1 from the prompt's ids, an environment message appended (tokenized once), turn 2
    from the whole history's ids, another message, turn 3. ``before_turn(k)`` runs before
    turn k is sampled (a weight update between turns). Each token's version: the engine's
    for a model token, the worker's at append time for an environment token. The record
    goes over the wire (encode and decode) and through the run's admission."""
    from rlpipe.admission import RunCheck

    s = worker.cfg.sampling
    params = {"n": 1, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "max_tokens": min(6, s.max_tokens)}
    prompt = tok("12+30=")["input_ids"]
    # each environment message tokenized once, at append time; the second carries a space id as sampled
    messages = [tok(" 7=", add_special_tokens=False)["input_ids"], [19, *tok("5%", add_special_tokens=False)["input_ids"]]]
    tokens, logprobs, mask, versions, finish = [], [], [], [], None
    for turn in range(3):
        if before_turn:
            before_turn(turn)
        resp = worker.http.post("/v1/generate", json={"prompt_token_ids": prompt + tokens, "seed": 11 + turn, **params})
        resp.raise_for_status()
        body = resp.json()
        (choice,) = body["choices"]
        assert body["policy_version"] == body["policy_version_end"] == worker.version
        assert choice["versions"] is None and choice["tokens"]
        tokens += choice["tokens"]
        logprobs += choice["logprobs"]
        mask += [1] * len(choice["tokens"])
        versions += [body["policy_version"]] * len(choice["tokens"])
        finish = choice["finish_reason"]
        if turn < 2:
            tokens += messages[turn]
            logprobs += [0.0] * len(messages[turn])
            mask += [0] * len(messages[turn])
            versions += [worker.version] * len(messages[turn])
    sample = Sample(np.array(tokens, np.int32), np.array(logprobs, np.float32), finish, 0.0,
                    np.array(versions, np.int32) if len(set(versions)) > 1 else None, mask=np.array(mask, np.uint8))
    rec = decode_group(encode_group(GroupRecord(
        worker.cfg.run_id, "episode", "0", "w0", min(versions), max(versions), "fp32", "",
        {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "max_tokens": s.max_tokens},
        np.array(prompt, np.int32), [sample])))
    vocab = len(tok)
    dataclasses.replace(RunCheck.for_run(worker.cfg, vocab), n=1, version=worker.version).check(rec, 0, 0)
    assert len(tokens) > sum(mask)
    return rec


def model_logprobs(rec: GroupRecord) -> np.ndarray:
    """The record's behavior log-probs at its model tokens."""
    s = rec.samples[0]
    return s.logprobs[s.mask == 1]


@pytest.mark.slow
def test_a_three_turn_episode_recomputes_to_the_engines_logprobs(worker, toy_model_path):
    """The learner's recompute over the exact ids equals the engine's log-probs on every
    model token of a 3-turn episode within the fp32 tolerance of tests/test_worker.py, and
    re-tokenizing the decoded history would not give those ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    model = load_policy(toy_model_path)
    worker.sync(model)  # the engine holds exactly these weights
    rec = engine_episode(worker, tok)
    (ours,) = recompute(model, rec)
    engine = model_logprobs(rec)
    assert len(ours) == len(engine) == int(rec.samples[0].mask.sum())
    assert float(np.abs(ours - engine).max()) < 1e-4
    # the exact ids matter: the model's turns alone, without the messages between them, are other contexts
    s = rec.samples[0]
    turns_only = dataclasses.replace(rec, samples=[dataclasses.replace(s, tokens=s.tokens[s.mask == 1],
                                                                       logprobs=engine, mask=None)])
    (without_env,) = recompute(model, turns_only)
    assert float(np.abs(without_env - engine).max()) > 1e-2
    history = rec.prompt_tokens.tolist() + s.tokens.tolist()
    assert tok(tok.decode(history))["input_ids"] != history  # what a text-in server would have trained on


@pytest.mark.slow
def test_an_update_between_turns_shows_in_the_versions_and_staleness_counts_the_oldest_model_token(
        worker, toy_model_path):
    """Weights change between turn 2 and turn 3: the per-token versions say which turn each
    model token came from, the recompute under the old weights equals the engine on turns 1-2
    and under the new ones on turn 3, and the learner at the new version counts the episode
    one version stale (its oldest model token's)."""
    from transformers import AutoTokenizer

    from tests.test_worker import perturbed

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    old, new = perturbed(toy_model_path, seed=8), perturbed(toy_model_path, seed=9)
    v_old = worker.sync(old)
    rec = engine_episode(worker, tok, before_turn=lambda turn: turn == 2 and worker.sync(new))
    v_new = worker.version
    s = rec.samples[0]
    assert v_new == v_old + 1 and (rec.policy_version, rec.policy_version_end) == (v_old, v_new)
    model_versions = s.versions[s.mask == 1]
    later = model_versions == v_new
    assert later.any() and not later.all() and (model_versions[~later] == v_old).all()
    assert (s.versions[s.mask == 0] == v_old).all()  # both messages were appended before the update
    (under_old,), (under_new,) = recompute(old, rec), recompute(new, rec)
    engine = model_logprobs(rec)
    assert float(np.abs(under_old[~later] - engine[~later]).max()) < 1e-4
    assert float(np.abs(under_new[later] - engine[later]).max()) < 1e-4
    assert float(np.abs(under_old[later] - engine[later]).max()) > 1e-2  # turn 3 really is the new policy's
    assert rec.oldest_version == v_old and collate([rec], torch.zeros(1, 1), v_new).staleness.tolist() == [1]
